"""The writing process's half of the engine: one session's capture, records, bases and restore.

:class:`Recorder` is what :class:`~diffckpt.CheckpointEngine` is built on, and what a
single-process loop may call directly: :meth:`~Recorder.start` once the optimizers exist, then
after each training step :meth:`~Recorder.record_step` (and :meth:`~Recorder.write_base` when
:meth:`~Recorder.wants_base` says so), finally :meth:`~Recorder.close`. To resume,
:meth:`~Recorder.restore` replays onto the caller's model and optimizers. Nothing here talks to
other processes: :mod:`diffckpt.engine` does, and decides who records.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from .capture import StepCapture, clone_tree, group_hyperparams, tree_nbytes
from .codecs.compressor import GradientCompressor
from .errors import DiffCkptError
from .keptsteps import KeptSteps
from .leases import copy_tensors
from .lifecycle.footprint import session_projection
from .lifecycle.maintenance import Maintenance
from .localtier import merge_for_rank
from .locate import Located, locate
from .lossbound import Restating, loss_bound
from .options import BY_BYTES, CheckpointOptions
from .policies import IntervalPolicy, StepContext
from .replay import ReplayResult
from .replicas import not_owned, recorded_pieces, without_replicas
from .restoring import restore_live
from .runstore import RunStore
from .sessionfile import session_body, training_device, training_meta
from .shardedrun import ShardedRun
from .sharding import local, local_tree
from .snapshot import snapshot_tree
from .staging import HostStage
from .storage import Storage, open_storage
from .storage.retry import unwrap
from .tuning.model import Decision, Settings
from .tuning.online import OnlineTuning
from .writer import BackgroundWriter

__all__ = ["Recorder"]

log = logging.getLogger("diffckpt")


class Recorder:
    """One model and its optimizers recorded into one run root, by the process that writes.

    Args:
        dirpath: local path, fsspec URL (``memory://``, ``s3://``, ...) or a :class:`Storage`.
        options: capture, batching and base settings.
        storage_options: passed to fsspec (credentials, endpoint, ...).
    """

    def __init__(self, dirpath: str | os.PathLike[str] | Storage, options: CheckpointOptions | None = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.options = options or CheckpointOptions()
        self.storage_options = dict(storage_options or {})
        self.storage = open_storage(dirpath, retry=self.options.retry, **self.storage_options)
        self.store = RunStore(self.storage)
        # Where this process's session writes: the run root, or its own stream under it (a rank
        # of sharded training, chosen by the engine before start()).
        self.stream = self.store
        self.collects_garbage = True  # runs retention (one process per run root does)
        self.policy = IntervalPolicy()
        self.writer: BackgroundWriter | None = None
        self.capture: StepCapture | None = None
        self.module: torch.nn.Module | None = None
        self._prev_step = self._last_base = 0
        self._buffer_names: list[str] = []
        self._durable: int | None = None
        self._base_nbytes = 0  # bytes of the newest base handed to the writer
        self._restating = Restating()  # when the loss bound is stated (its first record, then as it settles)
        self._streams = 1  # rank streams under the run root, each writing about as much as this one
        self._based_at = time.perf_counter()  # when the newest base was handed over (times the first step)
        self.kept = KeptSteps(self.storage, self.after_written, lambda: self.durable_step)  # framework saves' steps
        self.tuning = OnlineTuning(self.options)
        self.maintenance: Maintenance | None = None

    @property
    def storage_is_local(self) -> bool:
        """Whether the run root is on a local file system."""
        return bool(getattr(unwrap(self.storage), "local", False))

    def run_exists(self) -> bool:
        """Whether the run root holds a run (``run.json``), durable steps or not."""
        return self.store.is_run()

    def mark_update_start(self) -> None:
        """The gradients are final and the optimizer update begins now (for the tuner's timing of
        updates, when the framework runs forward and backward inside ``optimizer.step``)."""
        if self.capture is not None:
            self.capture.mark_update_start()

    # ------------------------------------------------------------------ training
    @property
    def started(self) -> bool:
        return self.writer is not None

    def start(self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer], step: int,
              meta: dict[str, Any] | None = None, compressor: GradientCompressor | None = None,
              gen: int | None = None, last_base: int | None = None) -> int:
        """Open a writer session continuing from ``step``; return its generation number.

        The caller writes the starting base right after (``write_base(step, ...)``), unless the
        session continues a restored step (``meta["continues"]``; ``last_base``: the base that
        step rests on, the next is counted from). With a ``compressor``, steps are recorded as its
        payloads. ``gen``: the generation taken on the run root (a rank stream, sharded).
        """
        if self.writer is not None:
            raise DiffCkptError("start() called twice; close() the running session first")
        params, meta = dict(module.named_parameters()), meta or {}
        self._skip = not_owned(meta.get("shards") or {}, meta.get("rank", 0))  # blocks a replica records
        self.capture = StepCapture(optimizers, compressor, copy_gradients=self.options.copy_gradients,
                                   skip=frozenset(id(params[n]) for n in self._skip))
        self._buffer_names = [k for k in module.state_dict() if k not in params]
        body = session_body(self.options, step, {**training_meta(module, optimizers, compressor), **meta})
        if (timing := self.tuning.restore_timing) is not None:
            body["restore_timing"] = {"base_load_s": timing[0], "replay_step_s": timing[1]}
        gen = self.kept.gen = self.stream.start_session(body, gen)
        self.module = module
        self.writer = BackgroundWriter(self.stream, gen, self.options, after=step,
                                       write_batch=self.tuning.settings.write_batch, fence=self.storage, session=body["id"])
        self.writer.before_wait = self.capture.end_leases
        if "continues" in body:  # a session after a resume (planning.py): the step is durable already
            self.writer.durable_step = step
        self._prev_step, self._last_base = step, step if last_base is None else last_base
        self.tuning.start(step, self.writer, self._base_bytes_now, self._last_base)
        self._base_nbytes, self._restating, self._based_at = 0, Restating(), time.perf_counter()
        world, run = int(meta.get("world_size", 1)), ShardedRun(self.storage)
        self._streams = world if self.stream is not self.store else 1
        o, writer, retention = self.options, self.writer, self.options.retention if self.collects_garbage else None
        if o.compact_every_n_steps is not None or retention is not None:
            # Compaction rolls this process's stream forward, replaying where training runs unless
            # told otherwise (on another device type the fingerprints recorded in training need not
            # match); retention runs over the whole root (sharded: last pass once every rank based).
            self.maintenance = Maintenance(
                self.stream.storage, lambda: (writer.durable_step, self._last_base, writer.stats.bases),
                compact_every_n_steps=o.compact_every_n_steps, retention=retention,
                device=o.compact_device or training_device(module),
                collect_from=self.storage, kept=self.kept.held,
                settled=(lambda: run.based(gen, world, self._last_base))
                if retention is not None and self.stream is not self.store else None)
        return gen

    def keep(self, step: int, why: str) -> None:
        """Keep ``step`` (recorded here) restorable whatever the retention, in later sessions too, until
        :meth:`release`: a framework's save ``why`` names it (:mod:`diffckpt.keptsteps`)."""
        self.kept.keep(step, why)

    def release(self, why: str) -> None:
        """Stop keeping the step kept for ``why``: the framework removed that save."""
        self.kept.release(why)

    def after_written(self, fn: Callable[[], Any]) -> None:
        """``fn()`` once everything queued before is durable (writer thread, in order), or now if idle."""
        self.writer.call(fn) if self.writer is not None else fn()

    def _context(self, step: int) -> StepContext:
        # A single-process loop never reviews (only CheckpointEngine.commit does): a byte-sized
        # interval is sized here. Under commit the review has sized it already, on every rank.
        self.tuning.size_bases()
        s = self.tuning.settings
        return StepContext(step, self._last_base, s.every_n_steps, s.base_every_n_steps,
                           self.options.fingerprint_every_n_steps)

    # ------------------------------------------------------------------- tuning
    @property
    def settings(self) -> Settings:
        """``every_n_steps``, ``write_batch``, ``base_every_n_steps`` in force (the tuner's if ``"auto"``)."""
        return self.tuning.settings

    def review_due(self, step: int) -> bool:
        """Whether the tuner reviews at ``step`` (on every rank alike: the writer's choice is adopted)."""
        return self.tuning.review_due(step)

    def review(self, step: int) -> Decision | None:
        """Let the auto-tuner review the measurements and apply what it decides (writer only)."""
        return self.tuning.review(step)

    def adopt(self, settings: Settings, next_review: int) -> None:
        """Take the writer's settings and its next review step (DDP ranks other than 0)."""
        self.tuning.adopt(settings, next_review)

    def measuring_state(self) -> contextlib.AbstractContextManager[None]:
        """Time the adapter's work to build a restorable step's state, for the tuner."""
        return self.tuning.measuring_state()

    def _base_bytes_now(self) -> int:
        """Bytes of model and optimizer state a base would copy now."""
        if self.module is None or self.capture is None:
            return 0
        return tree_nbytes(self.module.state_dict()) + sum(  # pieces only, when sharded
            tree_nbytes(o.state_dict()["state"]) for o in self.capture.optimizers)

    def wants_state(self, step: int) -> bool:
        """Whether ``step`` is a restorable point, so the caller should pass its state."""
        return self.policy.wants_state(self._context(step))

    def wants_base(self, step: int) -> bool:
        return self.policy.wants_base(self._context(step))

    def join(self, step: int, last_base: int | None = None) -> None:
        """Keep the clock of a process that does not write (DDP ranks other than 0) from a
        session that starts at ``step`` (``last_base``: the newest base, if not at ``step``), as
        :meth:`start` does for the writer."""
        self._prev_step, self._last_base = step, step if last_base is None else last_base
        self.tuning.join(step, self._last_base)

    def follow(self, step: int, base: bool) -> None:
        """Keep the step/base clock of a process that does not write (DDP ranks but 0) as the writer's."""
        self._prev_step = step
        self.tuning.stepped(step)
        if base:
            self._last_base = step
            self.tuning.based(step)

    def record_step(self, step: int, state: Any | None) -> None:
        """Record what the optimizer steps since the previous call consumed.

        Args:
            step: the step counter after these optimizer steps (strictly increasing).
            state: framework state at this step (loops, schedulers, RNG...), or ``None`` if this
                step is not a restorable point; cloned here.
        """
        writer, capture, module = self._require()
        if step <= self._prev_step:
            raise DiffCkptError(f"step {step} recorded after step {self._prev_step}; steps must increase")
        entered = time.perf_counter()
        copy_s, update_s = capture.copy_s, capture.update_s
        events = capture.take()
        leases = capture.take_leases()
        buffers = dict(module.named_buffers())
        names = [k for k in self._buffer_names if k in buffers]
        record: dict[str, Any] = {
            "step": step,
            "prev": self._prev_step,
            "events": events,
            "param_groups": [group_hyperparams(o) for o in capture.optimizers],
            "buffers": dict(zip(names, copy_tensors([local(buffers[k]).detach() for k in names]))),
            "state": None,
        }
        step_bytes = tree_nbytes(record)
        state_start = time.perf_counter()
        if state is not None:
            record["state"] = clone_tree(state)
        state_s = time.perf_counter() - state_start
        # Not state cost: fingerprints come every fingerprint_every_n_steps whatever the tuner picks.
        if state is not None and self.policy.wants_fingerprint(self._context(step)):
            record["fingerprint_params"] = copy_tensors(recorded_pieces(module, self._skip))
        # The step's part was counted above; add only what was attached since (no second walk).
        nbytes = step_bytes + tree_nbytes(record["state"]) + tree_nbytes(record.get("fingerprint_params", []))
        stalled = writer.stats.stall_seconds
        writer.put_record(record, nbytes, leases, HostStage.mark(record))
        if (due := self._restating.record(step - self._prev_step, nbytes, entered, self._based_at)) is not None:
            self._project(*due)
        self.tuning.stepped(step, nbytes)
        self._prev_step = step
        if self.maintenance is not None:
            self.maintenance.poke()
        self.tuning.note_record(entered, time.perf_counter(), copy_s=copy_s, update_s=update_s,
                                state_s=None if state is None else state_s,
                                stalled=writer.stats.stall_seconds - stalled, record_bytes=step_bytes)

    def write_base(self, step: int, model_state: dict[str, Any], optimizer_states: list[dict[str, Any]],
                   state: Any, codec_states: list[dict[str, torch.Tensor]] | None = None) -> None:
        """Queue a full snapshot at ``step`` (the step's record must already be recorded).

        ``codec_states`` is every rank's codec state (:meth:`GradientCompressor.state_dict`), in
        rank order, for a codec that keeps state.
        """
        writer, capture, module = self._require()
        start = time.perf_counter()
        # Sharded: this rank's pieces (the shard table places them); host parameters copied beside training
        pieces = local_tree({"model": model_state, "optimizers": optimizer_states, "state": state})
        tree, copying = snapshot_tree(without_replicas(pieces, self._skip, module, capture.optimizers),
                                      module, capture.optimizers, step)
        if codec_states and any(codec_states):
            tree["codec"] = clone_tree(list(codec_states))
        names = [n for n, _ in module.named_parameters()]
        missing = [n for n in names if n not in tree["model"]]
        if missing:
            raise DiffCkptError(f"model state for the base lacks parameters {missing[:3]}")
        stalled, params, nbytes = writer.stats.stall_seconds, [tree["model"][n] for n in names], tree_nbytes(tree)
        writer.put_base(step, tree, params, nbytes, HostStage.mark((tree, params)), copying)
        capture.wait_before_step(copying)
        if writer.journal is not None and writer.durable_step is None:
            # The session's first base, continuing no step: its journal continues nothing durable until
            # the base is, so training waits once, or a crash just after a resume loses every step since.
            writer.flush()
        self._last_base, self._base_nbytes = step, nbytes
        self.tuning.based(step, nbytes)
        done = self._based_at = time.perf_counter()
        self.tuning.note_base(done - start - (writer.stats.stall_seconds - stalled), nbytes, done)

    def _project(self, step_bytes: float, step_s: float) -> None:
        """State what each failure loses (``lossbound.py``; the metrics too) when it changed, and
        at the session's first record what the run will take on storage (``lifecycle/footprint.py``)."""
        writer, o = self.writer, self.options
        assert writer is not None
        base, sized = max(self._base_nbytes, self._base_bytes_now()), self.tuning.settings.base_every_n_steps
        every = BY_BYTES if sized is None and o.base_every_n_steps == BY_BYTES else sized  # sized after this record
        writer.state_loss(loss_bound(o, writer.journal is not None, writer.write_batch, writer.stats.durable_bps,
                                     self.stream.storage.url, step_s=step_s, record_bytes=step_bytes,
                                     base_bytes=base, base_every=every))
        if self.collects_garbage and self._restating.records == 1:
            log.info("diffckpt: %s", session_projection(o, sized, step_bytes, base, self._streams))

    def flush(self, timeout: float | None = None) -> int | None:
        """Block until everything captured is durable; return the durable step.

        Raises:
            TimeoutError: not durable within ``timeout`` seconds (writing goes on).
            StorageUnavailableError: storage is in an outage and ``on_storage_error="raise"``.
        """
        return self.writer.flush(timeout) if self.writer else None

    def check(self) -> None:
        """Raise a background error on the calling thread, if one happened."""
        self.writer.check() if self.writer else None

    @property
    def durable_step(self) -> int | None:
        """Newest step the current (or last) session made durable; still valid after :meth:`close`."""
        return self.writer.durable_step if self.writer else self._durable

    def close(self, timeout: float | None = None) -> int | None:
        """Flush, stop the writer and remove the capture hooks; return the durable step.

        A background error is raised here if it was not raised before, or again if it was; the
        session is closed either way and :attr:`durable_step` tells how far it got.

        ``timeout``: give up flushing after this many seconds, logging which steps are durable and
        which are lost (``CheckpointOptions.flush_timeout_s``); ``None`` waits as ``on_storage_error`` says.
        """
        durable = None
        try:
            if self.writer:
                durable = self.writer.close(timeout)
        finally:
            if self.maintenance is not None:
                # A normal end: a last retention pass over what is now durable. Interrupted
                # (a timeout given): no more work, and no wait for a compaction under way (it
                # commits nothing half done; what it leaves is removed as a leftover).
                self.maintenance.close(self.options.flush_timeout_s if timeout is None else 0.0,
                                       final=timeout is None)
                self.maintenance = None
            if self.capture:
                self.capture.remove()
            if self.writer:
                self._durable = self.writer.durable_step
            self.writer = self.capture = None
        return durable

    def _require(self) -> tuple[BackgroundWriter, StepCapture, torch.nn.Module]:
        if self.writer is None or self.capture is None or self.module is None:
            raise DiffCkptError("start() must be called before recording steps")
        return self.writer, self.capture, self.module

    # ------------------------------------------------------------------- restore
    def restore(self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                step: int | None = None, verify: bool = True, compressor: GradientCompressor | None = None,
                rank: int = 0, *, located: Located | None = None) -> ReplayResult:
        """Load ``step`` (``None``: newest durable) into ``module`` and ``optimizers`` by replay.

        With a ``compressor``, its codec state is restored too: rank ``rank``'s state saved with
        the base when ``step`` is a base step (exact end to end), else the state the replayed
        payloads carry (error-feedback residuals restart from zero).

        For ``None``, damage (a missing or corrupt segment, an unusable base) makes it restore the
        newest step that can still be rebuilt, with a warning; for an explicit step it raises.
        Older bases of the same session stand in for a damaged one (see
        :func:`diffckpt.planning.open_plan`). A step of sharded training is rebuilt as full tensors from
        every rank's stream and cut to what ``module`` holds here (``docs/sharded.md``).
        ``located``: where ``step`` lies if the caller located it (:func:`diffckpt.locate.locate`).

        Raises:
            CheckpointNotFoundError: nothing durable under the run root, or ``step`` is not durable.
            CorruptRecordError: an explicit step cannot be rebuilt, or no base can be loaded.
            IncompatibleCheckpointError: the checkpoint was written for another model or optimizer;
                ``module`` and ``optimizers`` are then left untouched.
            ReplayMismatchError: replay diverged from the fingerprints recorded in training;
                ``module`` and ``optimizers`` are then partly replayed and must not be used.
        """
        if located is None:  # what a crashed session journaled on this node counts too
            merge_for_rank(self.storage, self.options.local_dir, rank)
        loc = located if located is not None else locate(self.storage, step)
        with self.capture.paused() if self.capture else contextlib.nullcontext():
            result, timing = restore_live(loc, module, optimizers, verify=verify, compressor=compressor, rank=rank)
        if timing is not None:
            self.tuning.note_restore(*timing)
        return result
