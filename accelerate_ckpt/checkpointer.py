"""``DiffCheckpointer``: differential checkpoints for a Hugging Face Accelerate training loop.

Each real optimizer step is captured by the core's hooks on the optimizer inside each
``AcceleratedOptimizer`` (Accelerate's wrapper has no hooks of its own), where the gradients are
already accumulated, unscaled and clipped. A step is *attempted* whenever ``optimizer.step()`` is
called while gradients sync; one without an update (a skipped fp16 step) is recorded as a skip.

A step's record is committed at the next *boundary*, when everything the step changes has been
changed: the next batch or epoch of a tracked loader (:meth:`DiffCheckpointer.dataloader`),
``accelerator.save_state()``, :meth:`DiffCheckpointer.close`, or, for a loop that tracks no loader,
right after the scheduler (else the optimizer) steps. The record then holds the schedulers, the
scaler, Accelerate's step counter, and every rank's RNG and data position.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

import accelerate
import torch
from accelerate import Accelerator

from diffckpt.capture import check_replayable
from diffckpt.codecs import Codec
from diffckpt.engine import CheckpointEngine
from diffckpt.errors import CheckpointNotFoundError, DiffCkptError, IncompatibleCheckpointError
from diffckpt.options import CheckpointOptions
from diffckpt.rng import get_rng_state, set_rng_state
from diffckpt.tuning.model import tuning_metrics

from .compression import GradientCompression
from .dataloader import TrackedDataLoader
from .save_state import SaveStateHooks
from .support import check_supported, prepared_model

__all__ = ["DiffCheckpointer"]

log = logging.getLogger("diffckpt")


class DiffCheckpointer:
    """Differential checkpoints of an Accelerate training loop.

    Create it after ``accelerator.prepare(...)``; it captures every optimizer step from then on.

    Args:
        accelerator: the ``Accelerator`` that prepared the model, optimizers and schedulers.
        dirpath: run root: a local path or any fsspec URL (``s3://``...). With several
            processes every process reads it on restore, so it must be shared storage.
        model: the model ``accelerator.prepare`` returned; needed only when several models were
            prepared, or with ``codec=`` under DDP.
        every_n_steps: a restorable point every this many optimizer steps.
        write_batch: consecutive step records per segment (one write each).
        base_every_n_steps: a full base every this many steps, plus one when a session starts.
            Each of the three may be ``"auto"``: the auto-tuner measures the run and picks it
            for ``tuning=diffckpt.TuningOptions(mtbf_s=..., max_overhead=..., rto_s=...)``;
            its decisions go to ``accelerator.log`` as ``diffckpt/*`` when trackers are set up.
        storage_options: fsspec options (credentials, endpoint).
        codec: compressed training (``diffckpt.codecs.TopK``, ``PowerSGD``, ``LowPrecision``),
            whose payloads are the diffs; see :class:`accelerate_ckpt.GradientCompression`.
        **options: further :class:`diffckpt.CheckpointOptions` fields
            (``fingerprint_every_n_steps``, ``max_pending_bytes``, ``flush_timeout_s``...).

    Use it as a context manager (or call :meth:`close`) so that the last steps are flushed, also
    on exceptions; on SIGTERM it flushes at the next boundary and exits.
    """

    def __init__(self, accelerator: Accelerator, dirpath: str | os.PathLike[str], *, model: Any = None,
                 every_n_steps: int | str = 1, write_batch: int | str = 8,
                 base_every_n_steps: int | str | None = 500,
                 storage_options: dict[str, Any] | None = None, codec: Codec | None = None,
                 **options: Any) -> None:
        self.url = os.fspath(dirpath)
        check_supported(accelerator, self.url)
        self.accelerator = accelerator
        self.options = CheckpointOptions(every_n_steps=every_n_steps, write_batch=write_batch,
                                         base_every_n_steps=base_every_n_steps, **options)
        self.storage_options = dict(storage_options or {})
        prepared = prepared_model(accelerator, model)
        self.module: torch.nn.Module = accelerator.unwrap_model(prepared, keep_torch_compile=False)
        self._prepared = list(accelerator._optimizers)
        if not self._prepared:
            raise DiffCkptError("no optimizer was prepared: call accelerator.prepare(model, optimizer, "
                                "...) before creating the DiffCheckpointer")
        self.optimizers = [po.optimizer for po in self._prepared]
        for opt in self.optimizers:  # on every process, before anything is written
            check_replayable(opt)
        self.compression = None if codec is None else GradientCompression(
            accelerator, codec, prepared, self.options.fingerprint_every_n_steps or 50)
        self.engine = CheckpointEngine(self.url, self.options, self.storage_options)
        self.step = 0  # optimizer steps attempted (synced ``step()`` calls, skipped ones included)
        self.durable_step: int | None = None
        self.received_sigterm = False
        self._loaders: dict[int, TrackedDataLoader] = {}
        self._resume: dict[str, Any] | None = None  # this rank's RNG and loader positions to continue from
        self._restored: tuple[int, Any] | None = None
        self._started = self._closed = False
        self._recorded = self._state_step = self._base_step = -1
        self._saving = False  # inside accelerator.save_state(), which counts the save after the hook
        for po in self._prepared:
            self._wrap_optimizer(po)
        for sched in accelerator._schedulers:
            self._wrap_scheduler(sched)
        self._save_state = SaveStateHooks(self)
        self._prev_sigterm: Any = None
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN):  # an ignored SIGTERM stays so
            self._prev_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    # ------------------------------------------------------------------ identity
    @property
    def compressor(self) -> Any:
        """The :class:`diffckpt.GradientCompressor` of compressed training (``codec=``), or ``None``."""
        return None if self.compression is None else self.compression.compressor

    @property
    def is_writer(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def epoch(self) -> int:
        """The epoch to continue in: after :meth:`restore`, the interrupted one (0 on a fresh run)."""
        if self._loaders:
            return next(iter(self._loaders.values())).epoch
        if self._resume and self._resume["loaders"]:
            return int(self._resume["loaders"][0]["iteration"])
        return 0

    def dataloader(self, dataloader: Any) -> TrackedDataLoader:
        """Track a prepared training loader: its position goes into every checkpoint, and after
        :meth:`restore` its next epoch resumes where the restored step left off.

        Iterate the returned object instead of ``dataloader`` (calling this again with the same
        loader returns the same object).
        """
        if isinstance(dataloader, TrackedDataLoader):
            return dataloader
        index = next((i for i, d in enumerate(self.accelerator._dataloaders) if d is dataloader), None)
        if index is None:
            raise DiffCkptError("track the data loader accelerator.prepare returned: its position "
                                "and generators are what a resume restores")
        if index not in self._loaders:
            tracked = TrackedDataLoader(self, dataloader, index)
            tracked.resume = self._resume_for(index)
            self._loaders[index] = tracked
        return self._loaders[index]

    # ------------------------------------------------------------------ capture
    def _wrap_optimizer(self, po: Any) -> None:
        step = po.step  # Accelerate patches the inner optimizer's step; the outer one is ours to wrap

        def checkpointed_step(*args: Any, **kwargs: Any) -> Any:
            if self._closed or not self.accelerator.gradient_state.sync_gradients:
                return step(*args, **kwargs)
            if not self._started:
                self._start()
            result = step(*args, **kwargs)
            self.step += 1
            # A loop without a tracked loader or scheduler commits after its last optimizer.
            if not self._loaders and not self.accelerator._schedulers and po is self._prepared[-1]:
                self._boundary()
            return result

        po.step = checkpointed_step

    def _wrap_scheduler(self, sched: Any) -> None:
        step = sched.step

        def checkpointed_step(*args: Any, **kwargs: Any) -> Any:
            result = step(*args, **kwargs)
            # A loop without a tracked loader commits once the last scheduler has stepped.
            if not self._closed and not self._loaders and sched is self.accelerator._schedulers[-1]:
                self._boundary()
            return result

        sched.step = checkpointed_step

    def _boundary(self) -> None:
        """Everything the last step changed is in place: commit it (and stop if told to)."""
        if self._closed:
            return
        if self._stop_requested():
            self._stop()
        if not self._started:
            self._start()
        elif self.step > self._recorded:
            self._commit()
        self.engine.check()

    def _start(self) -> None:
        """Open a writer session at the current step and write its base (every rank calls this)."""
        step = self.step
        restored = self._restored is not None and self._restored[0] == step
        state = self._restored[1] if restored else self._take_state()  # type: ignore[index]
        codec_states = self._codec_states()
        self._started = True
        self._recorded = self._state_step = self._base_step = step
        self._restored = self._resume = None
        if not self.is_writer:
            self.engine.join(step)
            return
        acc = self.accelerator
        self.engine.start(self.module, self.optimizers, step, meta={
            "framework": f"accelerate {accelerate.__version__}", "torch": torch.__version__,
            "distributed_type": str(acc.distributed_type), "world_size": acc.num_processes,
            "mixed_precision": acc.mixed_precision,
            "gradient_accumulation_steps": acc.gradient_accumulation_steps,
            "split_batches": acc.split_batches}, compressor=self.compressor)
        self._write_base(step, state, codec_states)

    def _commit(self, force_state: bool = False, force_base: bool = False) -> None:
        """Record the steps since the last record (every rank calls this: it gathers state)."""
        step, engine = self.step, self.engine
        if engine.review_due(step):
            self._review(step)
        wants_base = force_base or engine.wants_base(step)
        wants_state = force_state or wants_base or engine.wants_state(step)
        with engine.measuring_state():
            state = self._take_state() if wants_state else None
            codec_states = self._codec_states() if wants_base else None
        self._recorded = step
        if wants_state:
            self._state_step = step
        if wants_base:
            self._base_step = step
        if not self.is_writer:
            engine.follow(step, wants_base)
            return
        engine.record_step(step, state)
        if wants_base:
            self._write_base(step, state, codec_states)

    def _review(self, step: int) -> None:
        """Let the auto-tuner review its settings: process 0 decides, every process adopts."""
        engine = self.engine
        decision = engine.review(step) if self.is_writer else None
        if self.accelerator.num_processes > 1:
            shared = [(engine.settings, engine.tuning.next_review) if self.is_writer else None]
            torch.distributed.broadcast_object_list(shared, src=0)
            if not self.is_writer:
                engine.adopt(*shared[0])
        if decision is not None and engine.tuning.last_review is not None and self.accelerator.trackers:
            self.accelerator.log(tuning_metrics(*engine.tuning.last_review), step=step)

    def _write_base(self, step: int, state: Any, codec_states: list[dict[str, Any]] | None) -> None:
        self.engine.write_base(step, self.module.state_dict(), [o.state_dict() for o in self.optimizers],
                               state, codec_states)

    def _take_state(self) -> dict[str, Any] | None:
        """What a resume needs besides parameters and optimizer state; on the writer only."""
        acc = self.accelerator
        mine = {"rng": get_rng_state(), "loaders": [t.position() for t in self._loaders.values()]}
        ranks = self._gather(mine)
        if not self.is_writer:
            return None
        return {"accelerate": {"step": acc.step, "schedulers": [s.state_dict() for s in acc._schedulers],
                               "scaler": None if acc.scaler is None else acc.scaler.state_dict(),
                               "project_iteration": acc.project_configuration.iteration + self._saving},
                "ranks": ranks, "world_size": acc.num_processes}

    def _codec_states(self) -> list[dict[str, Any]] | None:
        """Every rank's codec state (error-feedback residuals differ per rank), on the writer."""
        if self.compressor is None:
            return None
        return self._gather(self.compressor.state_dict())

    def _gather(self, mine: Any) -> list[Any]:
        if self.accelerator.num_processes == 1:
            return [mine]
        gathered: list[Any] | None = [None] * self.accelerator.num_processes if self.is_writer else None
        torch.distributed.gather_object(mine, gathered, dst=0)
        return gathered or []

    # ------------------------------------------------------------------ restore
    def restore(self, step: int | str | None = "last") -> int:
        """Rebuild model, optimizers, schedulers, scaler and Accelerate's step counter at ``step``
        (``"last"``: the newest durable one) and arm each rank's RNG and data position for the
        loop; return the optimizer step to continue from (0 when there is nothing to restore).

        Call it on every process, after ``accelerator.prepare`` and before training.

        Raises:
            CheckpointNotFoundError: an explicit ``step`` is not durable.
            IncompatibleCheckpointError: the checkpoint was written for another model, optimizer
                or set of schedulers.
            CorruptRecordError: an explicit step cannot be rebuilt.
        """
        if self._started:
            raise DiffCkptError("restore() must be called before training starts (before the first "
                                "batch or optimizer step after DiffCheckpointer was created)")
        if step in ("last", None):
            target = None
        elif isinstance(step, int) and not isinstance(step, bool):
            target = step
        else:
            raise ValueError(f"step must be 'last' or a step number, got {step!r}")
        if self.accelerator.num_processes == 1:
            return self._restore_target(target) or 0
        # Every process must restore the same step (DDP does not broadcast parameters again), so
        # process 0 resolves "last", falling back over damage, and the others follow.
        decided: list[Any] = [None]
        if self.is_writer:
            try:
                decided[0] = ("step", self._restore_target(target))
            except BaseException as exc:
                decided[0] = ("error", f"{type(exc).__name__}: {exc}")
                torch.distributed.broadcast_object_list(decided, src=0)
                raise
        torch.distributed.broadcast_object_list(decided, src=0)
        kind, value = decided[0]
        if kind == "error":
            raise DiffCkptError(f"restore failed on process 0 ({value}); no process was restored there")
        if value is None:  # nothing to restore
            return 0
        return value if self.is_writer else self._restore_from(self.engine, value)

    def _restore_target(self, target: int | None) -> int | None:
        """Restore ``target`` (``None``: newest durable); ``None`` when "last" finds nothing."""
        if target is None and not self.engine.store.is_run():
            log.info("diffckpt: nothing to restore under %s; starting at step 0", self.url)
            return None
        try:
            return self._restore_from(self.engine, target)
        except CheckpointNotFoundError:
            if target is not None:
                raise
            log.warning("diffckpt: %s holds no durable step yet (the run was stopped before its first "
                        "base was written); starting at step 0", self.url)
            return None

    def _restore_from(self, engine: CheckpointEngine, step: int | None) -> int:
        acc = self.accelerator
        result = engine.restore(self.module, self.optimizers, step, compressor=self.compressor,
                                rank=acc.process_index)
        state = result.state
        ours = state.get("accelerate") if isinstance(state, dict) else None
        if ours is None:
            raise IncompatibleCheckpointError(
                f"step {result.step} under {engine.storage.url} was not written by accelerate_ckpt "
                "(no Accelerate state); restore it with the integration that wrote it (the model and "
                "optimizers were already replayed and must be restored again)")
        if len(ours["schedulers"]) != len(acc._schedulers):
            raise IncompatibleCheckpointError(
                f"the checkpoint has {len(ours['schedulers'])} LR schedulers, this run prepared "
                f"{len(acc._schedulers)}; prepare the same schedulers as the checkpointed run (the "
                "model and optimizers were already restored and must be restored again)")
        for sched, sd in zip(acc._schedulers, ours["schedulers"]):
            sched.load_state_dict(sd)
        if acc.scaler is not None and ours["scaler"]:
            acc.scaler.load_state_dict(ours["scaler"])
        acc.step = ours["step"]
        if acc.project_configuration.automatic_checkpoint_naming:
            acc.project_configuration.iteration = ours["project_iteration"]
        ranks = state["ranks"]
        if len(ranks) != acc.num_processes:
            log.warning("diffckpt: the run was trained on %d processes and resumes on %d; the LR "
                        "schedule and each rank's data position depend on the process count, so "
                        "rank 0's position is used and the resumed run will not be bit-exact",
                        len(ranks), acc.num_processes)
        self._arm(ranks[acc.process_index] if len(ranks) == acc.num_processes else ranks[0])
        self.step = self._recorded = result.step
        self._restored = (result.step, state)
        log.info("diffckpt: restored step %d from %s (base %d + %d replayed steps)", result.step,
                 engine.storage.url, result.base_step, result.replayed)
        return result.step

    def _arm(self, mine: dict[str, Any]) -> None:
        """Hand this rank's RNG and data positions to the loops that continue from them."""
        self._resume = mine
        for tracked in self._loaders.values():
            tracked.resume = self._resume_for(tracked.index)
        if not mine["loaders"]:  # no loader to align the RNG with: it continues from here
            set_rng_state(mine["rng"])

    def _resume_for(self, index: int) -> dict[str, Any] | None:
        """What the loader at ``index`` of ``accelerator._dataloaders`` continues from, if anything."""
        if self._resume is None:
            return None
        pos = next((p for p in self._resume["loaders"] if p["index"] == index), None)
        return None if pos is None else {"position": pos, "rng": self._resume["rng"]}

    # ------------------------------------------------- accelerator.save_state / load_state
    def base_now(self) -> int | None:
        """For ``save_state``: make the current step a base and wait until it is durable (every
        rank calls this); return the durable step on the writer, ``None`` elsewhere."""
        self._saving = True
        try:
            self._restorable_now(base=True)
        finally:
            self._saving = False
        return self.engine.flush() if self.is_writer else None

    def _restorable_now(self, base: bool) -> None:
        """Make the current step restorable (and a base if ``base``); every rank calls this."""
        if not self._started:
            if base:
                self._start()
            return
        if self.step > self._recorded:
            self._commit(force_state=True, force_base=base)
        elif self._state_step != self.step or (base and self._base_step != self.step):
            # Recorded already, without state (every_n_steps > 1): a base carries the state.
            state, codec_states = self._take_state(), self._codec_states()
            self._base_step = self._state_step = self.step
            if self.is_writer:
                self._write_base(self.step, state, codec_states)
            else:
                self.engine.follow(self.step, True)

    def restore_reference(self, url: str, step: int) -> int:
        """Restore ``step`` of the run at ``url`` (this run root or another one)."""
        if self._started:
            raise DiffCkptError("load_state() must be called before training starts when the "
                                "checkpoint was saved with a DiffCheckpointer")
        engine = self.engine if url.rstrip("/") == self.url.rstrip("/") else CheckpointEngine(
            url, storage_options=self.storage_options)
        return self._restore_from(engine, step)

    # ---------------------------------------------------------------- shutdown
    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the main thread may be inside the engine, holding the writer's locks.
        self.received_sigterm = True

    def _stop_requested(self) -> bool:
        stop = self.received_sigterm
        if self.accelerator.num_processes > 1:  # every rank stops at the same step
            flag = torch.tensor([int(stop)], device=self.accelerator.device)  # NCCL wants CUDA
            torch.distributed.all_reduce(flag)
            stop = bool(flag.item())
        return stop

    def _stop(self) -> None:
        previous = self._prev_sigterm
        self.close(reason="stopped by SIGTERM", timeout=self.options.flush_timeout_s)
        if callable(previous):  # the handler SIGTERM had before us, then exit if it did not
            previous(signal.SIGTERM, None)
        raise SystemExit(128 + signal.SIGTERM)

    def close(self, reason: str = "end of training", timeout: float | None = None,
              record: bool = True) -> int | None:
        """Record the current step as a restorable one, flush and stop writing; return the
        durable step. Every process must call it (recording gathers their state).

        Args:
            reason: said in the log line that reports how far durability got.
            timeout: give up the flush after this many seconds (``None``: wait as
                ``on_storage_error`` says); the log then says which steps were lost.
            record: ``False`` flushes only what is already recorded (after an exception: the
                step in progress may be half done, and other processes may not get here).
        """
        if self._closed:
            return self.durable_step
        try:
            if record:
                self._restorable_now(base=False)
        finally:
            self._closed = True
            self._save_state.remove()
            if self._prev_sigterm is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, self._prev_sigterm)
                self._prev_sigterm = None
            if self.engine.started:  # also when recording failed: what is queued still gets written
                self.durable_step = self.engine.close(timeout)
                (log.info if timeout is None else log.warning)(
                    "diffckpt: %s; durable up to step %s in %s", reason, self.durable_step, self.url)
        return self.durable_step

    def __enter__(self) -> DiffCheckpointer:  # noqa: PYI034 (Python 3.10 has no typing.Self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close(reason=f"interrupted by {type(exc).__name__}", timeout=self.options.flush_timeout_s,
                       record=False)
        except Exception:  # the original exception is what the user must see
            log.exception("diffckpt: flushing after %s failed too", type(exc).__name__)
