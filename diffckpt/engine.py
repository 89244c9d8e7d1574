"""The engine: checkpointing a training job of one or many processes, and who writes.

An adapter (Lightning, Accelerate, a plain loop under ``torch.distributed``) calls these
:class:`CheckpointEngine` methods on *every* process, at the same points of training:

- :meth:`~CheckpointEngine.resume` to restore, before training,
- :meth:`~CheckpointEngine.begin` when training starts,
- :meth:`~CheckpointEngine.commit` once per optimizer step, once everything the step changes has
  changed (the scheduler stepped, evaluation ran),
- :meth:`~CheckpointEngine.make_restorable` when the current step must become restorable now
  (a framework's own save, the end of training),
- :meth:`~CheckpointEngine.end` when training stops.

The engine decides which processes write (rank 0 under DDP, every rank its own stream under
sharded training); every exchange between ranks goes through its
:class:`~diffckpt.coordination.Coordination`; framework-specific state comes through a
:class:`FrameworkState`, asked only when a step is restorable. It holds :attr:`~CheckpointEngine.recorder`
(the writing session), a ``Coordination`` and a :class:`~diffckpt.resumption.Resumption`; the
recorder's single-writer calls stay on the engine for a single-process loop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, Literal

import torch

from .codecs.compressor import GradientCompressor
from .collective import Collective
from .coordination import Coordination
from .errors import DiffCkptError
from .metrics import CheckpointMetrics
from .options import CheckpointOptions
from .recorder import Recorder
from .replay import ReplayResult
from .resumption import Resumption
from .session import Clock, Committed, FrameworkSaves, FrameworkState, after_queued
from .sessionfile import open_sharded_session
from .sharding import check_sharded, is_sharded, refuse_flat_parameters
from .storage import Storage
from .tuning.model import Settings

__all__ = ["CheckpointEngine", "Committed", "FrameworkState"]

log = logging.getLogger("diffckpt")


class CheckpointEngine:
    """Differential checkpointing of one model and its optimizers into one run root.

    Args:
        dirpath: local path, fsspec URL (``memory://``, ``s3://``, ...) or a :class:`Storage`.
        options: capture, batching and base settings.
        storage_options: passed to fsspec (credentials, endpoint, ...).
        collective: the processes training together; ``None``: the default ``torch.distributed``
            process group when there is one, else this process alone.
    """

    def __init__(self, dirpath: str | os.PathLike[str] | Storage, options: CheckpointOptions | None = None,
                 storage_options: dict[str, Any] | None = None, *, collective: Collective | None = None) -> None:
        self.recorder = Recorder(dirpath, options, storage_options)
        self._coord = Coordination(collective)
        self._resumption = Resumption(self._coord)
        self._restored: tuple[int, Any, tuple[int, int, int] | None] | None = None  # resume()'s step, state, link
        self._compressor: GradientCompressor | None = None
        self._clock: Clock | None = None  # kept after end(): what the last session reached
        self._open = False  # between begin() and end()
        self._saves = FrameworkSaves(self.recorder)  # when_restorable()
        # sharded: this rank's shard table (sessionfile.open_sharded_session); every rank writes its stream
        self._shards: dict[str, Any] | None = None

    # ------------------------------------------------------------ the run root
    @property
    def options(self) -> CheckpointOptions:
        return self.recorder.options

    @property
    def storage(self) -> Storage:
        return self.recorder.storage

    @property
    def storage_options(self) -> dict[str, Any]:
        return self.recorder.storage_options

    @property
    def storage_is_local(self) -> bool:
        """Whether the run root is on a local file system."""
        return self.recorder.storage_is_local

    def run_exists(self) -> bool:
        """Whether the run root holds a run (``run.json``), durable steps or not."""
        return self.recorder.run_exists()

    # ---------------------------------------------------------------- processes
    @property
    def collective(self) -> Collective:
        """The processes training together: the one given, else the default process group (at each use)."""
        return self._coord.collective

    @property
    def rank(self) -> int:
        return self._coord.rank

    @property
    def world_size(self) -> int:
        return self._coord.world_size

    @property
    def is_main_process(self) -> bool:
        """Whether this process writes what exists once per run (sessions, references)."""
        return self._coord.is_main_process

    def agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any process (every rank calls): a stop one rank received, say."""
        return self._coord.agree(flag)

    def own(self, ranks: list[Any]) -> Any:
        """This rank's entry of a per-rank list recorded at a step (see ``Coordination.own``)."""
        return self._coord.own(ranks)

    # ---------------------------------------------------------------- restoring
    def resume(self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
               step: int | Literal["last"] | None = None, *, dirpath: str | None = None,
               compressor: GradientCompressor | None = None, missing_ok: bool = False) -> ReplayResult | None:
        """Restore ``step`` (``"last"``/``None``: the newest durable one) on every rank (all call).

        Rank 0 locates the step, falling back over damage for ``None``, and every rank replays
        that same step onto its ``module`` and ``optimizers``; with a ``compressor``, each rank
        gets its own codec state. ``dirpath`` restores from another run root. With
        ``missing_ok``, ``None`` is returned when ``step`` is ``None`` and nothing is durable yet;
        a later :meth:`begin` at the restored step continues it.

        Raises:
            the errors of :meth:`restore`, on rank 0; the other ranks raise
            :class:`DiffCkptError` saying that rank 0 failed.
        """
        if step == "last":
            step = None
        elif step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise ValueError(f"step must be None, 'last' or a step number, got {step!r}")
        refuse_flat_parameters(module)
        recorder = self.recorder
        if dirpath is not None and str(dirpath).rstrip("/") != self.storage.url.rstrip("/"):
            recorder = Recorder(dirpath, storage_options=self.storage_options)
        result = self._resumption.resume(recorder, module, optimizers, step, compressor, missing_ok)
        if result is not None:  # a session begun at it continues it: in this run root, without a codec
            link = result.continues if recorder is self.recorder and result.codec_config is None else None
            self._restored = (result.step, result.state, link)
        return result

    def newest_step(self) -> int | None:
        """The step :meth:`resume` restores when given none, as a listing shows it: the newest durable
        step (on every rank, sharded), or ``None`` (every rank calls; rank 0 lists, the others ask it).

        Damage inside an object is found only when it is read, by :meth:`resume`. What this
        node's local tier holds of a crashed session is committed to the run root first, as by
        :meth:`resume`, so it counts.
        """
        return self._resumption.newest_step(self.recorder)

    def restore(self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                step: int | None = None, verify: bool = True, compressor: GradientCompressor | None = None,
                rank: int = 0) -> ReplayResult:
        """Load ``step`` (``None``: newest durable) into ``module`` and ``optimizers`` by replay,
        in this process alone (every process of a job calls :meth:`resume` instead); see
        :meth:`diffckpt.recorder.Recorder.restore` for the details and errors."""
        return self.recorder.restore(module, optimizers, step, verify, compressor, rank)

    # ------------------------------------------------- a single-process session
    def start(self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer], step: int,
              meta: dict[str, Any] | None = None, compressor: GradientCompressor | None = None) -> int:
        """Open a writer session in this process alone (a hand-written single-process loop;
        adapters call :meth:`begin` on every process); see :meth:`Recorder.start`."""
        return self.recorder.start(module, optimizers, step, meta=meta, compressor=compressor)

    def record_step(self, step: int, state: Any | None) -> None:
        """Record the optimizer steps since the previous call; see :meth:`Recorder.record_step`."""
        self.recorder.record_step(step, state)

    def write_base(self, step: int, model_state: dict[str, Any], optimizer_states: list[dict[str, Any]],
                   state: Any, codec_states: list[dict[str, torch.Tensor]] | None = None) -> None:
        """Queue a full snapshot at ``step``; see :meth:`Recorder.write_base`."""
        self.recorder.write_base(step, model_state, optimizer_states, state, codec_states)

    def wants_state(self, step: int) -> bool:
        """Whether ``step`` is a restorable point, so a single-process loop passes its state."""
        return self.recorder.wants_state(step)

    def wants_base(self, step: int) -> bool:
        """Whether a single-process loop writes a base at ``step``."""
        return self.recorder.wants_base(step)

    def flush(self, timeout: float | None = None) -> int | None:
        """Block until everything captured is durable; return the durable step."""
        return self.recorder.flush(timeout)

    def close(self, timeout: float | None = None) -> int | None:
        """Flush, stop the writer and remove the capture hooks; return the durable step."""
        return self.recorder.close(timeout)

    def check(self) -> None:
        """Raise a background error on the calling thread, if one happened."""
        self.recorder.check()

    def mark_update_start(self) -> None:
        """The gradients are final and the optimizer update begins now (for the tuner's timing)."""
        self.recorder.mark_update_start()

    @property
    def started(self) -> bool:
        """Whether this process has a writer session open."""
        return self.recorder.started

    @property
    def durable_step(self) -> int | None:
        """Newest step this process's current (or last) session made durable."""
        return self.recorder.durable_step

    @property
    def settings(self) -> Settings:
        """``every_n_steps``, ``write_batch`` and ``base_every_n_steps`` in force."""
        return self.recorder.settings

    @property
    def recorded_step(self) -> int:
        """The newest step :meth:`commit` recorded in this session (-1 before :meth:`begin`)."""
        return -1 if self._clock is None else self._clock.recorded

    @property
    def restorable_step(self) -> int:
        """The newest step of this session recorded with its state (-1 before :meth:`begin`)."""
        return -1 if self._clock is None else self._clock.restorable

    # ------------------------------------------------------------------ training
    def begin(self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
              step: int, source: FrameworkState, *, meta: dict[str, Any] | None = None,
              compressor: GradientCompressor | None = None, resume_hint: str | None = None) -> None:
        """Start checkpointing training that continues from ``step`` (every rank calls).

        The writing process opens a session. At the step :meth:`resume` restored from this run
        root, it continues that step and writes no base (unless sharded or compressed): its first
        base is due as the run's next, counted from the restored step's base (``planning.py``).
        Else it writes a starting base, of the state restored or ``source``'s. ``meta`` goes into
        the session record (framework, strategy...). Training that did not :meth:`resume` from a
        run root with durable steps gets a warning on rank 0 naming them, ``resume_hint`` (the
        framework's way to resume) as its advice.
        """
        if self._open:
            raise DiffCkptError("begin() called twice; end() the running session first")
        restored = self._restored if self._restored is not None and self._restored[0] == step else None
        self._restored = None
        refuse_flat_parameters(module)
        self._shards = table = check_sharded(module, optimizers, compressor) if is_sharded(module) else None
        ranks = None if restored is not None else self._coord.rank_states(source, self._shards is not None)
        codec_states, self._compressor = self._coord.codec_states(compressor), compressor
        link = restored[2] if restored is not None and table is None and compressor is None else None
        last_base = link[2] if link else step
        self._clock, self._open = Clock(step, step, last_base), True
        if restored is None and self.is_main_process:
            self._resumption.warn_used_root(self.recorder, step, resume_hint)
        if not self._writes():
            self.recorder.join(step, last_base)
            return
        meta = {"torch": torch.__version__, "world_size": self.world_size, **(meta or {}),
                **({"continues": {"gen": link[0], "step": link[1]}} if link else {})}
        gen, rec = None, self.recorder
        rec.stream, rec.collects_garbage = rec.store, True  # an earlier sharded session's are gone
        if table is not None:  # every rank writes its own stream, in the session the root names
            gen, meta = open_sharded_session(self._coord, rec, meta, step, table)
            self._shards = meta["shards"]
        rec.start(module, optimizers, step, meta=meta, compressor=compressor, gen=gen, last_base=last_base)
        if link is None:
            self._base_now(step, restored[1] if restored is not None else source.state(ranks or []), codec_states)

    def commit(self, step: int, source: FrameworkState, *, force_state: bool = False,
               force_base: bool = False) -> Committed:
        """Record the optimizer steps up to ``step`` (every rank calls, at the same steps).

        Reviews the tuner's settings when due, asks ``source`` for the state when the step is
        restorable (or ``force_state``), and writes a base when one is due (or ``force_base``).
        """
        clock = self._require_clock()
        if step <= clock.recorded:
            raise DiffCkptError(f"step {step} committed after step {clock.recorded}; steps must increase")
        rec = self.recorder
        spacing = rec.settings.every_n_steps
        tuning = self._coord.review(rec.tuning, step, self._shards is not None) if rec.review_due(step) else {}
        base = force_base or rec.wants_base(step)
        # a new spacing of restorable points starts from one: no crash loses more than it states
        restorable = force_state or base or rec.settings.every_n_steps != spacing or rec.wants_state(step)
        with rec.measuring_state():
            ranks = self._coord.rank_states(source, self._shards is not None) if restorable else None
            codec_states = self._coord.codec_states(self._compressor) if base else None
            state = source.state(ranks or []) if restorable and self._writes() else None
        clock.at(step, restorable, base)
        if not self._writes():
            rec.follow(step, base)
            return Committed(step, restorable, base, tuning)
        rec.record_step(step, state)
        if base:
            self._base_now(step, state, codec_states)
        self._saves.committed(step, restorable)
        return Committed(step, restorable, base, tuning)

    def make_restorable(self, step: int, source: FrameworkState, *, base: bool = False) -> None:
        """Make ``step`` restorable now, and a base if ``base`` (every rank calls).

        An uncommitted step is committed with its state; a step committed without state (with
        ``every_n_steps`` above 1) gets a base, which carries the state.
        """
        clock = self._require_clock()
        if step > clock.recorded:
            self.commit(step, source, force_state=True, force_base=base)
            return
        if clock.restorable == step and (not base or clock.base == step):
            return
        with self.recorder.measuring_state():
            ranks = self._coord.rank_states(source, self._shards is not None)
            codec_states = self._coord.codec_states(self._compressor)
        clock.at(step, True, True)
        if not self._writes():
            self.recorder.follow(step, True)
            return
        self._base_now(step, source.state(ranks or []), codec_states)

    def end(self, reason: str = "end of training", timeout: float | None = None) -> int | None:
        """Flush and close the session; return the durable step (any rank may call, alone).

        The writing process logs how far durability got, as a warning when ``timeout`` bounds
        the flush (an interrupted run).
        """
        self._open, self._compressor, started = False, None, self.started
        durable = self.close(timeout) if started else self.durable_step
        if started:
            (log.info if timeout is None else log.warning)("diffckpt: %s; durable up to step %s in %s",
                                                           reason, durable, self.storage.url)
        self._saves.ended(started, durable)
        return durable

    def metrics(self) -> dict[str, float]:
        """The open session's ``diffckpt/*`` metrics for loggers (:mod:`diffckpt.metrics`) on a
        process that writes; empty on the others and outside a session."""
        writer, clock = self.recorder.writer, self._clock
        return {} if writer is None or clock is None else CheckpointMetrics.of(writer, clock.recorded).as_dict()

    # ---------------------------------------------------------- framework saves
    def when_restorable(self, step: int, fn: Callable[[], Any], *, name: str, wait: bool = False) -> None:
        """Run ``fn()`` for a framework's save of ``step`` under ``name`` (a reference file...):
        on the main process, in order after the step's own data, and only for a step training
        can resume from. Other ranks skip it.

        A step not committed yet (or ``wait``: the framework saved the current step before the
        adapter committed it) waits for its commit; at :meth:`end`, what still waits runs if its
        step became durable, else it is dropped with a warning.

        Raises:
            DiffCkptError: ``step`` was committed without its state (``every_n_steps`` above
                1), or no session is open and ``step`` is not durable.
        """
        if self.is_main_process:
            self._saves.add(step, fn, name, wait=wait, recorded=self.recorded_step,
                            restorable=self.restorable_step)

    def keep(self, step: int, why: str) -> None:
        """Keep ``step`` restorable whatever the retention, in later sessions too, until :meth:`release`
        (a save ``why`` outside :meth:`when_restorable`, which keeps its steps already). Main process."""
        if self.is_main_process:
            self.recorder.keep(step, why)

    def release(self, why: str) -> None:
        """Stop keeping the step kept for ``why`` (its save was removed). Main process."""
        if self.is_main_process:
            self.recorder.release(why)

    after_queued = after_queued  # deprecated: when_removed (a removal), when_restorable (a save)

    def when_removed(self, fn: Callable[[], Any], *, name: str) -> None:
        """Run ``fn()``, removing the save ``name``, after what is queued (main process); its keep ends."""
        if self.is_main_process:
            self._saves.removed(fn, name)

    # ------------------------------------------------------------------ internals
    def _writes(self) -> bool:
        """Whether this process records: DDP's rank 0 (all apply alike), every rank when sharded."""
        return self._shards is not None or self.is_main_process

    def _require_clock(self) -> Clock:
        if not self._open or self._clock is None:
            raise DiffCkptError("begin() must be called before commit() or make_restorable()")
        return self._clock

    def _base_now(self, step: int, state: Any, codec_states: list[Any] | None) -> None:
        _, capture, module = self.recorder._require()
        if self._shards is not None:  # a replicated block is in one rank's base only: its replicas must agree
            self._coord.check_replicas(module, self._shards)
        self.recorder.write_base(step, module.state_dict(), [o.state_dict() for o in capture.optimizers], state,
                                 codec_states)
