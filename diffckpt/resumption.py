"""Restoring on every process: where a step lies, and how each process rebuilds it.

:class:`Resuming` gives :class:`~diffckpt.CheckpointEngine` its :meth:`~Resuming.resume`. An
unsharded run is replayed as before (rank 0 settles the step, falling back over damage, and the
other ranks replay exactly that one). A sharded session at the same layout is replayed stream by
stream, each rank its own, in parallel; any other layout is rebuilt as full tensors and cut to
what each live parameter holds (``docs/sharded.md``).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch

from .codecs.compressor import GradientCompressor
from .coordination import Coordinated
from .errors import CheckpointNotFoundError, DiffCkptError
from .loading import load_state
from .replay import ReplayResult
from .shardedrun import Resolution, ShardedRun, load_into_live, modules_of
from .sharding import is_sharded, refuse_flat_parameters

__all__ = ["Resuming"]

log = logging.getLogger("diffckpt")


class Resuming(Coordinated):
    """:meth:`resume` for :class:`~diffckpt.CheckpointEngine`; the state it restored is kept in
    ``_restored`` for the session that follows."""

    _restored: tuple[int, Any] | None = None  # (step, state) that resume() replayed

    def resume(self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
               step: int | Literal["last"] | None = None, *, dirpath: str | None = None,
               compressor: GradientCompressor | None = None, missing_ok: bool = False) -> ReplayResult | None:
        """Restore ``step`` (``"last"`` or ``None``: the newest durable one) on every rank (every
        rank calls).

        Rank 0 resolves the step, falling back over damage for ``None``, and every rank replays
        that same step onto its ``module`` and ``optimizers``; with a ``compressor``, each rank
        gets its own codec state. ``dirpath`` restores from another run root. With
        ``missing_ok``, ``None`` is returned when ``step`` is ``None`` and nothing is durable yet.
        A later :meth:`begin` at the restored step writes the restored state as its base.

        Raises:
            the errors of :meth:`~diffckpt.CheckpointEngine.restore`, on rank 0; the other ranks
            raise :class:`DiffCkptError` saying that rank 0 failed.
        """
        if step == "last":
            step = None
        elif step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise ValueError(f"step must be None, 'last' or a step number, got {step!r}")
        refuse_flat_parameters(module)
        engine = self
        if dirpath is not None and str(dirpath).rstrip("/") != self.storage.url.rstrip("/"):
            engine = type(self)(dirpath, storage_options=self.storage_options)
        # Where the step lies decides how it is rebuilt: a sharded session is replayed stream by
        # stream (each rank its own, when the layout is the same), anything else as before.
        found = self._decided(lambda: self._locate(engine, step, missing_ok))
        if found[0] == "none":
            return None
        sharded_here = is_sharded(module)
        if found[0] == "sharded":
            res = found[1]
            if sharded_here and res.world_size == self.world_size:
                return self._restore_pieces(engine, module, optimizers, res, exact=step is not None)
            return self._restore_full(engine, module, optimizers, res.step if step is not None else None)
        if sharded_here:  # an unsharded run onto sharded parameters: cut from full tensors
            return self._restore_full(engine, module, optimizers, step)
        coll = self.collective
        if coll.world_size == 1:
            return self._restore_here(engine, module, optimizers, step, compressor, missing_ok)
        # Every rank must continue from the same step (DDP does not broadcast parameters again):
        # rank 0 resolves it, falling back over damage, and the others replay exactly that one.
        if self.is_main_process:
            try:
                result = self._restore_here(engine, module, optimizers, step, compressor, missing_ok)
            except BaseException as exc:
                coll.broadcast(("error", f"{type(exc).__name__}: {exc}"))
                raise
            coll.broadcast(("step", None if result is None else result.step))
            return result
        kind, value = coll.broadcast(None)
        if kind == "error":
            raise DiffCkptError(f"restore failed on process 0 ({value}); no process was restored there")
        if value is None:
            return None
        return self._restore_here(engine, module, optimizers, value, compressor, False)

    def newest_step(self) -> int | None:
        """The step :meth:`resume` restores when given none, as a listing shows it: the newest
        durable step (on every rank, for a sharded run), or ``None`` when nothing is durable
        (every rank calls; rank 0 lists and the others get its answer).

        Damage inside an object is found only when it is read, by :meth:`resume`.
        """
        def newest() -> int | None:
            try:
                res = ShardedRun(self.storage).resolve(None)
                return res.step if res is not None else self.store.plan(None).target
            except CheckpointNotFoundError:
                return None
        return self._decided(newest)

    # ----------------------------------------------------------- sharded restore
    @staticmethod
    def _locate(engine: Resuming, step: int | None, missing_ok: bool) -> tuple[Any, ...]:
        """``("sharded", Resolution)``, ``("plain",)``, or ``("none",)`` when ``missing_ok`` and
        nothing is durable yet."""
        try:
            res = ShardedRun(engine.storage).resolve(step)
        except CheckpointNotFoundError:
            if step is not None or not missing_ok:
                raise
            log.warning("diffckpt: %s holds no step durable on every rank yet; starting at step 0",
                        engine.storage.url)
            return ("none",)
        if res is not None:
            return ("sharded", res)
        if step is None and missing_ok and not engine.run_exists():
            log.info("diffckpt: nothing to restore under %s; starting at step 0", engine.storage.url)
            return ("none",)
        return ("plain",)

    def _restore_pieces(self, engine: Resuming, module: torch.nn.Module,
                        optimizers: list[torch.optim.Optimizer], res: Resolution, exact: bool) -> ReplayResult:
        """Same layout: each rank replays its own stream, in parallel, with no exchange but one
        small outcome per rank; ranks that reach different steps (a stream damaged after the
        step every listing showed) all go back to the lowest."""
        run, target = ShardedRun(engine.storage), res.step
        mine: dict[str, Any] | None = None
        allow = modules_of(optimizers)
        while True:
            def replay(upto: int = target, kept: dict[str, Any] | None = mine) -> dict[str, Any]:
                if kept is not None and kept["step"] == upto:  # this rank is there already
                    return kept
                return run.replay_rank(res, self.rank, upto, exact=exact or upto != res.step, allow_modules=allow)

            mine, outcome = self._everyone(replay)
            steps = self._outcome(engine.storage.url, target, outcome)
            if len(set(steps)) == 1:
                break
            target = min(steps)
        assert mine is not None
        load_into_live(module, optimizers, mine, pieces=True)
        return self._restored_from(engine, mine)

    def _restore_full(self, engine: Resuming, module: torch.nn.Module,
                      optimizers: list[torch.optim.Optimizer], step: int | None) -> ReplayResult:
        """Another layout: full tensors rebuilt from every stream (in each process), then cut to
        what each parameter here holds. Rank 0 settles the step first, so that all agree."""
        allow = modules_of(optimizers)
        first: dict[str, Any] = {}

        def settle() -> int:
            first["full"] = load_state(engine.storage, step, allow_modules=allow)
            return first["full"]["step"]

        settled = self._decided(settle)
        full, outcome = self._everyone(lambda: first.get("full") or load_state(engine.storage, settled,
                                                                              allow_modules=allow))
        self._outcome(engine.storage.url, settled, outcome)
        assert full is not None
        load_into_live(module, optimizers, full, pieces=False)
        log.info("diffckpt: restored step %d onto another layout (%d process(es) here); training continues from "
                 "it exactly, but not bit-identically to the original run, because the reductions change",
                 full["step"], self.world_size)
        return self._restored_from(engine, full)

    def _restored_from(self, engine: Resuming, loaded: dict[str, Any]) -> ReplayResult:
        result: ReplayResult = loaded["result"]
        result.step, result.state = loaded["step"], loaded["state"]
        self._restored = (result.step, result.state)
        log.info("diffckpt: restored step %d from %s (base %d + %d replayed steps)", result.step,
                 engine.storage.url, loaded["base_step"], loaded["replayed"])
        return result

    def _restore_here(self, engine: Resuming, module: torch.nn.Module,
                      optimizers: list[torch.optim.Optimizer], step: int | None,
                      compressor: GradientCompressor | None, missing_ok: bool) -> ReplayResult | None:
        """Replay ``step`` from ``engine``'s run root in this process (``None`` if missing_ok and
        nothing is durable yet) and keep its state for :meth:`begin`."""
        url = engine.storage.url
        if step is None and missing_ok and not engine.run_exists():
            log.info("diffckpt: nothing to restore under %s; starting at step 0", url)
            return None
        try:
            result = engine.restore(module, optimizers, step, compressor=compressor, rank=self.rank)
        except CheckpointNotFoundError:
            if step is not None or not missing_ok:
                raise
            log.warning("diffckpt: %s holds no durable step yet (the run was stopped before its first "
                        "base was written); starting at step 0", url)
            return None
        self._restored = (result.step, result.state)
        log.info("diffckpt: restored step %d from %s (base %d + %d replayed steps)", result.step, url,
                 result.base_step, result.replayed)
        return result
