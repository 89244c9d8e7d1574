"""A sharded run on storage: the run root's sessions and one stream per rank, and where a step
durable on every rank lies (replaying and reassembling it: :mod:`diffckpt.reassembly`).

Sharded training (FSDP2) writes, per session, a root session file naming the world size
(``"sharded": {"world_size": N}``) and, under ``ranks/r<rank>/``, each rank's own stream: an
ordinary run (sessions, bases, segments, as in ``docs/format.md``) of that rank's pieces as plain
tensors, plus the shard table in its session file. Nothing is exchanged between ranks per step:

- a step is **durable** once every rank's stream has it; the newest such step of a session is the
  smallest of the ranks' newest durable steps, computed here from listings alone;
- each rank replays its own stream on plain tensors (the optimizers' steps are elementwise, so
  replaying a piece equals replaying the whole and cutting it), which is how both a same-layout
  resume (in parallel, one stream per rank) and a reassembly into full tensors (any other layout,
  offline tools) work.

Everything here reads listings and session files only (no torch): ``diffckpt ls`` and ``gc`` use it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from .errors import CheckpointNotFoundError
from .inventory import Inventory
from .planning import plan_for
from .rankstreams import RANKS_DIR, rank_prefix
from .runstore import RunStore, session_path
from .storage import Storage
from .storage.prefixed import substorage

__all__ = ["Resolution", "ShardedRun", "rank_streams"]

log = logging.getLogger("diffckpt")


@dataclass(frozen=True)
class Resolution:
    """A step of a sharded session: its generation, world size and step."""

    gen: int
    world_size: int
    step: int


class ShardedRun:
    """The sharded sessions of the run root at ``storage`` and their rank streams.

    ``listing``: one listing of the whole root (``storage.list("")``, rank streams included),
    from which the root's and every stream's inventory are classified without listing again
    (a restore); without one, each inventory is listed when asked for (training and retention,
    which look again and again).
    """

    def __init__(self, storage: Storage, listing: dict[str, int] | None = None) -> None:
        self.storage = storage
        self.root = RunStore(storage)
        self.listing = listing
        self._streams: dict[int, RunStore] = {}
        self._top: Inventory | None = None

    @property
    def top(self) -> Inventory:
        """The root's inventory: from the listing given, else listed once now."""
        if self._top is None:
            self._top = self.root.inventory(self.listing)
            self.listing = self._top.sizes
        return self._top

    def stream(self, rank: int) -> RunStore:
        """Rank ``rank``'s stream (a run of its own, under ``ranks/r<rank>/``)."""
        if rank not in self._streams:
            self._streams[rank] = RunStore(substorage(self.storage, rank_prefix(rank)))
        return self._streams[rank]

    def world(self, gen: int) -> int | None:
        """The world size of root session ``gen`` if it is sharded, else ``None``."""
        try:
            meta = json.loads(self.storage.read(session_path(gen)))
        except (CheckpointNotFoundError, ValueError, RecursionError):
            return None  # damaged or vanished: not readable as a sharded session
        sharded = meta.get("sharded") if isinstance(meta, dict) else None
        if isinstance(sharded, dict) and isinstance(sharded.get("world_size"), int):
            return sharded["world_size"]
        return None

    def sessions(self, inv: Inventory | None = None) -> dict[int, int]:
        """``{gen: world size}`` of the root's sharded sessions (none without rank streams)."""
        inv = inv or self.top
        if not any(p.startswith(RANKS_DIR + "/") for p in inv.sizes):
            return {}
        return {gen: w for gen in inv.sessions if (w := self.world(gen)) is not None}

    def inventory(self, rank: int) -> Inventory:
        """Rank ``rank``'s stream classified: from the root's listing when one was given, else
        listed now."""
        if self.listing is None:
            return self.stream(rank).inventory()
        prefix = rank_prefix(rank)
        return self.stream(rank).inventory({p[len(prefix):]: n for p, n in self.listing.items()
                                            if p.startswith(prefix)})

    def inventories(self, world: int) -> list[Inventory]:
        return [self.inventory(r) for r in range(world)]

    @staticmethod
    def durable(gen: int, invs: list[Inventory]) -> int | None:
        """The newest step of session ``gen`` that every rank's stream rebuilds (``None``: none).

        Not simply the smallest of the ranks' newest steps: a rank ahead may no longer reach
        that step (its older base compacted away), so the spans every rank reaches are
        intersected."""
        common = invs[0].durable_spans(gen) if invs else []
        for inv in invs[1:]:  # merged, sorted spans: their pairwise overlaps stay sorted
            common = [(max(a, c), min(b, d)) for a, b in common for c, d in inv.durable_spans(gen)
                      if max(a, c) <= min(b, d)]
        return common[-1][1] if common else None

    def based(self, gen: int, world: int, step: int) -> bool:
        """Whether every rank's stream of session ``gen`` has committed a base at ``step`` or later
        (bases are written at the same steps on every rank)."""
        return all(any(b.gen == gen and b.step >= step for b in inv.bases) for inv in self.inventories(world))

    @staticmethod
    def reaches(gen: int, step: int, invs: list[Inventory]) -> bool:
        """Whether every rank's stream of session ``gen`` rebuilds ``step``."""
        return all(any(b.gen == gen and b.step <= step <= inv.chain_end(b) for b in inv.bases) for inv in invs)

    def resolve(self, step: int | None = None) -> Resolution | None:
        """The sharded session and step to restore for ``step`` (``None``: the newest step durable
        on every rank of the newest session that has one), or ``None`` when the step belongs to an
        unsharded session of the root (restored as usual).

        Raises:
            CheckpointNotFoundError: nothing is durable on every rank, or ``step`` is not.
        """
        top = self.top  # the one listing of the root: rank streams are classified from it too
        if not any(p.startswith(RANKS_DIR + "/") for p in top.sizes):
            return None  # no rank streams: an ordinary run
        plain = {b.gen for b in top.bases}
        seen: dict[int, list[Inventory]] = {}
        spans = []
        for gen in sorted(set(top.sessions) | plain, reverse=True):  # newest first, read lazily
            world = None if gen in plain else self.world(gen)
            if world is None:
                if gen not in plain:
                    continue  # a session that never committed a base at the root
                if step is None or any(plan_for(top, b, step) for b in top.bases if b.gen == gen):
                    return None
                continue
            invs = seen.setdefault(world, self.inventories(world))
            newest = self.durable(gen, invs)
            spans.append(f"g{gen} ({world} ranks): {'none' if newest is None else f'up to {newest}'}")
            if step is None and newest is not None:
                return Resolution(gen, world, newest)
            if step is not None and self.reaches(gen, step, invs):
                return Resolution(gen, world, step)
        what = "no step is durable on every rank" if step is None else f"step {step} is not durable on every rank"
        raise CheckpointNotFoundError(
            f"{what} under {self.storage.url} (durable everywhere: {'; '.join(spans) or 'none'}). "
            "A rank's stream is behind or damaged: see `diffckpt ls`; restore an earlier step")


def rank_streams(storage: Storage) -> list[str]:
    """The rank stream prefixes present under a run root (``ranks/r00000/``, ...)."""
    found = {"/".join(p.split("/", 2)[:2]) + "/" for p in storage.list("ranks/") if p.count("/") >= 2}
    return sorted(found)
