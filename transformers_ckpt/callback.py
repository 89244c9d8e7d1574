"""``DiffCheckpointCallback``: differential checkpoints for the transformers ``Trainer``.

The callback translates Trainer events into :class:`diffckpt.CheckpointEngine` calls, which every
process makes; the engine decides who writes. The Trainer's own ``resume_from_checkpoint``
finds the run through a *resume point* (:mod:`transformers_ckpt.resume_point`), and the callback
replays the step into the prepared model, optimizer and scheduler in ``on_train_begin``.

When a step is final. At ``on_step_end`` of step k the model, optimizer and scheduler have
stepped, but the Trainer logs, evaluates and saves afterwards (eval loaders draw from the RNG,
logging changes ``log_history``). Step k is therefore committed at the next loop event: the next
``on_step_begin`` (mid-epoch; the next batches are fetched by then) or ``on_epoch_begin`` (after
an epoch's last step; before the next epoch's shuffle), or ``on_train_end``. Each rank's RNG is
taken there and restored at the same event of the resumed run, where the Trainer's own resume
would restore it. The RNG at each ``on_epoch_begin`` is kept with every step too: restored at the
resumed epoch's start, it makes a sampler that draws its order from the global RNG
(``use_seedable_sampler=False``) shuffle as the interrupted epoch did.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
from typing import Any

import transformers
from transformers import Trainer, TrainerCallback

from diffckpt.errors import CheckpointNotFoundError, CorruptRecordError, DiffCkptError
from diffckpt.integration import (
    NOT_GIVEN_BASE_EVERY_N_STEPS,
    NOT_GIVEN_EVERY_N_STEPS,
    NOT_GIVEN_WRITE_BATCH,
    Auto,
    ByBytes,
    CheckpointEngine,
    CheckpointOptions,
    NotGiven,
    StepDriver,
    check_replayable,
    get_rng_state,
    merge_options,
    set_rng_state,
)

from .reporting import MetricsToReports
from .resume_point import (
    read_marker,
    remove_resume_points,
    set_aside_incomplete_saves,
    write_resume_point,
)
from .state import StepState, load_callback_states, load_trainer_state, load_window
from .support import check_supported

__all__ = ["DiffCheckpointCallback"]

log = logging.getLogger("diffckpt")

CHOSEN_DIR = ".diffckpt-resume"  # in output_dir: the resume points of chosen steps


class DiffCheckpointCallback(TrainerCallback):
    """Differential checkpoints of a transformers ``Trainer``: every optimizer step by default.

    Pass it in ``Trainer(callbacks=[...])`` and resume with
    ``trainer.train(resume_from_checkpoint=True)``: the newest durable step of the run.

    Args:
        dirpath: run root: a local path or any fsspec URL (``s3://``...), in a folder of its own
            (not the Trainer's ``output_dir``). With several processes it must be shared storage.
        every_n_steps: a restorable point every this many optimizer steps.
        write_batch: consecutive step records per segment (one write each).
        base_every_n_steps: ``"bytes"`` (the default): a full base once the step records since the
            last one add up to ``options.base_every_diff_bytes_ratio`` (4) times a base's size; an
            integer: a full base every this many steps; ``None``: none but the one when training starts
            (there is one when training starts in every case).
            Each of the three may be ``"auto"``: the auto-tuner measures the run and picks it
            for ``options.tuning`` (:class:`diffckpt.TuningOptions`).
        options: every other setting (:class:`diffckpt.CheckpointOptions`: fingerprints, queue
            size, retries, retention, compaction...); a knob above left at its default takes its
            value from here.
        storage_options: fsspec options (credentials, endpoint).
    """

    def __init__(self, dirpath: str | os.PathLike[str], *, every_n_steps: int | Auto | NotGiven = NOT_GIVEN_EVERY_N_STEPS,
                 write_batch: int | Auto | NotGiven = NOT_GIVEN_WRITE_BATCH,
                 base_every_n_steps: int | Auto | ByBytes | NotGiven | None = NOT_GIVEN_BASE_EVERY_N_STEPS,
                 options: CheckpointOptions | None = None, storage_options: dict[str, Any] | None = None) -> None:
        self.url = os.fspath(dirpath)
        self.options = merge_options(options, {}, every_n_steps=every_n_steps, write_batch=write_batch,
                                     base_every_n_steps=base_every_n_steps)
        self.storage_options = dict(storage_options or {})
        self.engine = CheckpointEngine(self.url, self.options, self.storage_options)
        self.trainer: Any = None
        self.resumed_step: int | None = None  # the step train() resumed, if it resumed one of ours
        self.epoch_rng: dict[str, Any] | None = None  # this rank's RNG at the current epoch's start
        self.epoch_generator: Any = None  # and its loader's shuffling generator, if it has one
        self.log_cache: list[str] = []  # log_history entries encoded as JSON (see trainer_state_json)
        self._resume: dict[str, Any] | None = None  # this rank's restored RNG, until its event
        self._step = 0  # the newest optimizer step taken (TrainerState.global_step)
        self.driver = StepDriver(self.engine, self.options, on_close=lambda: atexit.unregister(self._interrupted))
        self._begin_at_step = False

    # ------------------------------------------------------------------ resuming
    def checkpoint(self, step: int | str = "last") -> str | None:
        """The ``resume_from_checkpoint`` argument that resumes ``step`` (``"last"``: the newest
        durable one): a resume point folder in ``output_dir``, written now. ``"last"`` on a run
        with nothing durable gives ``None``, which starts training afresh.

        ``trainer.train(resume_from_checkpoint=callback.checkpoint(120))`` resumes step 120. Call
        it on every process, after the Trainer was created.

        Raises:
            CheckpointNotFoundError: an explicit ``step`` is not durable.
        """
        self._require_trainer()
        newest = self.engine.newest_step()
        if step == "last":
            if newest is None:
                return None
            step = newest
        elif not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"step must be 'last' or a step number, got {step!r}")
        elif newest is None or step > newest:
            raise CheckpointNotFoundError(
                f"step {step} is not durable under {self.url} (newest durable: {newest}); see "
                f"`diffckpt ls {self.url}`")
        return self._resume_point(step)

    def _resume_point(self, step: int) -> str:
        # A chosen step's folder lies apart from output_dir's checkpoint-N folders, so that
        # resume_from_checkpoint=True keeps finding the newest one.
        args = self.trainer.args
        parent = os.path.join(args.output_dir, CHOSEN_DIR)
        path = os.path.join(parent, f"checkpoint-{step}")
        if args.should_save:
            path = write_resume_point(parent, self.url, step, args)
        self.engine.collective.barrier()  # the folder exists before any process resumes from it
        return path

    # ------------------------------------------------------------------ events
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._attach()
        # Trainer.train(resume_from_checkpoint=True) looks for the largest checkpoint-N before any
        # other event: the newest durable step gets its resume point now.
        newest = self.engine.newest_step()
        if args.should_save:
            keep = None if newest is None else write_resume_point(args.output_dir, self.url, newest, args)
            remove_resume_points(args.output_dir, keep=keep)
            if newest is not None:
                set_aside_incomplete_saves(args.output_dir, newest)
        if newest is None:
            log.info("diffckpt: nothing durable under %s yet: train() starts afresh; "
                     "train(resume_from_checkpoint=True) would stop with the Trainer's 'No valid "
                     "checkpoint found' (use resume_from_checkpoint=callback.checkpoint(), which is "
                     "None on a fresh run)", self.url)
        self.engine.collective.barrier()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._attach()
        self._resume = self.epoch_rng = self.epoch_generator = None
        self.log_cache.clear()
        optimizer = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
        check_replayable(optimizer)
        self._module, self._optimizers = trainer.model, [optimizer]
        self._step = state.global_step
        marker = read_marker(state)
        if marker is not None:
            self._restore(marker)
        # The resume point has been read on every process (the model's preparation is a
        # collective): it goes, so that it never counts against the Trainer's save_total_limit.
        self.engine.collective.barrier()
        if args.should_save:
            remove_resume_points(args.output_dir)
            remove_resume_points(os.path.join(args.output_dir, CHOSEN_DIR))
        # After a resume from one of the Trainer's own saves, the Trainer restores the RNG just
        # before the first step: the session's base is taken there, with that RNG.
        self._begin_at_step = marker is None and state.global_step > 0
        self.driver.arm()  # a later train() call is a session of its own
        atexit.register(self._interrupted)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Under DDP a sampler that is not seedable shuffles from a generator of the loader's own,
        # which Accelerate sends from rank 0 at each epoch's start: kept and restored here too.
        generator = getattr(kwargs.get("train_dataloader"), "synchronized_generator", None)
        if self._resume is not None:
            mine = self._resume
            if mine.get("epoch_generator") is not None and generator is not None:
                generator.set_state(mine["epoch_generator"])
            if mine["at"] == "epoch":  # the restored step ended an epoch: its RNG goes here
                set_rng_state(mine["rng"])
                self._resume = None
            elif mine["epoch_rng"] is not None:  # mid-epoch: the epoch's shuffle first
                set_rng_state(mine["epoch_rng"])
        self.epoch_rng = get_rng_state()
        self.epoch_generator = None if generator is None else generator.get_state()
        self._point("epoch", control)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._resume is not None:  # mid-epoch: after the next batches were fetched
            set_rng_state(self._resume["rng"])
            self._resume = None
        self._point("step", control)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step = state.global_step

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # With load_best_model_at_end the Trainer loads the best checkpoint's weights into the
        # model before on_train_end: the last step is committed here, while the model holds it.
        if args.load_best_model_at_end and (control.should_training_stop or state.global_step >= state.max_steps):
            self._point("epoch", control)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        best_loaded = args.load_best_model_at_end and state.best_model_checkpoint is not None
        self.close(record=not best_loaded)

    # ------------------------------------------------------------------ internals
    def _attach(self) -> Any:
        """The Trainer that runs this callback, checked (callbacks are not handed the Trainer:
        it is the ``self`` of the Trainer method that fires the event)."""
        if self.trainer is None:
            frame = inspect.currentframe()
            while frame is not None and not isinstance(frame.f_locals.get("self"), Trainer):
                frame = frame.f_back
            if frame is None:
                raise DiffCkptError("DiffCheckpointCallback must be run by a transformers Trainer: pass it "
                                    "as Trainer(callbacks=[...])")
            trainer = frame.f_locals["self"]
            check_supported(trainer, self.url)
            self.trainer = trainer
            # First of all callbacks, so that the reporting integrations (which the Trainer puts
            # before the user's callbacks) are handed the metrics too.
            trainer.callback_handler.callbacks.insert(0, MetricsToReports(self.driver))
        return self.trainer

    def _require_trainer(self) -> None:
        if self.trainer is None:
            raise DiffCkptError("create the Trainer with callbacks=[this callback] before asking for a "
                                "checkpoint to resume from")

    def _restore(self, marker: dict[str, Any]) -> None:
        """Replay the step a resume point names into the prepared model, optimizer and scheduler."""
        if marker["run"].rstrip("/") != self.url.rstrip("/"):
            raise DiffCkptError(
                f"resume_from_checkpoint names step {marker['step']} of the run {marker['run']}, but this "
                f"callback records into {self.url}; resume with the callback of that run")
        step = int(marker["step"])
        try:
            result = self.engine.resume(self._module, self._optimizers, step)
        except CorruptRecordError as exc:
            raise CorruptRecordError(
                f"step {step} of {self.url} cannot be rebuilt ({exc}); nothing was changed. `diffckpt "
                f"verify {self.url}` names the newest step that can be: resume it with "
                "trainer.train(resume_from_checkpoint=callback.checkpoint(STEP))") from exc
        assert result is not None
        ranks = load_trainer_state(self.trainer, result, self.url)
        if self.trainer.args.restore_callback_states_from_checkpoint:
            # The Trainer restored callback states from the resume point, which holds none.
            load_callback_states(self.trainer)
        mine = self.engine.own(ranks)
        load_window(self.trainer, mine)
        self._resume = mine
        self._step = self.resumed_step = result.step
        log.info("diffckpt: resumed step %d of %s (base %d + %d replayed steps)", result.step, self.url,
                 result.base_step, result.replayed)

    @property
    def durable_step(self) -> int | None:
        """The durable step the last session's close reported (``None`` before)."""
        return self.driver.durable_step

    def _point(self, at: str, control: Any) -> None:
        """A loop event after which the last step is final: start recording, or commit it."""
        if self.driver.closed:
            return

        def begin() -> bool:
            if self._begin_at_step and at == "epoch":
                return False
            trainer = self.trainer
            self.engine.begin(self._module, self._optimizers, self._step, StepState(self, at),
                              meta={"framework": f"transformers {transformers.__version__}",
                                    "world_size": trainer.args.world_size,
                                    "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
                                    "output_dir": os.path.basename(os.path.abspath(trainer.args.output_dir))},
                              resume_hint="pass resume_from_checkpoint=True to trainer.train")
            return True

        self.driver.boundary(self._step, begin, lambda: StepState(self, at))
        self.engine.check()

    def close(self, reason: str = "end of training", timeout: float | None = None, at: str = "step",
              record: bool = True) -> int | None:
        """Record the last step as restorable, flush and stop writing; return the durable step.
        ``on_train_end`` calls it; every process must. ``record=False`` flushes only what is
        recorded (the model no longer holds the last step's weights)."""
        return self.driver.close(self._step, lambda: StepState(self, at), reason, timeout, record)

    def _interrupted(self) -> None:
        """At interpreter exit without on_train_end (an exception in training): flush what is recorded."""
        self.driver.interrupted("interrupted before the end of training")
