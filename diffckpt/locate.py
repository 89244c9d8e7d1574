"""Where a step lies: the one decision every restore goes through.

``resume``, ``restore``, :func:`diffckpt.load_state`, exports, ``diffckpt verify`` and compaction
ask :func:`locate` what a step is made of. It lists the run root once (rank streams included)
and answers: a step of an unsharded session (rebuilt from the root's bases and segments, planned
by :mod:`diffckpt.planning`), or a step durable on every rank of a sharded session (each rank's
stream, :mod:`diffckpt.reassembly`). The same listing serves the plan that follows, so a restore
lists storage once.
"""

from __future__ import annotations

from dataclasses import dataclass

from .inventory import Inventory
from .runstore import RUN_FILE, RunStore
from .shardedrun import Resolution, ShardedRun
from .storage import Storage

__all__ = ["Located", "locate"]


@dataclass(frozen=True)
class Located:
    """A step located in a run root, with the listing it was located from."""

    run: ShardedRun  # the root and its rank streams, over the one listing
    step: int | None  # as asked (``None``: the newest durable step)
    sharded: Resolution | None  # the sharded session and step, or ``None``: an unsharded session

    @property
    def storage(self) -> Storage:
        return self.run.storage

    @property
    def store(self) -> RunStore:
        return self.run.root

    @property
    def inv(self) -> Inventory:
        """The run root's inventory (of the same listing)."""
        return self.run.top

    @property
    def is_run(self) -> bool:
        """Whether the root holds a run (``run.json``), durable steps or not."""
        return RUN_FILE in self.inv.sizes


def locate(storage: Storage, step: int | None = None, *, listing: dict[str, int] | None = None) -> Located:
    """Where ``step`` (``None``: the newest durable step) of the run root at ``storage`` lies.

    ``listing``: the root's listing if the caller took one (else it is listed here, once).

    Raises:
        CheckpointNotFoundError: the root holds sharded sessions and nothing is durable on every
            rank, or ``step`` is not. (A plain run that lacks the step raises when it is planned.)
    """
    run = ShardedRun(storage, storage.list("") if listing is None else listing)
    return Located(run, step, run.resolve(step))
