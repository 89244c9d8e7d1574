"""Restoring on every process: where a step lies, and how each process rebuilds it.

:class:`Resumption` is what :meth:`diffckpt.CheckpointEngine.resume` runs. Rank 0 locates the
step (:func:`diffckpt.locate.locate`, one listing of the run root) and every rank gets its
answer. An unsharded run is replayed as before (rank 0 settles the step, falling back over
damage, and the other ranks replay exactly that one). A sharded session at the same layout is
replayed stream by stream, each rank its own, in parallel; any other layout is rebuilt as full
tensors and cut to what each live parameter holds (``docs/sharded.md``).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

from .codecs.compressor import GradientCompressor
from .coordination import Coordination
from .errors import CheckpointNotFoundError, DiffCkptError
from .liveload import load_into_live, modules_of
from .localtier import merge_for_rank
from .locate import Located, locate
from .planning import plan, session_spans
from .reassembly import replay_rank, with_replicas
from .recorder import Recorder
from .replay import ReplayResult
from .restoring import load_located
from .shardedrun import Resolution, ShardedRun
from .sharding import is_sharded, same_layout, shard_table

__all__ = ["Resumption"]

log = logging.getLogger("diffckpt")


class Resumption:
    """Resuming the processes of ``coord`` from a run root (a :class:`Recorder`'s)."""

    def __init__(self, coord: Coordination) -> None:
        self.coord = coord

    def resume(self, recorder: Recorder, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
               step: int | None, compressor: GradientCompressor | None, missing_ok: bool) -> ReplayResult | None:
        """See :meth:`diffckpt.CheckpointEngine.resume`."""
        self.take_local_tier(recorder)
        here: dict[str, Located] = {}  # rank 0's location, whose listing its restore reuses
        found = self.coord.decided(lambda: self._locate(recorder, step, missing_ok, here), "restore",
                                   then="no process was restored")
        loc = here.get("loc")
        if found[0] == "none":
            return None
        sharded_here = is_sharded(module)
        if found[0] == "sharded":
            res = found[1]
            if sharded_here and res.world_size == self.coord.world_size and self._same_layout(recorder, module, res, loc):
                return self._restore_pieces(recorder, module, optimizers, res, step is not None, loc)
            return self._restore_full(recorder, module, optimizers, res.step if step is not None else None, loc)
        if sharded_here:  # an unsharded run onto sharded parameters: cut from full tensors
            return self._restore_full(recorder, module, optimizers, step, loc)
        # Every rank must continue from the same step (DDP does not broadcast parameters again):
        # rank 0 restores, falling back over damage, and the others replay exactly its step.
        mine: dict[str, ReplayResult | None] = {}

        def restore_here() -> ReplayResult | None:
            mine["result"] = self._restore_here(recorder, module, optimizers, step, compressor, missing_ok, loc)
            return mine["result"]

        settled = self.coord.decided(restore_here, "restore", then="no process was restored there",
                                     send=lambda r: ("step", None, None) if r is None else ("step", r.step, r.continues))
        if self.coord.is_main_process:
            return settled
        if settled[1] is None:
            return None
        result = self._restore_here(recorder, module, optimizers, settled[1], compressor, False, None)
        if result is not None:  # the session begun at it continues what rank 0 restored, on every rank
            result.continues = settled[2]
        return result

    def take_local_tier(self, recorder: Recorder) -> None:
        """The node-local tier first, on every rank: what a crashed session journaled on this node
        becomes durable in the run root, so that the one restore path sees it (and, sharded, a step
        counts only once every rank has it)."""
        error: DiffCkptError | None = None
        try:
            merge_for_rank(recorder.storage, recorder.options.local_dir, self.coord.rank)
        except DiffCkptError as exc:  # every rank must hear of it, or the others wait forever
            error = exc
        if self.coord.world_size > 1 and self.coord.agree(error is not None) and error is None:
            raise DiffCkptError("the node-local tier could not be taken back on another process (see its log); "
                                "no process was restored")
        if error is not None:
            raise error

    def newest_step(self, recorder: Recorder) -> int | None:
        """See :meth:`diffckpt.CheckpointEngine.newest_step`."""
        self.take_local_tier(recorder)  # the step a framework then resumes counts the local tier
        def newest() -> int | None:
            try:
                loc = locate(recorder.storage)
                return loc.sharded.step if loc.sharded is not None else plan(loc.store, None, loc.inv).target
            except CheckpointNotFoundError:
                return None
        return self.coord.decided(newest, "listing the run")

    @staticmethod
    def warn_used_root(recorder: Recorder, step: int, hint: str | None) -> None:
        """Warn that a fresh session starts on a run root whose durable steps it does not continue:
        ``"last"`` follows the new session from now on, and a job still writing there is fenced.
        ``hint``: the framework's way to resume."""
        run = ShardedRun(recorder.storage)  # one listing for the root and its rank streams
        newest = {g: spans[-1][1] for g, spans in session_spans(run.root, run.top).items()}
        try:  # sharded sessions keep their steps in rank streams, not at the root
            sharded = run.resolve(None)
        except DiffCkptError:  # none, or damaged: the warning names what it can read
            sharded = None
        if sharded is not None:
            newest[sharded.gen] = max(sharded.step, newest.get(sharded.gen, sharded.step))
        if not newest:
            return
        sessions = ", ".join(f"g{g} (newest durable step {s})" for g, s in sorted(newest.items()))
        warnings.warn(
            f"diffckpt: {recorder.storage.url} already holds a run: session{'s' if len(newest) > 1 else ''} "
            f"{sessions}. This training starts a new session at step {step} without resuming it; "
            "\"last\" will follow the new session, and a job still writing there stops (fenced). "
            f"To continue the run instead, {hint or 'resume from it'}; to keep both, give this job "
            "its own dirpath", UserWarning, stacklevel=2)

    @staticmethod
    def _locate(recorder: Recorder, step: int | None, missing_ok: bool, here: dict[str, Located]) -> tuple[Any, ...]:
        """``("sharded", Resolution)``, ``("plain",)``, or ``("none",)`` when ``missing_ok`` and
        nothing is durable yet; the location is kept in ``here`` for rank 0's restore."""
        url = recorder.storage.url
        try:
            loc = here["loc"] = locate(recorder.storage, step)
        except CheckpointNotFoundError:
            if step is not None or not missing_ok:
                raise
            log.warning("diffckpt: %s holds no step durable on every rank yet; starting at step 0", url)
            return ("none",)
        if loc.sharded is not None:
            return ("sharded", loc.sharded)
        if step is None and missing_ok and not loc.is_run:
            log.info("diffckpt: nothing to restore under %s; starting at step 0", url)
            return ("none",)
        return ("plain",)

    def _restore_pieces(self, recorder: Recorder, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                        res: Resolution, exact: bool, loc: Located | None) -> ReplayResult:
        """Same layout: each rank replays its own stream, in parallel, with no exchange but one
        small outcome per rank; ranks that reach different steps (a stream damaged after the
        step every listing showed) all go back to the lowest."""
        # Rank 0 reuses its listing; the others list only their own stream, inside replay_rank,
        # where a failure reaches every rank through the outcome exchange.
        run = loc.run if loc is not None else ShardedRun(recorder.storage)
        target, mine = res.step, None
        allow, rank = modules_of(optimizers), self.coord.rank
        while True:
            def replay(upto: int = target, kept: dict[str, Any] | None = mine) -> dict[str, Any]:
                if kept is not None and kept["step"] == upto:  # this rank is there already
                    return kept
                return replay_rank(run, res, rank, upto, exact=exact or upto != res.step, allow_modules=allow)

            mine, outcome = self.coord.everyone(replay)
            steps = self.coord.outcome(recorder.storage.url, target, outcome)
            if len(set(steps)) == 1:
                break
            target = min(steps)
        own = mine
        assert own is not None
        # the blocks this rank's replicas recorded (HSDP, a layer outside the tensor-parallel plan)
        mine, outcome = self.coord.everyone(lambda: with_replicas(run, res, rank, own, allow_modules=allow))
        self.coord.outcome(recorder.storage.url, target, outcome)
        assert mine is not None
        load_into_live(module, optimizers, mine, pieces=True)
        return self._restored_from(recorder, mine)

    def _same_layout(self, recorder: Recorder, module: torch.nn.Module, res: Resolution, loc: Located | None) -> bool:
        """Whether every rank holds the same blocks of every parameter as the rank of its number
        did when recording (the mesh shape and placements; the world size was compared before)."""
        run = loc.run if loc is not None else ShardedRun(recorder.storage)
        try:
            recorded = run.stream(self.coord.rank).session_meta(res.gen).get("shards") or {}
            differs = not same_layout(shard_table(module), recorded)
        except Exception:  # unreadable here, or a layout not recorded: the full tensors' path says why (every
            differs = True  # rank must reach the agreement below, or the others wait forever)
        return not self.coord.agree(differs)

    def _restore_full(self, recorder: Recorder, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                      step: int | None, loc: Located | None) -> ReplayResult:
        """Another layout: full tensors rebuilt from every stream (in each process), then cut to
        what each parameter here holds. Rank 0 settles the step first, so that all agree."""
        allow = modules_of(optimizers)
        first: dict[str, Any] = {}

        def settle() -> int:
            first["full"] = load_located(self._located(recorder, step, loc), allow_modules=allow)
            return first["full"]["step"]

        settled = self.coord.decided(settle, "restore", then="no process was restored")
        full, outcome = self.coord.everyone(
            lambda: first.get("full") or load_located(self._located(recorder, settled, None), allow_modules=allow))
        self.coord.outcome(recorder.storage.url, settled, outcome)
        assert full is not None
        load_into_live(module, optimizers, full, pieces=False)
        log.info("diffckpt: restored step %d onto another layout (%d process(es) here); training continues from "
                 "it exactly, but not bit-identically to the original run, because the reductions change",
                 full["step"], self.coord.world_size)
        return self._restored_from(recorder, full)

    @staticmethod
    def _located(recorder: Recorder, step: int | None, loc: Located | None) -> Located:
        """Where ``step`` lies: rank 0's location of it (one listing for the decision and the
        restore), else this process's own (a rank that replays the step rank 0 settled)."""
        return loc if loc is not None and loc.step == step else locate(recorder.storage, step)

    @staticmethod
    def _restored_from(recorder: Recorder, loaded: dict[str, Any]) -> ReplayResult:
        result: ReplayResult = loaded["result"]
        result.step, result.state = loaded["step"], loaded["state"]
        log.info("diffckpt: restored step %d from %s (base %d + %d replayed steps)", result.step,
                 recorder.storage.url, loaded["base_step"], loaded["replayed"])
        return result

    def _restore_here(self, recorder: Recorder, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                      step: int | None, compressor: GradientCompressor | None, missing_ok: bool,
                      loc: Located | None) -> ReplayResult | None:
        """Replay ``step`` from ``recorder``'s run root in this process (``None`` if missing_ok
        and nothing is durable yet); ``loc``: where rank 0 located it, if this is rank 0."""
        url = recorder.storage.url
        try:
            result = recorder.restore(module, optimizers, step, compressor=compressor, rank=self.coord.rank,
                                      located=self._located(recorder, step, loc))
        except CheckpointNotFoundError:
            if step is not None or not missing_ok:
                raise
            log.warning("diffckpt: %s holds no durable step yet (the run was stopped before its first "
                        "base was written); starting at step 0", url)
            return None
        log.info("diffckpt: restored step %d from %s (base %d + %d replayed steps)", result.step, url,
                 result.base_step, result.replayed)
        return result
