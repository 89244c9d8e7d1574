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
sharded training) and does every exchange between ranks itself through its
:class:`~diffckpt.collective.Collective` (:mod:`diffckpt.coordination`): gathering each rank's RNG
and data position at restorable steps and its codec state at bases (DDP), sending rank 0's tuning
decisions, and agreeing on the step to restore (:mod:`diffckpt.resumption`). What is framework-specific reaches it through a
:class:`FrameworkState`, which it asks only when a step is restorable. The single-writer calls it
is built on (:class:`~diffckpt.recorder.Recorder`: ``start``, ``record_step``, ``write_base``,
``close``, ``restore``) remain available for a single-process loop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .codecs.compressor import GradientCompressor
from .collective import Collective
from .errors import DiffCkptError, UnsupportedConfigurationError
from .metrics import CheckpointMetrics
from .options import CheckpointOptions
from .resumption import Resuming
from .shardedrun import ShardedRun
from .sharding import check_elementwise, is_sharded, refuse_flat_parameters, shard_table
from .storage import Storage
from .tuning.model import AUTO, tuning_metrics

__all__ = ["CheckpointEngine", "Committed", "FrameworkState"]

log = logging.getLogger("diffckpt")


class FrameworkState(Protocol):
    """What a framework adds to a restorable step, built only when the engine asks for it."""

    def rank_state(self) -> Any:
        """This process's own part: its RNG states and data position (called on every rank)."""

    def state(self, ranks: list[Any]) -> Any:
        """The step's framework state (loops, schedulers, scaler...), holding ``ranks``, every
        rank's :meth:`rank_state` in rank order (called on the process that writes)."""


@dataclass(frozen=True)
class Committed:
    """What :meth:`CheckpointEngine.commit` did with a step."""

    step: int
    restorable: bool  # recorded with its state: a step training can resume from
    base: bool  # a full base was written at it
    tuning: dict[str, float] = field(default_factory=dict)  # a tuner decision's metrics, to log


@dataclass
class _Clock:
    """The steps a coordinated session has reached, the same on every rank."""

    recorded: int = -1
    restorable: int = -1
    base: int = -1

    def at(self, step: int, restorable: bool, base: bool) -> None:
        self.recorded = step
        if restorable:
            self.restorable = step
        if base:
            self.base = step


