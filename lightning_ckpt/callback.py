"""``DiffCheckpoint``: the Lightning callback that captures a diff at every optimizer step.

It is a ``ModelCheckpoint`` only so that ``Trainer.fit(ckpt_path="last")`` finds it (Lightning
asks ModelCheckpoint-type callbacks for the last checkpoint); none of ModelCheckpoint's saving
runs. Everything it does is translate Lightning events into :class:`diffckpt.CheckpointEngine`
calls, which every rank makes: the engine decides who writes and exchanges what ranks share.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.trainer.states import TrainerFn

from diffckpt.errors import DiffCkptError
from diffckpt.integration import (
    NOT_GIVEN_BASE_EVERY_N_STEPS,
    NOT_GIVEN_EVERY_N_STEPS,
    NOT_GIVEN_WRITE_BATCH,
    Auto,
    ByBytes,
    CheckpointEngine,
    CheckpointOptions,
    Codec,
    GradientCompressor,
    NotGiven,
    merge_options,
    step_metrics,
)

from . import model_parallel
from .coexistence import behind_model_checkpoints, refuse_model_checkpoint_keywords
from .compression import GradientCompression
from .references import drop_last_candidate, last_candidate, write_reference
from .samplers import SamplerOrderTracker
from .state import CallbackState, StepState, checkpoint_dict, framework_dict

__all__ = ["DiffCheckpoint"]

log = logging.getLogger("diffckpt")


class DiffCheckpoint(ModelCheckpoint):
    """Differential checkpoints for a Lightning ``Trainer``.

    Args:
        dirpath: run root: a local path or any fsspec URL (``memory://``, ``s3://``...).
        every_n_steps: a restorable point every this many optimizer steps.
        write_batch: consecutive step records per segment (one write each).
        base_every_n_steps: ``"bytes"`` (the default): a full base once the step records since the
            last one add up to ``options.base_every_diff_bytes_ratio`` (4) times a base's size; an
            integer: a full base every this many steps; ``None``: none but the one when training starts
            (there is one when training starts in every case).
            Each of the three may be ``"auto"``: the auto-tuner measures the run and picks it
            for ``options.tuning`` (:class:`diffckpt.TuningOptions`); its decisions are logged to
            the Trainer's loggers as ``diffckpt/*`` metrics.
        options: every other setting (:class:`diffckpt.CheckpointOptions`: fingerprints, queue
            size, retries, retention, compaction...); a knob above left at its default takes its
            value from here.
        storage_options: fsspec options (credentials, endpoint).
        codec: compressed training (``diffckpt.codecs.TopK``, ``PowerSGD``, ``LowPrecision``):
            the codec runs as the DDP communication hook, or on the gradients before the step in
            a single process, and its payloads are the diffs. ``None``: exact dense diffs.
        **legacy: :class:`diffckpt.CheckpointOptions` fields as keywords, the spelling before
            ``options=``: deprecated, still accepted with a ``DeprecationWarning``.

    Use with ``plugins=[DiffCheckpointIO()]`` and resume with ``Trainer.fit(ckpt_path="last")``.
    """

    def __init__(self, dirpath: str | os.PathLike[str], *, every_n_steps: int | Auto | NotGiven = NOT_GIVEN_EVERY_N_STEPS,
                 write_batch: int | Auto | NotGiven = NOT_GIVEN_WRITE_BATCH,
                 base_every_n_steps: int | Auto | ByBytes | NotGiven | None = NOT_GIVEN_BASE_EVERY_N_STEPS,
                 options: CheckpointOptions | None = None, storage_options: dict[str, Any] | None = None,
                 codec: Codec | None = None, **legacy: Any) -> None:
        refuse_model_checkpoint_keywords(legacy)
        super().__init__(dirpath=None, save_top_k=0, save_last=False)
        self.options = merge_options(options, legacy, every_n_steps=every_n_steps, write_batch=write_batch,
                                     base_every_n_steps=base_every_n_steps)
        self.url = os.fspath(dirpath)
        self.storage_options = dict(storage_options or {})
        self.engine = CheckpointEngine(self.url, self.options, self.storage_options)
        self._compression = None if codec is None else GradientCompression(codec, self.options.codec_check_every)
        self.dirpath = self.url
        self.durable_step: int | None = None
        self._trainer: pl.Trainer | None = None
        self._restore_at = "batch_start"  # where the RNG of the newest recorded step is restored
        self._own = CallbackState()  # DiffCheckpoint's part of Lightning's checkpoint: the RNG
        self._deferred = False
        self._epoch_end = False
        self._order = SamplerOrderTracker()
        self._last: str | None = None  # a local reference for ckpt_path="last" (remote runs)

    # ---------------------------------------------------------------- identity
    @property
    def state_key(self) -> str:
        # Independent of dirpath: a run resumed from another run root must find its state.
        return "DiffCheckpoint"

    @property
    def compressor(self) -> GradientCompressor | None:
        """The compressor of compressed training (``codec=``), once set up."""
        return None if self._compression is None else self._compression.compressor

    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        # Lightning resolves ckpt_path="last" through this (DiffCheckpointIO then resolves the
        # candidate to the newest durable step).
        if not self.engine.run_exists():
            return set()
        self._last, found = last_candidate(self.engine, self.url, self._last)
        return {found}

    # ------------------------------------------------------------------- setup
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from .checkpoint_io import DiffCheckpointIO

        self._trainer = trainer
        behind_model_checkpoints(trainer, DiffCheckpoint)
        # Per-run state: a previous fit that ended in an exception must not leak into this one.
        self._deferred = self._epoch_end = False
        strategy = trainer.strategy
        if model_parallel.check_strategy(strategy, codec=self._compression is not None):
            # ModelParallelStrategy saves and loads without CheckpointIO: methods bound on the
            # strategy object route both through diffckpt (see model_parallel.py for why there).
            model_parallel.install(trainer, self._load_live, self.storage_options)
        if isinstance(strategy.checkpoint_io, DiffCheckpointIO):
            strategy.checkpoint_io.attach(self)
        if stage == "fit" and trainer.world_size > 1:
            self._order.install()
        if self._compression is not None:
            self._compression.setup(trainer, pl_module, stage)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._order.realign(trainer)  # resumed in a dealt epoch: before the epoch loop restores its counters
        model_parallel.check_sharded(trainer, pl_module)
        if self._compression is not None:
            self._compression.on_train_start(trainer, pl_module)
        self.engine.begin(pl_module, list(trainer.optimizers), trainer.global_step,
                          self._step_state(trainer, "batch_start"), compressor=self.compressor,
                          meta={"framework": f"lightning {pl.__version__}",
                                "strategy": type(trainer.strategy).__name__},
                          resume_hint='pass ckpt_path="last" to trainer.fit')

    # ------------------------------------------------------------------ capture
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        self.engine.mark_update_start()  # the closure (forward, backward) is done: the update starts
        if self._compression is not None:
            self._compression.on_before_optimizer_step(trainer, pl_module, optimizer)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply_pending_rng("epoch_start")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._apply_pending_rng("batch_start")
        self.engine.check()

    def _apply_pending_rng(self, where: str) -> None:
        self._own.apply_pending(where)
        if where == "batch_start":
            self._order.replay = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.engine.recorded_step:
            return
        loop = trainer.fit_loop.epoch_loop
        if loop.batch_progress.is_last_batch:
            # Recorded at the epoch's end, after epoch-end validation drew from the RNG; on
            # resume the RNG is restored before the next epoch's iterator draws its order.
            self._epoch_end = True
        elif loop._should_check_val_fx(trainer.fit_loop._data_fetcher):
            # Validation draws from the RNG and is not run again on resume: record after it
            # (where ModelCheckpoint saves) and restore the RNG at the next batch.
            self._deferred = True
        else:
            self._commit(trainer, "batch_start")

    def _step_open(self, trainer: pl.Trainer) -> bool:
        """Whether fitting has a step not recorded yet (false in validate/test or after a record)."""
        return trainer.state.fn == TrainerFn.FITTING and trainer.global_step != self.engine.recorded_step

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking and self._deferred and self._step_open(trainer):
            self._deferred = False
            self._commit(trainer, "batch_start")

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._commit_epoch_end(trainer)
        self.engine.check()

    def _commit_epoch_end(self, trainer: pl.Trainer) -> None:
        if not self._epoch_end:
            return
        self._epoch_end = False
        if self._step_open(trainer):
            self._commit(trainer, "epoch_start")

    def _commit(self, trainer: pl.Trainer, restore_at: str) -> None:
        """Record the current step (every rank), then the references that wait for it."""
        step = trainer.global_step
        self._restore_at = restore_at
        done = self.engine.commit(step, self._step_state(trainer, restore_at))
        # The core's metrics at the loggers' own frequency (empty where this rank does not write).
        metrics = step_metrics(self.engine, done, step, trainer.log_every_n_steps)
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def _step_state(self, trainer: pl.Trainer, restore_at: str) -> StepState:
        """The engine's view of this step (the RNG restored at ``restore_at`` on resume)."""
        return StepState(trainer, self._order, functools.partial(self._own.dumping, restore_at),
                         model_parallel.states_skipped)

    def _lightning_dict(self, state: dict[str, Any]) -> dict[str, Any]:
        """A replayed step's Lightning checkpoint, with this rank's RNG and position."""
        trainer = self._trainer
        sampling = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer is not None else None
        return framework_dict(state, self.state_key, self.engine, self._order,
                              (sampling or {}).get("num_replicas", 1))

    def _load_live(self, url: str, step: int | None, module: torch.nn.Module,
                   optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
        """Resume ``step`` of ``url`` into the live module and optimizers (ModelParallelStrategy's
        ``load_checkpoint``, bound by model_parallel): Lightning's part of the checkpoint."""
        result = self.engine.resume(module, optimizers, step, dirpath=url)
        assert result is not None  # without missing_ok, resume raises instead
        return self._lightning_dict(result.state)

    # -------------------------------------------------------------- callback state
    def state_dict(self) -> dict[str, Any]:
        return self._own.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._own.load_state_dict(state_dict)

    # ---------------------------------------------------------------- shutdown
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        reason = "stopped by SIGTERM" if trainer.received_sigterm else f"interrupted by {type(exception).__name__}"
        try:
            self._close(reason, self.options.flush_timeout_s)
        except Exception:  # the original exception is what the user must see
            log.exception("diffckpt: flushing after %s failed too", type(exception).__name__)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._deferred:
            self._deferred = False
            if self._step_open(trainer):
                self._commit(trainer, "batch_start")
        self._commit_epoch_end(trainer)
        if trainer.received_sigterm:  # preempted: the flush must end before the grace period does
            self._close("stopped by SIGTERM", self.options.flush_timeout_s)
            return
        # The last step was recorded without state (every_n_steps above 1, or tuned so): a base
        # at it carries the state, so fitting further resumes there.
        step = trainer.global_step
        if step == self.engine.recorded_step and trainer.state.fn == TrainerFn.FITTING:
            self.engine.make_restorable(step, self._step_state(trainer, self._restore_at))
        self._close("end of training")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close("teardown")
        model_parallel.uninstall(trainer.strategy)
        drop_last_candidate(self._last)
        self._last = None

    def _close(self, reason: str, timeout: float | None = None) -> None:
        self._order.uninstall()
        started = self.engine.started
        durable = self.engine.end(reason, timeout)
        if started:
            self.durable_step = durable

    # ---------------------------------------------------------------- restore
    def restore_checkpoint(self, url: str, step: int | None) -> dict[str, Any]:
        """Rebuild the Lightning checkpoint dict of ``step`` (newest durable if ``None``)."""
        trainer = self._require_trainer()
        module = trainer.lightning_module
        # Replay where training ran: in the precision and on the device the strategy is about to
        # give the module (Lightning restores before it does so itself).
        trainer.precision_plugin.convert_module(module)
        module.to(trainer.strategy.root_device)
        optimizers = _init_optimizers_and_lr_schedulers(module)[0]
        result = self.engine.resume(module, optimizers, step, dirpath=url, compressor=self.compressor)
        assert result is not None  # without missing_ok, resume raises instead
        return checkpoint_dict(self._lightning_dict(result.state), module, optimizers)

    def save_reference(self, step: int, path: str) -> None:
        """Back a checkpoint that Lightning saves through DiffCheckpointIO with a reference.

        The reference is written once the step's record is queued (after it, in order), so a
        save made before DiffCheckpoint has recorded the step, or while its record waits for
        validation or the epoch end, simply waits too.
        """
        trainer = self._require_trainer()
        waiting = (self._deferred or self._epoch_end) and step == trainer.global_step
        url, options = self.url, self.storage_options
        self.engine.when_restorable(step, lambda: write_reference(path, url, step, options), name=path,
                                    wait=waiting)

    def remove_reference(self, path: str, remove: Any) -> None:
        """Remove a reference after everything queued before it (removals never overtake saves);
        its step is then kept for it no more, in this session and later ones."""
        self.engine.when_removed(remove, name=path)

    def _require_trainer(self) -> pl.Trainer:
        if self._trainer is None:
            raise DiffCkptError("DiffCheckpoint is not attached to a Trainer yet")
        return self._trainer
