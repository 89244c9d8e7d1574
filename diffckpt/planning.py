"""Which base and segments rebuild a step of one stream (a plain run, or one rank's stream of a
sharded run): plans from an :class:`~diffckpt.inventory.Inventory`, best first, and the base of
the first plan that can be loaded.

Where a step lies when a run root holds sharded sessions too is decided once, above this, by
:func:`diffckpt.locate.locate`; every restore goes through it.

A session that a resume started at a restored step continues that step (its session file's
``continues``: the session and step restored) and writes no base there. Until its own first base
is committed (due as the run's next), its steps are rebuilt from the session it continues: that
session's base and segments up to the step (through its own link, if it has no base yet either),
then its own segments. So a restart neither waits for nor writes a whole state, and a crash in
the meantime loses nothing that the node-local tier journaled.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from .errors import CheckpointNotFoundError, CorruptRecordError
from .format import BaseName
from .inventory import Inventory, RestorePlan, merged_spans
from .runstore import RUN_FILE, RunStore

__all__ = ["candidates", "continuations", "continued", "continued_end", "durable_ranges", "newest_continuing",
           "open_plan", "plan", "plan_for", "session_spans"]


def plan(store: RunStore, step: int | None = None, inv: Inventory | None = None) -> RestorePlan:
    """Choose the base and segments for ``step`` (``None``: the newest durable step).

    The newest session with a committed base wins for ``None``; an explicit step is looked up
    from the newest session to the oldest. This is the first of :func:`candidates`.
    """
    return candidates(store, step, inv)[0]


def candidates(store: RunStore, step: int | None = None, inv: Inventory | None = None,
               gen: int | None = None) -> list[RestorePlan]:
    """Every plan of one session that rebuilds ``step``, best first.

    For ``None``: each committed base of the newest session with one, ordered by how far its
    chain reaches, then newest base first (least replay). For an explicit step: the bases of the
    newest session that reaches ``step``, newest first. ``gen``: only that session's. ``inv``:
    a listing already taken (else the stream is listed now). A newer session without a committed
    base that continues another's step and has segments after it comes first, planned through
    that session's bases (see the module).

    Raises:
        CheckpointNotFoundError: nothing is committed, or ``step`` is not durable.
    """
    inv = inv or store.inventory()
    if not inv.bases:
        raise CheckpointNotFoundError(_nothing_here(store.storage.url, inv))
    for g in inv.gens():
        if gen is not None and g != gen:
            continue
        bases = sorted((b for b in inv.bases if b.gen == g), reverse=True)
        if step is None and bases:
            plans = [RestorePlan(base, inv.chain(base), inv.chain_end(base), True) for base in bases]
            plans.sort(key=lambda p: p.target, reverse=True)  # stable: newest base first
            return _sized(plans, inv)
        found = [p for p in (plan_for(inv, b, step) for b in bases) if p is not None] if step is not None else []
        # a step before the session's first base (none committed, or compacted later): through its link
        found = found or _through_continued(store, inv, g, step)
        if found:
            return _sized(found, inv)
    raise CheckpointNotFoundError(
        f"step {step} is not durable under {store.storage.url}; durable steps: {durable_ranges(store, inv)}. "
        "Pick one of those (see `diffckpt ls`).")


def plan_for(inv: Inventory, base: BaseName, step: int) -> RestorePlan | None:
    """The plan that rebuilds ``step`` from ``base``, or ``None`` when its chain does not reach it."""
    if base.step > step:
        return None
    if base.step == step:
        return RestorePlan(base, [], step, False)
    segs = []
    for seg in inv.chain(base):
        segs.append(seg)
        if seg.last >= step:
            return RestorePlan(base, segs, step, False)
    return None


def continued(store: RunStore, gen: int) -> tuple[int, int] | None:
    """``(session, step)`` that session ``gen`` continues (its session file's ``continues``,
    written by a resume that restored that step in this stream), or ``None``."""
    try:
        link = store.session_meta(gen).get("continues")
    except (CheckpointNotFoundError, CorruptRecordError):  # no session file: it continues nothing
        return None
    if not isinstance(link, dict):
        return None
    parent, step = link.get("gen"), link.get("step")
    if not isinstance(parent, int) or not isinstance(step, int) or not 0 < parent < gen:
        return None
    return parent, step


def continued_end(store: RunStore, inv: Inventory, gen: int, link: tuple[int, int] | None = None) -> int | None:
    """The newest step of session ``gen``, which has no committed base, that a restore rebuilds
    through the session it continues: the step it continues, or the end of its own segments
    after it; ``None`` when it continues nothing, or nothing rebuilds that step. ``link``: what
    :func:`continued` said already (else its session file is read)."""
    link = link or continued(store, gen)
    if link is None or not _upstream(store, inv, link):
        return None
    return inv.chain_end(BaseName(link[1], gen))


def continuations(store: RunStore, inv: Inventory) -> dict[int, tuple[int, int]]:
    """``{gen: (session, step)}`` that each session with segments before its first base (none
    committed, or one compacted later) continues; only those sessions' files are read."""
    first: dict[int, int] = {}
    for b in inv.bases:
        first[b.gen] = min(first.get(b.gen, b.step), b.step)
    early = {s.gen for s in inv.segments if s.after < first.get(s.gen, s.after + 1)}
    return {g: link for g in sorted(early) if (link := continued(store, g)) is not None}


