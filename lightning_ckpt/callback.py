"""``DiffCheckpoint``: the Lightning callback that captures a diff at every optimizer step.

It is a ``ModelCheckpoint`` only so that ``Trainer.fit(ckpt_path="last")`` finds it (Lightning
asks ModelCheckpoint-type callbacks for the last checkpoint); none of ModelCheckpoint's saving
runs. Everything it does is translate Lightning events into :class:`diffckpt.CheckpointEngine`
calls.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn

from diffckpt.codecs import Codec
from diffckpt.codecs.compressor import GradientCompressor
from diffckpt.engine import CheckpointEngine
from diffckpt.errors import DiffCkptError, UnsupportedConfigurationError
from diffckpt.options import CheckpointOptions
from diffckpt.rng import get_rng_state, set_rng_state
from diffckpt.runstore import RUN_FILE
from diffckpt.tuning.model import tuning_metrics

from .compression import GradientCompression
from .references import write_reference
from .samplers import SamplerOrderTracker

__all__ = ["DiffCheckpoint"]

log = logging.getLogger("diffckpt")


class DiffCheckpoint(ModelCheckpoint):
    """Differential checkpoints for a Lightning ``Trainer``.

    Args:
        dirpath: run root: a local path or any fsspec URL (``memory://``, ``s3://``...).
        every_n_steps: a restorable point every this many optimizer steps.
        write_batch: consecutive step records per segment (one write each).
        base_every_n_steps: a full base every this many steps, plus one when training starts.
            Each of the three may be ``"auto"``: the auto-tuner measures the run and picks it
            for ``tuning=diffckpt.TuningOptions(mtbf_s=..., max_overhead=..., rto_s=...)``;
            its decisions are logged to the Trainer's loggers as ``diffckpt/*`` metrics.
        storage_options: fsspec options (credentials, endpoint).
        codec: compressed training (``diffckpt.codecs.TopK``, ``PowerSGD``, ``LowPrecision``):
            the codec runs as the DDP communication hook, or on the gradients before the step in
            a single process, and its payloads are the diffs. ``None``: exact dense diffs.
        **options: further :class:`diffckpt.CheckpointOptions` fields
            (``fingerprint_every_n_steps``, ``max_pending_bytes``, ``compression``...).

    Use with ``plugins=[DiffCheckpointIO()]`` and resume with ``Trainer.fit(ckpt_path="last")``.
    """

    def __init__(self, dirpath: str | os.PathLike[str], *, every_n_steps: int | str = 1, write_batch: int | str = 8,
                 base_every_n_steps: int | str | None = 500, storage_options: dict[str, Any] | None = None,
                 codec: Codec | None = None, **options: Any) -> None:
        super().__init__(dirpath=None, save_top_k=0, save_last=False)
        self.options = CheckpointOptions(every_n_steps=every_n_steps, write_batch=write_batch,
                                         base_every_n_steps=base_every_n_steps, **options)
        self.url = os.fspath(dirpath)
        self.storage_options = dict(storage_options or {})
        self.engine = CheckpointEngine(self.url, self.options, self.storage_options)
        self._compression = None if codec is None else GradientCompression(
            codec, self.options.fingerprint_every_n_steps or 50)
        self._codec_states: list[dict[str, Any]] | None = None
        self.dirpath = self.url
        self.durable_step: int | None = None
        self._trainer: pl.Trainer | None = None
        self._last_recorded = -1
        self._last_restore_at = "batch_start"
        self._last_had_state = True
        self._last_state_step = -1
        self._pending_rng: dict[str, Any] | None = None
        self._pending_at = "batch_start"
        self._capture_at = "batch_start"
        self._deferred = False
        self._epoch_end = False
        self._pending_refs: list[tuple[str, int]] = []
        self._restored: tuple[int, Any] | None = None
        self._rank_states: list[dict[str, Any]] | None = None
        self._order = SamplerOrderTracker()
        self._last_ref: str | None = None

    # ---------------------------------------------------------------- identity
    @property
    def state_key(self) -> str:
        # Independent of dirpath: a run resumed from another run root must find its state.
        return "DiffCheckpoint"

    @property
    def compressor(self) -> GradientCompressor | None:
        """The compressor of compressed training (``codec=``), once set up."""
        return None if self._compression is None else self._compression.compressor

    @property
    def is_writer(self) -> bool:
        return self._trainer is not None and self._trainer.is_global_zero

    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        # Lightning resolves ckpt_path="last" through this; run.json is rewritten at every session
        # start, and DiffCheckpointIO resolves it to the newest durable step.
        if not self.engine.store.is_run():
            return set()
        if self.engine.storage_is_local:
            return {self._run_file()}
        # Lightning stats the candidate with a file system built from the path alone, which
        # knows neither our storage_options nor the endpoint: hand it a local reference instead.
        if self._last_ref is None:
            self._last_ref = os.path.join(tempfile.mkdtemp(prefix="diffckpt-last-"), "last.ckpt")
        write_reference(self._last_ref, self.url, None, {})
        return {self._last_ref}

    def _run_file(self) -> str:
        return self.url.rstrip("/") + "/" + RUN_FILE

    # ------------------------------------------------------------------- setup
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from .checkpoint_io import DiffCheckpointIO

        self._trainer = trainer
        # Per-run state: a previous fit that ended in an exception must not leak into this one.
        self._deferred = self._epoch_end = False
        self._pending_refs, self._restored = [], None
        strategy = trainer.strategy
        if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or type(strategy).__name__ in (
                "FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy"):
            raise UnsupportedConfigurationError(
                f"DiffCheckpoint does not support {type(strategy).__name__}: sharded parameters and "
                "optimizer states cannot be replayed from one rank's diffs yet. Use a single device "
                "or strategy='ddp', or use Lightning's ModelCheckpoint for this run")
        if isinstance(strategy.checkpoint_io, DiffCheckpointIO):
            strategy.checkpoint_io.attach(self)
        if stage == "fit" and trainer.world_size > 1:
            self._order.install()
        if self._compression is not None:
            self._compression.setup(trainer, pl_module, stage)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        self._last_recorded, self._last_had_state = step, True
        restored = self._restored is not None and self._restored[0] == step
        if not restored and trainer.world_size > 1:
            self._rank_states = self._gather_rank_states(trainer)
        if self._compression is not None:
            self._compression.on_train_start(trainer, pl_module)
            self._codec_states = self._gather_codec_states(trainer)
        if not self.is_writer:
            self.engine.join(step)
            self._restored = None
            return
        optimizers = list(trainer.optimizers)
        self.engine.start(pl_module, optimizers, step, meta={
            "framework": f"lightning {pl.__version__}", "torch": torch.__version__,
            "strategy": type(trainer.strategy).__name__, "world_size": trainer.world_size},
            compressor=self.compressor)
        state = self._restored[1] if restored else self._small_state(trainer)
        self._rank_states = None
        self._write_base(step, state)
        self._restored = None
        self._last_state_step = step

    # ------------------------------------------------------------------ capture
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if self.engine.capture is not None:  # the closure (forward, backward) is done: the update starts
            self.engine.capture.mark_update_start()
        if self._compression is not None:
            self._compression.on_before_optimizer_step(trainer, pl_module, optimizer)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply_pending_rng("epoch_start")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._apply_pending_rng("batch_start")
        self.engine.check()

    def _apply_pending_rng(self, where: str) -> None:
        # RNG is restored where it was captured relative to the data: before the next batch
        # mid-epoch, before the next epoch's iterator (which draws from it) at an epoch end.
        if self._pending_rng is not None and (where == self._pending_at or where == "batch_start"):
            set_rng_state(self._pending_rng)
            self._pending_rng = None
        if where == "batch_start":
            self._order.replay = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._last_recorded:
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
            self._commit(self._take(trainer, "batch_start"))

    def _step_open(self, trainer: pl.Trainer) -> bool:
        """Whether fitting has a step not recorded yet (false in validate/test or after a record)."""
        return trainer.state.fn == TrainerFn.FITTING and trainer.global_step != self._last_recorded

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking and self._deferred and self._step_open(trainer):
            self._deferred = False
            self._commit(self._take(trainer, "batch_start"))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._commit_epoch_end(trainer)
        self.engine.check()

    def _commit_epoch_end(self, trainer: pl.Trainer) -> None:
        if not self._epoch_end:
            return
        self._epoch_end = False
        if not self._step_open(trainer):
            return
        self._commit(self._take(trainer, "epoch_start"))

    def _take(self, trainer: pl.Trainer, restore_at: str) -> tuple[int, dict[str, Any] | None, bool]:
        """Take what the record of the current step needs: ``(step, state or None, base?)``.

        Every DDP rank calls this at the same points (it gathers per-rank state); only rank 0
        gets a state back.
        """
        step = trainer.global_step
        self._last_recorded, self._last_restore_at = step, restore_at
        engine = self.engine
        if engine.review_due(step):
            self._review(trainer, step)
        wants_state, wants_base = engine.wants_state(step), engine.wants_base(step)
        self._last_had_state = wants_state  # the same on every rank
        with engine.measuring_state():
            if wants_state and trainer.world_size > 1:
                self._rank_states = self._gather_rank_states(trainer)
            if wants_base and self._compression is not None:
                self._codec_states = self._gather_codec_states(trainer)
        if not self.is_writer:
            engine.follow(step, wants_base)
            return step, None, wants_base
        self._capture_at = restore_at
        try:
            with engine.measuring_state():
                state = self._small_state(trainer) if wants_state else None
        finally:
            self._capture_at, self._rank_states = "batch_start", None
        return step, state, wants_base

    def _review(self, trainer: pl.Trainer, step: int) -> None:
        """Let the auto-tuner review its settings; under DDP rank 0 decides and every rank adopts."""
        engine = self.engine
        decision = engine.review(step) if self.is_writer else None
        if trainer.world_size > 1:
            shared = [(engine.settings, engine.tuning.next_review) if self.is_writer else None]
            torch.distributed.broadcast_object_list(shared, src=0)
            if not self.is_writer:
                engine.adopt(*shared[0])
        if decision is not None and engine.tuning.last_review is not None:
            metrics = tuning_metrics(*engine.tuning.last_review)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def _commit(self, held: tuple[int, dict[str, Any] | None, bool]) -> None:
        """Queue a taken step (rank 0), its base if one is due, and references waiting for it."""
        if not self.is_writer:
            return
        step, state, wants_base = held
        self.engine.record_step(step, state)
        if state is not None:
            self._last_state_step = step
        if wants_base:
            self._write_base(step, state)
        pending, self._pending_refs = self._pending_refs, []
        for path, ref_step in pending:
            if ref_step == step and state is None:
                raise DiffCkptError(
                    f"a checkpoint was saved at step {step} ({path}), which is not a restorable step "
                    f"with every_n_steps={self._every()}; save checkpoints only at "
                    "multiples of every_n_steps (e.g. ModelCheckpoint(every_n_train_steps=...))")
            self._write_reference(path, ref_step)

    def _write_base(self, step: int, state: Any) -> None:
        trainer = self._require_trainer()
        codec_states, self._codec_states = self._codec_states, None
        self.engine.write_base(step, trainer.lightning_module.state_dict(),
                               [o.state_dict() for o in trainer.optimizers], state, codec_states)

    def _gather_codec_states(self, trainer: pl.Trainer) -> list[dict[str, Any]] | None:
        """Every rank's codec state (error-feedback residuals differ per rank), on rank 0."""
        mine = self.compressor.state_dict() if self.compressor is not None else {}
        return self._gather(trainer, mine) if trainer.world_size > 1 else [mine]

    @staticmethod
    def _gather(trainer: pl.Trainer, mine: Any) -> list[Any] | None:
        gathered: list[Any] | None = [None] * trainer.world_size if trainer.is_global_zero else None
        torch.distributed.gather_object(mine, gathered, dst=0)
        return gathered

    def _gather_rank_states(self, trainer: pl.Trainer) -> list[dict[str, Any]] | None:
        """Every rank's RNG and data position, gathered on rank 0.

        Lightning saves only rank 0's loader state and restores it on every rank, so after a
        mid-epoch resume the other ranks would read different batches; each rank gets its own.
        """
        mine = {"rng": get_rng_state(), "loops": trainer.fit_loop.on_save_checkpoint(),
                "sampler_rng": self._order.captured}
        return self._gather(trainer, mine)

    @staticmethod
    def _small_state(trainer: pl.Trainer) -> dict[str, Any]:
        """Lightning's own checkpoint dict without the tensors that replay rebuilds."""
        ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        ckpt.pop("state_dict", None)
        ckpt.pop("optimizer_states", None)
        return ckpt

    # -------------------------------------------------------------- callback state
    def state_dict(self) -> dict[str, Any]:
        if self._pending_rng is not None:
            state = {"rng": self._pending_rng, "restore_at": self._pending_at}
        else:
            state = {"rng": get_rng_state(), "restore_at": self._capture_at}
        if self._rank_states is not None:
            state["ranks"] = self._rank_states
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_rng = state_dict.get("rng")
        self._pending_at = state_dict.get("restore_at", "batch_start")

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
                self._commit(self._take(trainer, "batch_start"))
        self._commit_epoch_end(trainer)
        if not trainer.received_sigterm:
            self._seal(trainer)
        if trainer.received_sigterm:  # preempted: the flush must end before the grace period does
            self._close("stopped by SIGTERM", self.options.flush_timeout_s)
        else:
            self._close("end of training")

    def _seal(self, trainer: pl.Trainer) -> None:
        """Make the last step restorable when it was recorded without state (``every_n_steps``
        above 1, or tuned so): a base at it carries the state, so fitting further resumes there."""
        step = trainer.global_step
        if step != self._last_recorded or self._last_had_state or trainer.state.fn != TrainerFn.FITTING:
            return
        engine = self.engine
        with engine.measuring_state():
            if trainer.world_size > 1:
                self._rank_states = self._gather_rank_states(trainer)
            if self._compression is not None:
                self._codec_states = self._gather_codec_states(trainer)
        if not self.is_writer:
            return
        self._capture_at = self._last_restore_at
        try:
            state = self._small_state(trainer)
        finally:
            self._capture_at, self._rank_states = "batch_start", None
        self._write_base(step, state)
        self._last_state_step = step

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close("teardown")
        if self._last_ref is not None:
            shutil.rmtree(os.path.dirname(self._last_ref), ignore_errors=True)
            self._last_ref = None

    def _close(self, reason: str, timeout: float | None = None) -> None:
        self._order.uninstall()
        if not self.engine.started:
            for path, step in self._pending_refs:
                log.warning("diffckpt: %s was not written: step %d was never recorded (save "
                            "checkpoints through DiffCheckpointIO while fitting)", path, step)
            self._pending_refs = []
            return
        durable = self.engine.close(timeout)
        self.durable_step = durable
        pending, self._pending_refs = self._pending_refs, []
        for path, step in pending:
            if durable is not None and step <= durable:
                write_reference(path, self.url, step, self.storage_options)
            else:
                log.warning("diffckpt: %s was not written: step %d never became durable", path, step)
        (log.info if timeout is None else log.warning)("diffckpt: %s; durable up to step %s in %s",
                                                       reason, durable, self.url)

    # ---------------------------------------------------------------- restore
    def restore_checkpoint(self, url: str, step: int | None) -> dict[str, Any]:
        """Rebuild the Lightning checkpoint dict of ``step`` (newest durable if ``None``)."""
        trainer = self._require_trainer()
        module = trainer.lightning_module
        engine = self.engine if url.rstrip("/") == self.url.rstrip("/") else CheckpointEngine(
            url, storage_options=self.storage_options)
        # Replay where training ran: in the precision and on the device the strategy is about to
        # give the module (Lightning restores before it does so itself).
        trainer.precision_plugin.convert_module(module)
        module.to(trainer.strategy.root_device)
        optimizers = _init_optimizers_and_lr_schedulers(module)[0]
        result = engine.restore(module, optimizers, step, compressor=self.compressor, rank=trainer.global_rank)
        ckpt = dict(result.state)
        self._use_rank_state(ckpt, trainer)
        ckpt["state_dict"] = module.state_dict()
        ckpt["optimizer_states"] = [o.state_dict() for o in optimizers]
        self._restored = (result.step, result.state)
        log.info("diffckpt: restored step %d from %s (base %d + %d replayed steps)", result.step, url,
                 result.base_step, result.replayed)
        return ckpt

    def _use_rank_state(self, ckpt: dict[str, Any], trainer: pl.Trainer) -> None:
        """Put this rank's own RNG and data position into the checkpoint dict it restores."""
        ours = ckpt.get("callbacks", {}).get(self.state_key, {})
        ranks = ours.get("ranks")
        if not ranks:
            return
        if len(ranks) != trainer.world_size:
            log.warning("diffckpt: the run was trained on %d processes and resumes on %d; each rank's "
                        "data position and RNG cannot be carried over, so rank 0's are used "
                        "(the resumed run will not be bit-exact)", len(ranks), trainer.world_size)
            return
        mine = ranks[trainer.global_rank]
        ckpt["callbacks"][self.state_key] = dict(ours, rng=mine["rng"])
        fit_loop = ckpt["loops"]["fit_loop"]
        fit_loop["state_dict"] = dict(fit_loop.get("state_dict", {}), **mine["loops"])
        if mine.get("sampler_rng") is not None:
            self._order.replay = mine["sampler_rng"]

    def save_reference(self, step: int, path: str) -> None:
        """Back a checkpoint that Lightning saves through DiffCheckpointIO with a reference.

        The reference is written once the step's record is queued (after it, in order), so a
        save made before DiffCheckpoint has recorded the step, or while its record waits for
        validation or the epoch end, simply waits too.
        """
        trainer = self._require_trainer()
        if not self.is_writer:
            return
        waiting = self._deferred or self._epoch_end
        if step > self._last_recorded or (waiting and step == trainer.global_step):
            self._pending_refs.append((path, step))
            return
        if step > self._last_state_step:
            raise DiffCkptError(
                f"cannot save {path}: step {step} is not a restorable step with every_n_steps="
                f"{self._every()}; save checkpoints only at multiples of every_n_steps")
        self._write_reference(path, step)

    def _every(self) -> str:
        n = self.engine.settings.every_n_steps
        if self.options.every_n_steps == "auto":
            return (f"'auto' (now {n}; with ModelCheckpoint saving at fixed steps, give every_n_steps "
                    "a divisor of its every_n_train_steps instead of 'auto')")
        return str(n)

    def _write_reference(self, path: str, step: int) -> None:
        url, options = self.url, self.storage_options
        if self.engine.started:
            self.engine.writer.call(lambda: write_reference(path, url, step, options))
            return
        durable = self.engine.durable_step
        if durable is None or step > durable:
            raise DiffCkptError(f"cannot save {path}: step {step} is not durable in {url} "
                                f"(durable up to {durable}); save while DiffCheckpoint is capturing")
        write_reference(path, url, step, options)

    def remove_reference(self, path: str, remove: Any) -> None:
        """Remove a reference after everything queued before it (removals never overtake saves)."""
        if self.engine.started:
            self.engine.writer.call(remove)
        else:
            remove()

    def _require_trainer(self) -> pl.Trainer:
        if self._trainer is None:
            raise DiffCkptError("DiffCheckpoint is not attached to a Trainer yet")
        return self._trainer
