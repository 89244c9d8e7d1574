"""One listing of a run root, classified: sessions, committed bases, segments, and the chains
that make steps restorable.

A chain is a committed base followed by segments whose ``after`` equals the previous ``last``;
it ends at the first gap. Every question about what is durable (a base's chain end, a session's
newest step, its merged durable spans) is answered here, from chains computed once per listing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .format import BaseName, SegmentName

__all__ = ["Inventory", "RestorePlan", "merged_spans"]


@dataclass
class RestorePlan:
    """What to read to rebuild ``target``: one base and the segments after it.

    ``gen`` is the session whose step ``target`` is: the base's own, except for a session that
    continues another's step and has no committed base yet (:func:`diffckpt.planning.candidates`),
    whose plan starts from the other session's base and crosses into its own segments.
    """

    base: BaseName
    segments: list[SegmentName]
    target: int
    latest: bool
    sizes: dict[str, int] = field(default_factory=dict)  # encoded bytes per segment path, if listed
    gen: int = -1  # -1: the base's session

    def __post_init__(self) -> None:
        if self.gen < 0:
            self.gen = self.base.gen

    def through_target(self) -> list[SegmentName]:
        """The segments up to the one holding ``target``: a plan cut back to an earlier target
        (replay redoing a shorter replay) still lists those after it, and they are never read."""
        out = []
        for seg in self.segments:
            out.append(seg)
            if seg.last >= self.target:
                break
        return out


@dataclass
class Inventory:
    """One listing of a run root, classified.

    An inventory describes one listing and is not changed after :meth:`RunStore.inventory`
    builds it, so every base's chain is computed once, on first use, and answers every later
    question (chain ends, durable spans, newest steps): recomputing a chain per question is
    quadratic on runs with thousands of segments and many bases.
    """

    sessions: dict[int, dict[str, Any]] = field(default_factory=dict)
    bases: list[BaseName] = field(default_factory=list)
    segments: list[SegmentName] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)
    _chains: dict[BaseName, tuple[SegmentName, ...]] | None = field(
        default=None, init=False, repr=False, compare=False)

    @property
    def chains(self) -> Mapping[BaseName, tuple[SegmentName, ...]]:
        """Every committed base's chain (read-only), computed once for this inventory."""
        return MappingProxyType(self._built())

    def chain(self, base: BaseName) -> list[SegmentName]:
        """Segments that continue ``base`` without a gap, oldest first (a new list)."""
        return list(self._chain(base))

    def chain_end(self, base: BaseName) -> int:
        """The last step ``base``'s chain reaches (``base.step`` when nothing continues it)."""
        chain = self._chain(base)
        return chain[-1].last if chain else base.step

    def _built(self) -> dict[BaseName, tuple[SegmentName, ...]]:
        if self._chains is None:
            self._chains = _all_chains(self.bases, self.segments)
        return self._chains

    def _chain(self, base: BaseName) -> tuple[SegmentName, ...]:
        chain = self._built().get(base)
        if chain is None:  # not a base of this listing: computed, not cached
            chain = _all_chains([base], self.segments)[base]
        return chain

    def durable_spans(self, gen: int) -> list[tuple[int, int]]:
        """Merged step intervals of session ``gen`` that its bases' chains reach, sorted."""
        return merged_spans([(b.step, self.chain_end(b)) for b in self.bases if b.gen == gen])

    def newest_step(self, gen: int) -> int | None:
        """Newest durable step of session ``gen`` (``None`` if it has no committed base)."""
        return max((self.chain_end(b) for b in self.bases if b.gen == gen), default=None)

    def gens(self) -> list[int]:
        return sorted({b.gen for b in self.bases} | set(self.sessions), reverse=True)


def merged_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Step intervals ``(lo, hi)`` merged where they overlap or touch, sorted."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _all_chains(bases: list[BaseName], segments: list[SegmentName]) -> dict[BaseName, tuple[SegmentName, ...]]:
    """The chain of each of ``bases``, in time linear in the segments (plus copying the chains).

    A chain continues with the longest segment after its last step, so two chains that reach the
    same step go on alike: walking bases newest first, a walk stops at the first step where a
    newer base of its session starts and takes that base's chain from there.
    """
    by_after: dict[tuple[int, int], SegmentName] = {}  # (gen, after) -> the longest segment
    for seg in segments:
        if seg.last <= seg.after:  # a damaged name that does not advance would never end a walk
            continue
        current = by_after.get((seg.gen, seg.after))
        if current is None or seg.last > current.last:
            by_after[(seg.gen, seg.after)] = seg
    out: dict[BaseName, tuple[SegmentName, ...]] = {}
    starts: dict[tuple[int, int], tuple[SegmentName, ...]] = {}  # (gen, step) -> chain from there
    for base in sorted(bases, reverse=True):
        walked = []
        key = (base.gen, base.step)
        while key not in starts and (step_on := by_after.get(key)) is not None:
            walked.append(step_on)
            key = (base.gen, step_on.last)
        out[base] = starts[(base.gen, base.step)] = (*walked, *starts.get(key, ()))
    return out
