"""The processes of a training job, and the few exchanges checkpointing makes between them.

:class:`Coordination` is what :class:`~diffckpt.CheckpointEngine` holds to know the processes:
its :class:`~diffckpt.collective.Collective` (looked up at each use), the rank and world size,
and the small exchanges the engine needs: a flag reduced across ranks, a decision rank 0 takes
and every rank gets (:meth:`~Coordination.decided`, the one place that sends rank 0's answer or
its error), every rank's outcome of a restore, and the replicas' checksums compared. Nothing here
moves tensors between ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from .collective import Collective, default_collective
from .errors import DiffCkptError, ReplicaDivergenceError
from .replicas import replica_problems, replica_sums
from .tuning.model import tuning_metrics
from .tuning.online import OnlineTuning

__all__ = ["Coordination"]

log = logging.getLogger("diffckpt")


class Coordination:
    """The processes training together.

    Args:
        collective: the processes; ``None``: the default ``torch.distributed`` process group
            when there is one, else this process alone (looked up at each use: it may be set up
            after the engine).
    """

    def __init__(self, collective: Collective | None = None) -> None:
        self._collective = collective

    @property
    def collective(self) -> Collective:
        return self._collective if self._collective is not None else default_collective()

    @property
    def rank(self) -> int:
        return self.collective.rank

    @property
    def world_size(self) -> int:
        return self.collective.world_size

    @property
    def is_main_process(self) -> bool:
        return self.collective.rank == 0

    def agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any process (every rank calls)."""
        return self.collective.any(flag)

    def own(self, ranks: list[Any]) -> Any:
        """This rank's entry of a per-rank list recorded at a step, or ``None`` (with a warning)
        when the run was recorded on another number of processes."""
        if len(ranks) == self.world_size:
            return ranks[self.rank]
        log.warning("diffckpt: the run was trained on %d processes and resumes on %d; each rank's RNG "
                    "streams cannot be carried over to another process count, so rank 0's are used on "
                    "every rank (the resumed run will not be bit-exact). Which data loaders continue "
                    "the interrupted epoch over the new processes: docs/sharded.md, 'Data order on "
                    "another number of processes'", len(ranks), self.world_size)
        return None

    def decided(self, fn: Callable[[], Any], what: str, send: Callable[[Any], Any] = lambda v: v,
                then: str = "") -> Any:
        """``fn()`` run on rank 0, and ``send(value)`` given to every other rank; rank 0's error
        is raised on every rank (as :class:`DiffCkptError` saying ``what`` failed, and ``then``,
        what follows from it), so that none waits forever. Rank 0 returns ``fn()`` itself, the
        others what was sent."""
        coll = self.collective
        if coll.world_size == 1:
            return fn()
        if coll.rank == 0:
            try:
                value = fn()
            except BaseException as exc:
                coll.broadcast(("error", f"{type(exc).__name__}: {exc}"))
                raise
            coll.broadcast(("ok", send(value)))
            return value
        kind, value = coll.broadcast(None)
        if kind == "error":
            raise DiffCkptError(f"{what} failed on process 0 ({value})" + (f"; {then}" if then else ""))
        return value

    def everyone(self, fn: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any] | None, list[tuple[str, Any]]]:
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

    def rank_states(self, source: Any, sharded: bool) -> list[Any] | None:
        """Every rank's ``FrameworkState.rank_state()``, where the state is recorded: gathered on
        rank 0 of data-parallel training; under sharded training each rank records its own, in
        its place of a per-rank list, with no exchange."""
        if not sharded:
            return self.collective.gather(source.rank_state())
        ranks: list[Any] = [None] * self.world_size
        ranks[self.rank] = source.rank_state()
        return ranks

    def codec_states(self, compressor: Any) -> list[Any] | None:
        """Every rank's codec state (error-feedback residuals differ per rank), on rank 0."""
        return None if compressor is None else self.collective.gather(compressor.state_dict())

    def review(self, tuning: OnlineTuning, step: int, sharded: bool) -> dict[str, float]:
        """Rank 0's tuner reviews the settings (under sharded training from every rank's
        measurements, as the slowest writer) and sizes a byte-sized base interval from what it
        recorded; every rank adopts what it chose, so bases fall on the same steps everywhere.
        Returns the tuner decision's metrics to log (empty without one)."""
        several = self.world_size > 1
        measured = self.collective.gather(tuning.measure(step)) if sharded and several else None
        decision = tuning.review(step, measured) if self.is_main_process else None
        if several:
            settings, next_review = self.collective.broadcast((tuning.settings, tuning.next_review))
            if not self.is_main_process:
                tuning.adopt(settings, next_review)
        if decision is None or tuning.last_review is None:
            return {}
        return tuning_metrics(*tuning.last_review)

    def check_replicas(self, module: torch.nn.Module, table: dict[str, Any]) -> None:
        """Check that the ranks holding the same block of a parameter (``table``: this rank's
        shard table) hold the same bits (every rank calls, at the same steps: each base).

        Raises:
            ReplicaDivergenceError: on every rank, naming each parameter and the ranks that differ.
        """
        gathered = self.collective.gather(replica_sums(module, table))
        problems = self.collective.broadcast(replica_problems(gathered) if gathered is not None else None)
        if problems:
            more = f" and {len(problems) - 5} more" if len(problems) > 5 else ""
            raise ReplicaDivergenceError(
                f"ranks that hold the same block of a parameter hold different values: {'; '.join(problems[:5])}{more}. "
                "Only the lowest rank of each replica group records the block, so this run would not resume as it "
                "trained. Replicas diverge when they are not given the same gradients: ranks of a tensor-parallel "
                "group drawing different random numbers (dropout seeded per rank) outside the parallelized layers, "
                "a rank stepping on its own gradient, a change made on one rank only")

    @staticmethod
    def outcome(url: str, step: int, outcome: list[tuple[str, Any]]) -> list[int]:
        """The step each rank reached, or every rank's error raised."""
        errors = [f"rank {r}: {v}" for r, (kind, v) in enumerate(outcome) if kind == "error"]
        if errors:
            raise DiffCkptError(f"restoring step {step} of {url} failed: {'; '.join(errors)}")
        return [v for _, v in outcome]
