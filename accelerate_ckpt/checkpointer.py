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

import os
from typing import Any

import accelerate
import torch
from accelerate import Accelerator

from diffckpt.errors import DiffCkptError
from diffckpt.integration import (
    NOT_GIVEN_BASE_EVERY_N_STEPS,
    NOT_GIVEN_EVERY_N_STEPS,
    NOT_GIVEN_WRITE_BATCH,
    Auto,
    ByBytes,
    CheckpointOptions,
    Codec,
    LoopCheckpointer,
    NotGiven,
    ReplayResult,
    check_log_every,
    check_replayable,
    merge_options,
    set_rng_state,
)

from .compression import GradientCompression
from .dataloader import TrackedDataLoader
from .save_state import SaveStateHooks
from .state import StepState, load_accelerate_state
from .support import check_supported, prepared_model

__all__ = ["DiffCheckpointer"]

class DiffCheckpointer(LoopCheckpointer):
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
        base_every_n_steps: ``"bytes"`` (the default): a full base once the step records since the
            last one add up to ``options.base_every_diff_bytes_ratio`` (4) times a base's size; an
            integer: a full base every this many steps; ``None``: none but the one when a session starts
            (there is one when a session starts in every case).
            Each of the three may be ``"auto"``: the auto-tuner measures the run and picks it
            for ``options.tuning`` (:class:`diffckpt.TuningOptions`); its decisions go to
            ``accelerator.log`` as ``diffckpt/*`` when trackers are set up.
        log_every_n_steps: with trackers set up (``accelerator.init_trackers``), the
            checkpointing metrics (durable step, lag, bytes per step, writer stall, queue fill:
            ``docs/lightning.md#metrics``) go to ``accelerator.log`` every this many steps.
        options: every other setting (:class:`diffckpt.CheckpointOptions`); a knob above left at
            its default takes its value from here.
        storage_options: fsspec options (credentials, endpoint).
        codec: compressed training (``diffckpt.codecs.TopK``, ``PowerSGD``, ``LowPrecision``),
            whose payloads are the diffs; see :class:`accelerate_ckpt.GradientCompression`.
        **legacy: :class:`diffckpt.CheckpointOptions` fields as keywords, the spelling before
            ``options=``: deprecated, still accepted with a ``DeprecationWarning``.

    Use it as a context manager (or call :meth:`close`) so that the last steps are flushed, also
    on exceptions; on SIGTERM it flushes at the next boundary and exits.
    """

    def __init__(self, accelerator: Accelerator, dirpath: str | os.PathLike[str], *, model: Any = None,
                 every_n_steps: int | Auto | NotGiven = NOT_GIVEN_EVERY_N_STEPS, write_batch: int | Auto | NotGiven = NOT_GIVEN_WRITE_BATCH,
                 base_every_n_steps: int | Auto | ByBytes | NotGiven | None = NOT_GIVEN_BASE_EVERY_N_STEPS,
                 options: CheckpointOptions | None = None, storage_options: dict[str, Any] | None = None,
                 codec: Codec | None = None, log_every_n_steps: int = 50, **legacy: Any) -> None:
        url = os.fspath(dirpath)
        check_log_every(log_every_n_steps)
        check_supported(accelerator, url)
        self.accelerator = accelerator
        merged = merge_options(options, legacy, every_n_steps=every_n_steps, write_batch=write_batch,
                               base_every_n_steps=base_every_n_steps)
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
            accelerator, codec, prepared, merged.codec_check_every)
        self._loaders: dict[int, TrackedDataLoader] = {}
        self._saving = False  # inside accelerator.save_state(), which counts the save after the hook
        for po in self._prepared:
            self._wrap_optimizer(po)
        for sched in accelerator._schedulers:
            self._wrap_scheduler(sched)
        self._save_state = SaveStateHooks(self)
        # ``step``: optimizer steps attempted (synced ``step()`` calls, skipped ones included);
        # ``_resume``: this rank's RNG and loader positions to continue from.
        super().__init__(url, merged, dict(storage_options or {}), log_every_n_steps)

    # ------------------------------------------------------------------ identity
    @property
    def compressor(self) -> Any:
        """The :class:`diffckpt.GradientCompressor` of compressed training (``codec=``), or ``None``."""
        return None if self.compression is None else self.compression.compressor

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
            tracked = TrackedDataLoader(self, dataloader, index, self.accelerator)
            tracked.resume = self._resume_for(index)
            self._loaders[index] = tracked
        return self._loaders[index]

    # ------------------------------------------------------------------ capture
    def _wrap_optimizer(self, po: Any) -> None:
        step = po.step  # Accelerate patches the inner optimizer's step; the outer one is ours to wrap

        def checkpointed_step(*args: Any, **kwargs: Any) -> Any:
            if self.driver.closed or not self.accelerator.gradient_state.sync_gradients:
                return step(*args, **kwargs)
            if not self.driver.started:
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
            if not self.driver.closed and not self._loaders and sched is self.accelerator._schedulers[-1]:
                self._boundary()
            return result

        sched.step = checkpointed_step

    def _start(self) -> None:
        """Start checkpointing at the current step: a session and its base (every rank calls this)."""
        acc = self.accelerator
        self.driver.started = True
        self._resume = None
        self.engine.begin(self.module, self.optimizers, self.step, self._state(), compressor=self.compressor,
                          meta={"framework": f"accelerate {accelerate.__version__}",
                                "distributed_type": str(acc.distributed_type), "mixed_precision": acc.mixed_precision,
                                "gradient_accumulation_steps": acc.gradient_accumulation_steps,
                                "split_batches": acc.split_batches},
                          resume_hint="call checkpointer.restore() before training")

    def _state(self) -> StepState:
        return StepState(self.accelerator, list(self._loaders.values()), self._saving)

    def _has_loggers(self) -> bool:
        return bool(self.accelerator.trackers)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        self.accelerator.log(metrics, step=step)

    def _on_close(self) -> None:
        self._save_state.remove()

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
        if self.driver.started:
            raise DiffCkptError("restore() must be called before training starts (before the first "
                                "batch or optimizer step after DiffCheckpointer was created)")
        result = self.engine.resume(self.module, self.optimizers, step, compressor=self.compressor,
                                    missing_ok=True)
        return 0 if result is None else self._restored(result, self.url)

    def _restored(self, result: ReplayResult, url: str) -> int:
        """Load what Accelerate keeps besides the model and optimizers; return the step."""
        ranks = load_accelerate_state(self.accelerator, result, url)
        # On another process count the LR schedule and data positions differ: rank 0's is used.
        self._arm(self.engine.own(ranks) or ranks[0])
        self.step = result.step
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
        rank calls this); return the durable step where this process writes, ``None`` elsewhere."""
        self._saving = True
        try:
            if not self.driver.started:
                self._start()
            else:
                self.engine.make_restorable(self.step, self._state(), base=True)
        finally:
            self._saving = False
        return self.engine.flush()

    def restore_reference(self, url: str, step: int) -> int:
        """Restore ``step`` of the run at ``url`` (this run root or another one)."""
        if self.driver.started:
            raise DiffCkptError("load_state() must be called before training starts when the "
                                "checkpoint was saved with a DiffCheckpointer")
        result = self.engine.resume(self.module, self.optimizers, step, dirpath=url, compressor=self.compressor)
        assert result is not None  # an explicit step is restored or raises
        return self._restored(result, url)
