"""``StepDriver``: the life cycle of one training session as an adapter drives it, the same for
every framework whose adapter decides where a step ends (Accelerate's and Fabric's hand-written
loops through :class:`~diffckpt.loop.LoopCheckpointer`, the transformers ``Trainer``'s events).

At each boundary (everything the last step changed is in place) every rank agrees on SIGTERM,
so that all stop at the same step; the session begins at the first boundary; each later step is
committed. :meth:`StepDriver.close` makes the last step restorable, flushes and ends the session,
also after an exception. :func:`step_metrics` says what to hand a framework's loggers after a
commit (Lightning, which has its own boundaries and preemption handling, uses only that).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .engine import CheckpointEngine
from .options import CheckpointOptions
from .preemption import StopSignal
from .session import Committed, FrameworkState

__all__ = ["StepDriver", "check_log_every", "step_metrics"]


def check_log_every(log_every_n_steps: Any) -> int:
    """``log_every_n_steps`` if it is a positive number of steps, else ``ValueError``."""
    if not isinstance(log_every_n_steps, int) or isinstance(log_every_n_steps, bool) or log_every_n_steps < 1:
        raise ValueError(f"log_every_n_steps must be a positive number of steps, got {log_every_n_steps!r}")
    return log_every_n_steps


def step_metrics(engine: CheckpointEngine, done: Committed, step: int, log_every_n_steps: int) -> dict[str, float]:
    """What to log after committing ``step``: a tuner decision's metrics, and every
    ``log_every_n_steps`` steps the engine's ``diffckpt/*`` metrics (empty where this rank does
    not write)."""
    metrics = dict(done.tuning)
    if step % log_every_n_steps == 0:
        metrics.update(engine.metrics())
    return metrics


class StepDriver:
    """One training session of ``engine``, driven at the adapter's step boundaries (every rank
    calls the same methods at the same steps).

    Attributes:
        started: the session began (at the first boundary that agreed to begin).
        closed: :meth:`close` ran (or :meth:`interrupted`); boundaries do nothing after it.
        durable_step: the durable step :meth:`close` reported.
    """

    def __init__(self, engine: CheckpointEngine, options: CheckpointOptions,
                 on_close: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.options = options
        self.on_close = on_close  # undoes what the adapter hooked into its framework, at any close
        self.started = self.closed = False
        self.durable_step: int | None = None
        self._sigterm: StopSignal | None = None

    def arm(self) -> None:
        """A new session: SIGTERM is a flag from now on, acted on at the next boundary."""
        self.started = self.closed = False
        self._sigterm = StopSignal()

    @property
    def received_sigterm(self) -> bool:
        """Whether this process got SIGTERM (it stops at the next boundary, with every rank)."""
        return self._sigterm is not None and self._sigterm.received

    def boundary(self, step: int, begin: Callable[[], bool], state: Callable[[], FrameworkState]
                 ) -> Committed | None:
        """Everything ``step`` changed is in place: stop with every rank if any got SIGTERM
        (flushing within ``flush_timeout_s``), else begin the session (``begin()`` calls
        ``engine.begin`` and returns ``False`` to wait for a later boundary) or commit ``step``
        if it is new. Returns what the commit did (``None``: nothing committed). The caller
        then hands the metrics on and calls ``engine.check()``."""
        if self.closed:
            return None
        if self.engine.agree(self.received_sigterm):  # every rank stops at the same step
            self.close(step, state, reason="stopped by SIGTERM", timeout=self.options.flush_timeout_s)
            assert self._sigterm is not None
            self._sigterm.exit()
        done = None
        if not self.started:
            self.started = begin()
        elif step > self.engine.recorded_step:
            done = self.engine.commit(step, state())
        return done

    def close(self, step: int, state: Callable[[], FrameworkState], reason: str = "end of training",
              timeout: float | None = None, record: bool = True) -> int | None:
        """Make ``step`` restorable (unless not ``record``: the step in progress may be half done
        after an exception), flush and end the session; return the durable step. ``on_close``
        (given at construction) runs after the last step is recorded. What is queued is written
        even when recording fails."""
        if self.closed:
            return self.durable_step
        try:
            if record and self.started:
                self.engine.make_restorable(step, state())
        finally:
            self.closed = True
            if self.on_close is not None:
                self.on_close()
            if self._sigterm is not None:
                self._sigterm.uninstall()
            self.durable_step = self.engine.end(reason, timeout)
        return self.durable_step

    def interrupted(self, reason: str) -> None:
        """The process ends without :meth:`close` (an exception escaped the framework's loop):
        flush what is recorded, within ``flush_timeout_s``."""
        if not self.closed:
            self.closed = True
            if self._sigterm is not None:
                self._sigterm.uninstall()
            self.durable_step = self.engine.end(reason, self.options.flush_timeout_s)
