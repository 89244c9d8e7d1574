"""Auto-tuning inside a running engine: the settings in force, what is measured, the reviews.

:class:`OnlineTuning` is what a :class:`~diffckpt.CheckpointEngine` keeps for its
``every_n_steps``, ``write_batch`` and ``base_every_n_steps``. With no knob on ``"auto"`` it only
holds the fixed settings. Otherwise it feeds a :class:`~diffckpt.tuning.meter.Meter` from the
engine's timings, asks the pure :class:`~diffckpt.tuning.model.AutoTuner` at review steps, applies and
records what it decides. The engine calls it; adapters reach it through the engine.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import StorageError
from ..options import (
    DEFAULT_BASE_EVERY_N_STEPS,
    DEFAULT_EVERY_N_STEPS,
    DEFAULT_WRITE_BATCH,
    CheckpointOptions,
)
from ..runstore import tuning_path
from ..writer import BackgroundWriter
from .meter import Meter
from .model import AUTO, AutoTuner, Decision, Measurements, Settings, describe
from .probe import probe_storage

__all__ = ["REVIEW_BUDGET", "WARMUP_STEPS", "OnlineTuning"]

log = logging.getLogger("diffckpt")
WARMUP_STEPS = 10  # the tuner's first review comes this many steps into a session
REVIEW_BUDGET = 0.001  # the tuner's reviews may take at most this share of training time


class OnlineTuning:
    """The settings in force and, for ``"auto"`` knobs, the measurements and the reviews."""

    def __init__(self, options: CheckpointOptions) -> None:
        o = self.options = options
        self.settings = Settings(
            # "auto" starts from the defaults until the first review decides
            every_n_steps=DEFAULT_EVERY_N_STEPS if o.every_n_steps == AUTO else int(o.every_n_steps),
            write_batch=DEFAULT_WRITE_BATCH if o.write_batch == AUTO else int(o.write_batch),
            base_every_n_steps=DEFAULT_BASE_EVERY_N_STEPS if o.base_every_n_steps == AUTO
            else o.base_every_n_steps)  # type: ignore[arg-type]
        self.tuner = AutoTuner(o.tuning, o.every_n_steps, o.write_batch, o.base_every_n_steps) if o.auto else None
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

    # ------------------------------------------------------------------ session
    def start(self, step: int, writer: BackgroundWriter, base_bytes: Callable[[], int]) -> None:
        """A writer session starts at ``step``; ``base_bytes()`` says what a base would hold now."""
        self._writer, self._base_bytes = writer, base_bytes
        self.join(step)
        self._mark, self._state_s, self._aside_s = None, 0.0, 0.0
        self.decisions, self._tuned = [], False
        if self.tuner is None:
            return
        meter = self.meter = writer.meter = Meter(self.options.max_pending_bytes)  # the writer times its writes
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

    def join(self, step: int) -> None:
        """Keep the review clock from a session that starts at ``step`` (every DDP rank)."""
        self._session_start = step
        self._next_review = step + WARMUP_STEPS

    # ------------------------------------------------------------------ reviews
    def review_due(self, step: int) -> bool:
        """Whether the tuner reviews at ``step``: a function of the step and of what rank 0 sent,
        so every DDP rank agrees."""
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
        """Let the tuner look at the measurements and apply what it decides (rank 0).

        ``measured``: every writer's :meth:`measure` (sharded training), reviewed as the slowest
        of them; by default this process's own. Returns the decision, ``None`` while too little
        is measured (it looks again soon). A change is logged and recorded in the session's
        ``tuning.json``.
        """
        if self.tuner is None:
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
            log.info("diffckpt: auto-tuned at step %d: %s (%s; expected loss %.3f%% of training time: overhead "
                     "%.2f%%, %.1fs lost and %.1fs recovery per failure). Measured: %s", step,
                     changes or "keeps " + " ".join(f"{k}={v}" for k, v in new.as_dict().items()),
                     decision.reason, 100 * e.loss, 100 * e.overhead, e.lost_work_s, e.recovery_s, describe(m))
            self.apply(new)
            self.decisions.append({"step": step, "settings": new.as_dict(), "reason": decision.reason,
                                   "expected_loss": e.loss, "measurements": m.as_dict()})
            self._save_decisions()
        return decision

    def adopt(self, settings: Settings, next_review: int) -> None:
        """Take the settings rank 0's tuner chose and its next review step (other DDP ranks)."""
        self._next_review = next_review
        self.apply(settings)

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
        if state_s is not None:
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
