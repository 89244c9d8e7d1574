"""Auto-tuning inside a running engine: the settings in force, what is measured, the reviews.

:class:`OnlineTuning` is what a :class:`~diffckpt.CheckpointEngine` keeps for its
``every_n_steps``, ``write_batch`` and ``base_every_n_steps``. With no knob on ``"auto"`` it only
holds the fixed settings. Otherwise it feeds a :class:`~diffckpt.tuning.meter.Meter` from the
engine's timings, asks the pure :class:`~diffckpt.tuning.model.AutoTuner` at review steps, applies and
records what it decides. The engine calls it; adapters reach it through the engine.

``base_every_n_steps="bytes"`` is sized here too, as a review: right after each base (at the first
commit once a step has been recorded since it), the process that records turns the bytes it
handed to the writer into a step interval (:func:`~diffckpt.policies.bytes_interval`), and every
other rank adopts it with the tuner's settings. A step count fixed at agreed steps, not a running
byte total, because only the recording process knows the bytes, and every rank must write bases
(and gather their states) at the same steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import StorageError
from ..options import BY_BYTES, DEFAULT_EVERY_N_STEPS, DEFAULT_WRITE_BATCH, CheckpointOptions
from ..policies import bytes_interval
from ..runstore import tuning_path
from ..writer import BackgroundWriter
from .meter import Meter
from .model import AUTO, AutoTuner, Decision, Measurements, Settings, describe
from .probe import probe_storage
from .risk import risk, say_risk

__all__ = ["AUTO_START_BASE_EVERY_N_STEPS", "REVIEW_BUDGET", "WARMUP_STEPS", "OnlineTuning"]

log = logging.getLogger("diffckpt")
WARMUP_STEPS = 10  # the tuner's first review comes this many steps into a session
# base_every_n_steps="auto" until the first review: far enough that no base comes before it.
AUTO_START_BASE_EVERY_N_STEPS = 500
REVIEW_BUDGET = 0.001  # the tuner's reviews may take at most this share of training time


class OnlineTuning:
    """The settings in force and, for ``"auto"`` knobs, the measurements and the reviews."""

    def __init__(self, options: CheckpointOptions) -> None:
        o = self.options = options
        b = o.base_every_n_steps
        # base_every_n_steps="bytes": the diff bytes between bases, as a multiple of a base's size.
        self.base_ratio = o.base_every_diff_bytes_ratio if b == BY_BYTES else None
        base = b if isinstance(b, int) else AUTO_START_BASE_EVERY_N_STEPS if b == AUTO else None
        self.settings = Settings(
            # "auto" starts from the defaults until the first review decides
            every_n_steps=DEFAULT_EVERY_N_STEPS if o.every_n_steps == AUTO else int(o.every_n_steps),
            write_batch=DEFAULT_WRITE_BATCH if o.write_batch == AUTO else int(o.write_batch),
            # "bytes": no periodic base until the interval is sized (see size_bases)
            base_every_n_steps=base)
        # A byte-sized interval is a fixed knob to the tuner, at the value sized last.
        fixed_base = base if b == BY_BYTES else b
        self.tuner = AutoTuner(o.tuning, o.every_n_steps, o.write_batch, fixed_base) if o.auto else None
        self.meter: Meter | None = None
        self.decisions: list[dict[str, Any]] = []  # the changes of the current session
        self.last_review: tuple[Decision, Measurements] | None = None
        self.restore_timing: tuple[float, float | None] | None = None  # (base load s, replay s/step)
        self._writer: BackgroundWriter | None = None
        self._base_bytes: Callable[[], int] | None = None
        self._tuned = False
        self._next_review = 0
        self._session_start = 0
        self._mark: float | None = None  # end of the previous checkpoint call on the training thread
        self._state_s = 0.0  # adapter time spent building state since the previous record
        self._aside_s = 0.0  # other checkpoint work since the previous record (reviews)
        # The step clock every rank keeps alike (the newest committed step and base), and what
        # the recording process handed to its writer this session: base_every_n_steps="bytes".
        self._last_step = self._base_step = 0
        self._sized_for: int | None = None  # the base whose interval was sized
        self._recorded_bytes = self._recorded_steps = self._newest_base_bytes = 0

    # ------------------------------------------------------------------ session
    def start(self, step: int, writer: BackgroundWriter, base_bytes: Callable[[], int],
              base_step: int | None = None) -> None:
        """A writer session starts at ``step`` (``base_step``: the newest base, which a session
        that continues a restored step did not write); ``base_bytes()`` says what a base would
        hold now."""
        self._writer, self._base_bytes = writer, base_bytes
        self.join(step, base_step)
        self._mark, self._state_s, self._aside_s = None, 0.0, 0.0
        self.decisions, self._tuned = [], False
        if self.tuner is None:
            return
        # The writer times its writes; with a journal a crash resumes from its restorable steps.
        meter = self.meter = writer.meter = Meter(self.options.max_pending_bytes, local_tier=writer.journal is not None)
        if base_step is not None and base_step < step:  # no base written yet: its size is known, its write times come with it
            meter.base_bytes.value = float(base_bytes())
        if self.restore_timing is not None:
            meter.add_restore(*self.restore_timing)
        storage = writer.storage

        def probe() -> None:  # on the writer thread, before the first segment
            try:
                meter.add_probe(probe_storage(storage, repeats=1, on_sample=meter.add_write))
            except (StorageError, OSError) as exc:  # the writes that follow will say more
                log.warning("diffckpt: could not probe %s for the auto-tuner (%s); it measures the "
                            "checkpoint writes instead", writer.store.storage.url, exc)

        writer.call(probe)

    def join(self, step: int, base_step: int | None = None) -> None:
        """Keep the review clock from a session that starts at ``step`` (every DDP rank);
        ``base_step``: the newest base, when the session does not write one at ``step``."""
        self._session_start = step
        self._next_review = step + WARMUP_STEPS
        self._last_step, self._base_step = step, step if base_step is None else base_step
        self._sized_for = None
        self._recorded_bytes = self._recorded_steps = self._newest_base_bytes = 0
        if self.base_ratio is not None:  # sized again from this session's records
            self._fix_base(None)

    # ------------------------------------------------------- the step clock, bytes
    def stepped(self, step: int, nbytes: int = 0) -> None:
        """``step`` was committed: recorded here with ``nbytes`` handed to the writer, or (0)
        followed by a process that does not record."""
        self._recorded_bytes += nbytes
        self._recorded_steps += step - self._last_step
        self._last_step = step

    def based(self, step: int, nbytes: int = 0) -> None:
        """A base was written at ``step`` (every rank; ``nbytes``: its bytes, where recorded)."""
        self._base_step = step
        if nbytes:
            self._newest_base_bytes = nbytes

    @property
    def sizing_due(self) -> bool:
        """Whether ``base_every_n_steps="bytes"`` is to be sized now: a step has been recorded
        since the newest base and in this session (whose records size it), and that base's
        interval is not sized yet. A function of the steps committed and the bases written, so
        every rank agrees."""
        return (self.base_ratio is not None and self._sized_for != self._base_step
                and self._last_step > max(self._base_step, self._session_start))

    def size_bases(self) -> None:
        """Size the interval to the next base from what this process recorded, if due: the steps
        whose records, at this session's bytes per step so far, add up to ``ratio`` times a base
        (the larger of the newest base and what a base would hold now: a fresh run's starting
        base has no optimizer state yet). Only a recording process sizes; the others adopt it."""
        if not self.sizing_due or self._writer is None or self.base_ratio is None:
            return
        self._sized_for = self._base_step
        base = max(self._newest_base_bytes, self._base_bytes() if self._base_bytes is not None else 0)
        per_step = self._recorded_bytes / max(self._recorded_steps, 1)
        interval = bytes_interval(self.base_ratio, base, per_step)
        if interval != self.settings.base_every_n_steps:
            log.debug("diffckpt: a base every %s steps (%.3g bytes recorded per step, bases of %d bytes, "
                      "ratio %g)", interval, per_step, base, self.base_ratio)
        self._fix_base(interval)

    def _fix_base(self, interval: int | None) -> None:
        self.settings = dataclasses.replace(self.settings, base_every_n_steps=interval)
        if self.tuner is not None:
            self.tuner.fix_base_every(interval)

    # ------------------------------------------------------------------ reviews
    def review_due(self, step: int) -> bool:
        """Whether the tuner reviews at ``step``, or a byte-sized base interval is sized: a
        function of the step, the bases written and what rank 0 sent, so every rank agrees."""
        return self._tuner_due(step) or self.sizing_due

    def _tuner_due(self, step: int) -> bool:
        return self.tuner is not None and step >= self._next_review

    @property
    def next_review(self) -> int:
        """The step of the next review (DDP: rank 0 sends it with the settings)."""
        return self._next_review

    def measure(self, step: int) -> Measurements | None:
        """What this process measured so far (``None`` while too little is measured)."""
        base_bytes = self._base_bytes() if self._base_bytes is not None else None
        return self.meter.snapshot(step - self._session_start, base_bytes) if self.meter is not None else None

    def review(self, step: int, measured: list[Measurements | None] | None = None) -> Decision | None:
        """Size a byte-sized base interval if due, then, if due, let the tuner look at the
        measurements and apply what it decides (rank 0).

        ``measured``: every writer's :meth:`measure` (sharded training), reviewed as the slowest
        of them; by default this process's own. Returns the tuner's decision, ``None`` without one
        or while too little is measured (it looks again soon). A change is logged and recorded in
        the session's ``tuning.json``.
        """
        self.size_bases()
        if not self._tuner_due(step):
            return None
        started = time.perf_counter()
        self._next_review = step + self.options.tuning.retune_every_n_steps
        if measured is None:
            m = self.measure(step)
        else:
            m = None if any(x is None for x in measured) else Measurements.slowest([x for x in measured if x])
        if m is None:
            self._next_review = step + WARMUP_STEPS
            return None
        try:
            return self._decide(step, m)
        finally:
            # Reviews are not training time, and they may take at most REVIEW_BUDGET of it: with
            # fast steps they come further apart than retune_every_n_steps.
            spent = time.perf_counter() - started
            self._aside_s += spent
            if m.step_s > 0:
                self._next_review = step + max(self.options.tuning.retune_every_n_steps,
                                               math.ceil(spent / (REVIEW_BUDGET * m.step_s)))

    def _decide(self, step: int, m: Measurements) -> Decision:
        assert self.tuner is not None
        first = not self._tuned
        decision = self.tuner.decide(m, None if first else self.settings)
        self._tuned = True
        self.last_review = (decision, m)
        if first or decision.settings != self.settings:
            old, new = self.settings, decision.settings
            changes = ", ".join(f"{k} {getattr(old, k)} -> {v}" for k, v in new.as_dict().items()
                                if getattr(old, k) != v)
            e = decision.estimate
            at_risk = risk(e, m)
            log.info("diffckpt: auto-tuned at step %d: %s (%s; expected loss %.3f%% of training time: overhead "
                     "%.2f%%, %.1fs lost and %.1fs recovery per failure; %s). Measured: %s", step,
                     changes or "keeps " + " ".join(f"{k}={v}" for k, v in new.as_dict().items()),
                     decision.reason, 100 * e.loss, 100 * e.overhead, e.lost_work_s, e.recovery_s,
                     say_risk(at_risk), describe(m))
            self.apply(new)
            self.decisions.append({"step": step, "settings": new.as_dict(), "reason": decision.reason,
                                   "expected_loss": e.loss, "loss_per_failure": at_risk,
                                   "measurements": m.as_dict()})
            self._save_decisions()
        return decision

    def adopt(self, settings: Settings, next_review: int) -> None:
        """Take the settings rank 0 chose (its tuner's, its byte-sized base interval) and its next
        review step (other ranks)."""
        self._next_review = next_review
        if self.sizing_due:  # rank 0 sized it in this review
            self._sized_for = self._base_step
        self.apply(settings)
        if self.tuner is not None and self.base_ratio is not None:
            self.tuner.fix_base_every(settings.base_every_n_steps)

    def apply(self, settings: Settings) -> None:
        self.settings = settings
        if self._writer is not None:
            self._writer.retarget(settings.write_batch)

    def _save_decisions(self) -> None:
        writer = self._writer
        if writer is None:
            return
        body = json.dumps({"gen": writer.gen, "decisions": list(self.decisions)}, indent=1).encode()
        path, storage = tuning_path(writer.gen), writer.storage
        writer.call(lambda: storage.write(path, body))

    # ------------------------------------------------------------- measurements
    @contextlib.contextmanager
    def measuring_state(self) -> Iterator[None]:
        """Time the adapter's work to build a restorable step's state."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._state_s += time.perf_counter() - start

    def note_record(self, entered: float, done: float, *, copy_s: float, update_s: float, state_s: float | None,
                    stalled: float, record_bytes: int) -> None:
        """A step was recorded: ``record_step`` ran from ``entered`` to ``done``; the optimizer
        hooks spent ``copy_s`` copying gradients and ``update_s`` in updates; ``state_s`` of it
        copied the state (``None``: not a restorable step); ``stalled`` waiting for the writer."""
        if self.meter is None:
            return
        if state_s is not None:  # what a restorable point costs the training thread
            self.meter.add_state(self._state_s + state_s)
        if self._mark is not None:  # training time since the previous call, checkpointing taken out
            self.meter.add_step(entered - self._mark - self._state_s - self._aside_s - copy_s,
                                copy_s + (done - entered) - (state_s or 0.0) - stalled, record_bytes)
        if update_s:
            self.meter.add_update(update_s)
        self._mark, self._state_s, self._aside_s = done, 0.0, 0.0

    def note_base(self, seconds: float, nbytes: int, done: float) -> None:
        """A base was copied on the training thread (``seconds``, stalls excluded)."""
        if self.meter is None:
            return
        self.meter.add_base_capture(seconds, nbytes)
        if self._mark is not None:
            self._mark = done

    def note_restore(self, load_s: float, replay_step_s: float | None) -> None:
        """A restore in this process took ``load_s`` to load its base and ``replay_step_s`` per
        replayed step; the next session's tuner uses these instead of estimates."""
        self.restore_timing = (load_s, replay_step_s)