class CheckpointEngine(Resuming):
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
        super().__init__(dirpath, options, storage_options, collective=collective)
        self._compressor: GradientCompressor | None = None
        self._clock: _Clock | None = None  # kept after end(): what the last session reached
        self._open = False  # between begin() and end()
        self._waiting: list[tuple[int, Callable[[], Any], str]] = []  # when_restorable() until a commit
        self._sharded = False  # the session records sharded parameters: every rank writes its stream

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

        The writing process opens a session and writes its starting base: the state
        :meth:`resume` restored when ``step`` is the restored step, else ``source``'s. ``meta``
        goes into the session record (framework, strategy...). Training that did not
        :meth:`resume` from a run root holding durable steps gets a warning on rank 0 naming
        them, with ``resume_hint`` (the framework's way to resume) as its advice.
        """
        if self._open:
            raise DiffCkptError("begin() called twice; end() the running session first")
        restored = self._restored if self._restored is not None and self._restored[0] == step else None
        self._restored = None
        refuse_flat_parameters(module)
        sharded = self._sharded = is_sharded(module)
        table = self._check_sharded(module, optimizers, compressor) if sharded else None
        ranks = None if restored is not None else self._rank_states(source)
        codec_states = self._gather_codec_states(compressor)
        self._compressor = compressor
        self._clock, self._open = _Clock(step, step, step), True
        if restored is None and self.is_main_process:
            self._warn_used_root(step, resume_hint)
        if not self._writes():
            self.join(step)
            return
        meta = {"torch": torch.__version__, "world_size": self.world_size, **(meta or {})}
        gen = None
        self.stream, self.collects_garbage = self.store, True  # an earlier sharded session's are gone
        if table is not None:  # every rank writes its own stream, in the session the root names
            gen = self._claim_sharded_session(meta, step)
            self.stream = ShardedRun(self.storage).stream(self.rank)
            self.collects_garbage = self.is_main_process
            meta = dict(meta, rank=self.rank, shards=table)
        self.start(module, optimizers, step, meta=meta, compressor=compressor, gen=gen)
        state = restored[1] if restored is not None else source.state(ranks or [])
        self._base_now(step, state, codec_states)

    def commit(self, step: int, source: FrameworkState, *, force_state: bool = False,
               force_base: bool = False) -> Committed:
        """Record the optimizer steps up to ``step`` (every rank calls, at the same steps).

        Reviews the tuner's settings when due, asks ``source`` for the state when the step is
        restorable (or ``force_state``), and writes a base when one is due (or ``force_base``).
        """
        clock = self._require_clock()
        if step <= clock.recorded:
            raise DiffCkptError(f"step {step} committed after step {clock.recorded}; steps must increase")
        tuning = self._review_everywhere(step) if self.review_due(step) else {}
        base = force_base or self.wants_base(step)
        restorable = force_state or base or self.wants_state(step)
        with self.measuring_state():
            ranks = self._rank_states(source) if restorable else None
            codec_states = self._gather_codec_states(self._compressor) if base else None
            state = source.state(ranks or []) if restorable and self._writes() else None
        clock.at(step, restorable, base)
        if not self._writes():
            self.follow(step, base)
            return Committed(step, restorable, base, tuning)
        self.record_step(step, state)
        if base:
            self._base_now(step, state, codec_states)
        waiting, self._waiting = self._waiting, []
        for saved, fn, name in waiting:
            if saved == step and not restorable:
                raise DiffCkptError(
                    f"a checkpoint was saved at step {step} ({name}), which is not a restorable step "
                    f"with every_n_steps={self._every_n()}; save checkpoints only at multiples of "
                    "every_n_steps")
            self._after_durable_data(saved, fn, name)
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
        with self.measuring_state():
            ranks = self._rank_states(source)
            codec_states = self._gather_codec_states(self._compressor)
        clock.at(step, True, True)
        if not self._writes():
            self.follow(step, True)
            return
        self._base_now(step, source.state(ranks or []), codec_states)

    def end(self, reason: str = "end of training", timeout: float | None = None) -> int | None:
        """Flush and close the session; return the durable step (any rank may call, alone).

        The writing process logs how far durability got, as a warning when ``timeout`` bounds
        the flush (an interrupted run).
        """
        self._open, self._compressor = False, None
        started = self.started
        durable = self.close(timeout) if started else self.durable_step
        if started:
            (log.info if timeout is None else log.warning)("diffckpt: %s; durable up to step %s in %s",
                                                           reason, durable, self.storage.url)
        waiting, self._waiting = self._waiting, []
        for saved, fn, name in waiting:
            if started and durable is not None and saved <= durable:
                fn()
            else:
                log.warning("diffckpt: %s was not written: step %d %s", name, saved,
                            "never became durable" if started else "was never recorded (save while training)")
        return durable

    def metrics(self) -> dict[str, float]:
        """The open session's ``diffckpt/*`` metrics for loggers (:mod:`diffckpt.metrics`) on a
        process that writes; empty on the others and outside a session."""
        if self.writer is None or self._clock is None:
            return {}
        return CheckpointMetrics.of(self.writer, self._clock.recorded).as_dict()

    def _warn_used_root(self, step: int, hint: str | None) -> None:
        """Warn that a fresh session starts on a run root whose durable steps it does not continue:
        ``"last"`` follows the new session from now on, and a job still writing there is fenced."""
        inv = self.store.inventory()
        newest = {g: s for g in inv.gens() if (s := inv.newest_step(g)) is not None}
        try:  # sharded sessions keep their steps in rank streams, not at the root
            sharded = ShardedRun(self.storage).resolve(None)
        except DiffCkptError:  # none, or damaged: the warning names what it can read
            sharded = None
        if sharded is not None:
            newest[sharded.gen] = max(sharded.step, newest.get(sharded.gen, sharded.step))
        if not newest:
            return
        sessions = ", ".join(f"g{g} (newest durable step {s})" for g, s in sorted(newest.items()))
        warnings.warn(
            f"diffckpt: {self.storage.url} already holds a run: session{'s' if len(newest) > 1 else ''} "
            f"{sessions}. This training starts a new session at step {step} without resuming it; "
            "\"last\" will follow the new session, and a job still writing there stops (fenced). "
            f"To continue the run instead, {hint or 'resume from it'}; to keep both, give this job "
            "its own dirpath", UserWarning, stacklevel=2)

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
        if not self.is_main_process:
            return
        if wait or step > self.recorded_step:
            self._waiting.append((step, fn, name))
            return
        if step > self.restorable_step:
            raise DiffCkptError(
                f"cannot save {name}: step {step} is not a restorable step with every_n_steps="
                f"{self._every_n()}; save checkpoints only at multiples of every_n_steps")
        self._after_durable_data(step, fn, name)

    def _after_durable_data(self, step: int, fn: Callable[[], Any], name: str) -> None:
        if not self.started:
            durable = self.durable_step
            if durable is None or step > durable:
                raise DiffCkptError(f"cannot save {name}: step {step} is not durable in {self.storage.url} "
                                    f"(durable up to {durable}); save while checkpointing runs")
        self.after_queued(fn)

    def _every_n(self) -> str:
        n = self.settings.every_n_steps
        if self.options.every_n_steps == AUTO:
            return (f"'auto' (now {n}; with checkpoints saved at fixed steps, give every_n_steps a "
                    "divisor of their interval instead of 'auto')")
        return str(n)

    def after_queued(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` on the main process once everything recorded before is written (on the
        writer thread, in order), or at once when no session is open; other ranks skip it."""
        if not self.is_main_process:
            return
        if self.writer is not None:
            self.writer.call(fn)
        else:
            fn()

    # ------------------------------------------------------------------ internals
    def _writes(self) -> bool:
        """Whether this process records: rank 0 of data-parallel training (every rank applied
        what it recorded), every rank of sharded training (each holds other pieces)."""
        return self._sharded or self.is_main_process

    def _rank_states(self, source: FrameworkState) -> list[Any] | None:
        """Every rank's :meth:`FrameworkState.rank_state`, where the state is recorded: gathered
        on rank 0 of data-parallel training; under sharded training each rank records its own,
        in its place of a per-rank list, with no exchange."""
        if not self._sharded:
            return self.collective.gather(source.rank_state())
        ranks: list[Any] = [None] * self.world_size
        ranks[self.rank] = source.rank_state()
        return ranks

    def _check_sharded(self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                       compressor: GradientCompressor | None) -> dict[str, Any]:
        if compressor is not None:
            raise UnsupportedConfigurationError(
                "compressed training (codec=) is not supported with sharded parameters: a codec decoded per "
                "shard cannot see the global gradient, and FSDP2 has no communication hook for it. Train "
                "without a codec (diffckpt then records each rank's exact gradient pieces)")
        check_elementwise(optimizers)
        return shard_table(module)

    def _claim_sharded_session(self, meta: dict[str, Any], step: int) -> int:
        """Rank 0 opens the session on the run root, naming the world size; every rank gets its
        generation (or rank 0's error)."""
        coll = self.collective
        if self.is_main_process:
            try:
                body = {"options": dataclasses.asdict(self.options), "host": socket.gethostname(),
                        "pid": os.getpid(), "resumed_from": step,
                        "sharded": {"world_size": self.world_size, "streams": "ranks/r<rank:05d>/"}, **meta}
                gen = self.store.start_session(body)
            except BaseException as exc:
                if coll.world_size > 1:
                    coll.broadcast(("error", f"{type(exc).__name__}: {exc}"))
                raise
            if coll.world_size > 1:
                coll.broadcast(("gen", gen))
            return gen
        kind, value = coll.broadcast(None)
        if kind == "error":
            raise DiffCkptError(f"opening the session failed on process 0 ({value})")
        return int(value)

    def _require_clock(self) -> _Clock:
        if not self._open or self._clock is None:
            raise DiffCkptError("begin() must be called before commit() or make_restorable()")
        return self._clock

    def _gather_codec_states(self, compressor: GradientCompressor | None) -> list[Any] | None:
        """Every rank's codec state (error-feedback residuals differ per rank), on rank 0."""
        return None if compressor is None else self.collective.gather(compressor.state_dict())

    def _base_now(self, step: int, state: Any, codec_states: list[Any] | None) -> None:
        _, capture, module = self._require()
        self.write_base(step, module.state_dict(), [o.state_dict() for o in capture.optimizers], state,
                        codec_states)

    def _review_everywhere(self, step: int) -> dict[str, float]:
        """Rank 0's tuner reviews the settings (under sharded training from every rank's
        measurements, as the slowest writer); every rank adopts what it chose."""
        measured = self.collective.gather(self.tuning.measure(step)) if self._sharded and self.world_size > 1 else None
        decision = self.tuning.review(step, measured) if self.is_main_process else None
        if self.world_size > 1:
            settings, next_review = self.collective.broadcast((self.settings, self.tuning.next_review))
            if not self.is_main_process:
                self.adopt(settings, next_review)
        if decision is None or self.tuning.last_review is None:
            return {}
        return tuning_metrics(*self.tuning.last_review)