def newest_continuing(store: RunStore, inv: Inventory, links: dict[int, tuple[int, int]] | None = None
                      ) -> tuple[int, int, int] | None:
    """``(gen, session, step)`` when the newest session that matters has no committed base of its
    own and continues ``step`` of ``session``, which a restore can rebuild; else ``None``.
    ``links``: :func:`continuations` read already (a session file it holds is not read again)."""
    for gen in inv.gens():
        if any(b.gen == gen for b in inv.bases):
            return None
        link = (links or {}).get(gen) or continued(store, gen)
        if link is not None and continued_end(store, inv, gen, link) is not None:
            return gen, *link
    return None


def _upstream(store: RunStore, inv: Inventory, link: tuple[int, int]) -> list[RestorePlan]:
    """The plans of session ``link[0]`` for its step ``link[1]`` that a continuing session's
    segments can follow: those whose own last segment (or base) ends exactly there, as a resume
    links only to such a step (:attr:`diffckpt.replay.ReplayResult.continues`)."""
    parent, at = link
    try:
        plans = candidates(store, at, inv, parent)
    except CheckpointNotFoundError:  # the step continued is gone: what continues it cannot be rebuilt
        return []
    return [p for p in plans if (p.through_target()[-1].last if p.segments else p.base.step) == at]


def _through_continued(store: RunStore, inv: Inventory, gen: int, step: int | None) -> list[RestorePlan]:
    """Plans for ``step`` of session ``gen`` (no committed base of its own) through the session
    it continues: every plan of that session for the step continued, followed by ``gen``'s
    segments after it. Empty when ``gen`` continues nothing, has no segment after the step it
    continues, or does not reach ``step``."""
    link = continued(store, gen)
    if link is None:
        return []
    at = link[1]
    own = inv.chain(BaseName(at, gen))
    if not own or (step is not None and not at < step <= own[-1].last):
        return []
    target = own[-1].last if step is None else step
    mine = RestorePlan(BaseName(at, gen), own, target, False).through_target()
    return [RestorePlan(p.base, p.through_target() + mine, target, step is None, gen=gen)
            for p in _upstream(store, inv, link)]


