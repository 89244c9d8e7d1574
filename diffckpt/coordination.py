"""The processes of a training job, and the few exchanges checkpointing makes between them.

:class:`Coordinated` is the part of :class:`~diffckpt.CheckpointEngine` that knows the processes:
its :class:`~diffckpt.collective.Collective` (looked up at each use), the rank and world size, and
the small exchanges the engine needs (a flag reduced across ranks, a decision rank 0 takes and
sends, every rank's outcome of a restore). Nothing here moves tensors between ranks.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from .collective import Collective, default_collective
from .errors import DiffCkptError
from .options import CheckpointOptions
from .recorder import Recorder
from .storage import Storage

__all__ = ["Coordinated"]

log = logging.getLogger("diffckpt")


class Coordinated(Recorder):
    """A :class:`~diffckpt.recorder.Recorder` that knows the processes training together.

    Args:
        dirpath, options, storage_options: as for :class:`~diffckpt.recorder.Recorder`.
        collective: the processes training together; ``None``: the default ``torch.distributed``
            process group when there is one, else this process alone.
    """

    def __init__(self, dirpath: str | os.PathLike[str] | Storage, options: CheckpointOptions | None = None,
                 storage_options: dict[str, Any] | None = None, *, collective: Collective | None = None) -> None:
        super().__init__(dirpath, options, storage_options)
        self._collective = collective

    @property
    def collective(self) -> Collective:
        """The processes training together: the one given, else the default process group when
        it spans several processes (looked up at each use: it may be set up after the engine)."""
        return self._collective if self._collective is not None else default_collective()

    @property
    def rank(self) -> int:
        return self.collective.rank

    @property
    def world_size(self) -> int:
        return self.collective.world_size

    @property
    def is_main_process(self) -> bool:
        """Whether this process writes what exists once per run (sessions, references)."""
        return self.collective.rank == 0

    def agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any process (every rank calls): e.g. a stop request that
        one rank received, so that every rank stops at the same step."""
        return self.collective.any(flag)

    def own(self, ranks: list[Any]) -> Any:
        """This rank's entry of a per-rank list recorded at a step, or ``None`` (with a warning)
        when the run was recorded on another number of processes."""
        if len(ranks) == self.world_size:
            return ranks[self.rank]
        log.warning("diffckpt: the run was trained on %d processes and resumes on %d; each rank's data "
                    "position and RNG depend on the process count and cannot be carried over, so rank "
                    "0's are used (the resumed run will not be bit-exact)", len(ranks), self.world_size)
        return None


    # -------------------------------------------------------------- exchanges
    def _decided(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run on rank 0 and sent to every rank, or rank 0's error raised everywhere."""
        coll = self.collective
        if coll.world_size == 1:
            return fn()
        if self.is_main_process:
            try:
                value = fn()
            except BaseException as exc:
                coll.broadcast(("error", f"{type(exc).__name__}: {exc}"))
                raise
            coll.broadcast(("ok", value))
            return value
        kind, value = coll.broadcast(None)
        if kind == "error":
            raise DiffCkptError(f"restore failed on process 0 ({value}); no process was restored")
        return value

    def _everyone(self, fn: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any] | None, list[tuple[str, Any]]]:
        """``fn()`` (a replayed state) on every rank: this rank's state, and every rank's
        ``("ok", step)`` or ``("error", message)``, so that one rank's failure stops all and none
        waits forever. Only the small outcome is exchanged."""
        value: dict[str, Any] | None = None
        try:
            value = fn()
            mine: tuple[str, Any] = ("ok", value["step"])
        except Exception as exc:  # any failure: every rank must hear of it, or the others wait forever
            log.debug("diffckpt: restore failed on rank %d", self.rank, exc_info=True)
            mine = ("error", f"{type(exc).__name__}: {exc}")
        coll = self.collective
        if coll.world_size == 1:
            return value, [mine]
        gathered = coll.gather(mine)  # every rank takes part; rank 0 gets the list
        return value, coll.broadcast(gathered)

    @staticmethod
    def _outcome(url: str, step: int, outcome: list[tuple[str, Any]]) -> list[int]:
        errors = [f"rank {r}: {v}" for r, (kind, v) in enumerate(outcome) if kind == "error"]
        if errors:
            raise DiffCkptError(f"restoring step {step} of {url} failed: {'; '.join(errors)}")
        return [v for _, v in outcome]