def open_plan(store: RunStore, step: int | None = None, inv: Inventory | None = None,
              gen: int | None = None, read: Callable[[RestorePlan], tuple[dict[str, Any], Any]] | None = None,
              plans: list[RestorePlan] | None = None) -> tuple[RestorePlan, dict[str, Any], Any]:
    """Choose a plan for ``step`` (``None``: newest durable) and load its base: ``read(plan)``
    (default: :meth:`RunStore.load_base` of its base), which a restore gives to read the base
    straight into the live model (:func:`diffckpt.replay.read_base_into`).

    Returns ``(plan, commit info, base state tree)``. A base that cannot be used (its COMMIT
    marker is damaged or unreadable, its state file is missing or fails its checksum) is skipped
    with a warning, and the next of :func:`candidates` is tried: an older committed base of the
    same session that reaches ``step`` (for ``None``: the one whose chain reaches furthest, so the
    step restored may be older). For ``None``, a warning also says when committed segments of
    that session lie beyond the step chosen (a missing segment cut the chain). Steps of other
    sessions are never used in place of damaged ones. ``inv`` and ``gen`` as for
    :func:`candidates`; ``plans``: what it returned already, if the caller asked it.

    Raises:
        CheckpointNotFoundError: nothing is committed, or ``step`` is not durable.
        CorruptRecordError: no candidate base can be loaded.
    """
    inv = inv or store.inventory()
    problems: list[str] = []
    for found in plans if plans is not None else candidates(store, step, inv, gen):
        try:
            info, tree = read(found) if read is not None else store.load_base(found.base)
        except (CorruptRecordError, CheckpointNotFoundError) as exc:
            problems.append(str(exc))
            continue
        if problems:
            warnings.warn(f"diffckpt: {'; '.join(problems)}; using the older base at step "
                          f"{found.base.step} instead, restoring step {found.target}", stacklevel=4)
        beyond = [s for s in inv.segments if s.gen == found.gen and s.last > found.target]
        if found.latest and beyond:
            warnings.warn(
                f"diffckpt: nothing continues session g{found.gen} after step {found.target} "
                f"(a segment is missing before {beyond[0].path}); its steps up to "
                f"{max(s.last for s in beyond)} cannot be rebuilt. Restoring step {found.target}, "
                "the newest step before the gap", stacklevel=4)
        return found, info, tree
    raise CorruptRecordError(
        f"no usable base for {'the newest step' if step is None else f'step {step}'} under "
        f"{store.storage.url}: {'; '.join(problems)}. Restore an earlier step (see `diffckpt ls`) "
        "or check the storage with `diffckpt verify`")


def session_spans(store: RunStore, inv: Inventory) -> dict[int, list[tuple[int, int]]]:
    """Durable step intervals of each session with any, merged and sorted: those its bases'
    chains reach and, for a session that continues another, those before its first base that a
    restore rebuilds through it (from the step continued)."""
    links, out = continuations(store, inv), {}
    for gen in sorted({b.gen for b in inv.bases} | set(links)):
        spans, link = inv.durable_spans(gen), links.get(gen)
        end = continued_end(store, inv, gen, link) if link is not None else None
        if link is not None and end is not None and end > link[1]:
            spans = merged_spans([(link[1], end), *spans])
        if spans:
            out[gen] = spans
    return out


def durable_ranges(store: RunStore, inv: Inventory) -> str:
    """Durable steps per session as merged ranges, e.g. ``g1: 0..5, 10..13``."""
    parts = [f"g{gen}: " + ", ".join(f"{lo}..{hi}" for lo, hi in spans)
             for gen, spans in session_spans(store, inv).items()]
    return "; ".join(parts) or "none"


def _nothing_here(url: str, inv: Inventory) -> str:
    if "" in inv.sizes:  # an object at the root itself: the path names a file
        return (f"{url} is a file, not a run directory: pass the directory (or URL prefix) that "
                "the run was written to")
    if not inv.sizes:
        return (f"nothing under {url}: the path does not exist or is empty. Check the path (and "
                "storage_options for remote URLs), or train first to create the run")
    if RUN_FILE not in inv.sizes:
        return f"{url} is not a diffckpt run (it has no {RUN_FILE}): check the path"
    return (f"no committed checkpoint under {url} yet: the run never committed a base, so no "
            "step is durable. Train until the first base is written")


def _sized(plans: list[RestorePlan], inv: Inventory) -> list[RestorePlan]:
    """``plans`` with the listed size of each of their segments, which bounds prefetching."""
    for found in plans:
        found.sizes = {s.path: inv.sizes.get(s.path, 0) for s in found.segments}
    return plans
