"""SIGTERM, the usual preemption notice, as a flag a training loop acts on at a safe point.

Schedulers (Slurm, Kubernetes, spot instances) send SIGTERM and kill the job a grace period
later. The handler only sets a flag: the signal may arrive while the main thread is inside the
engine, holding the writer's locks, so flushing from the handler could deadlock. The loop checks
the flag at its next step boundary (every rank agreeing through the engine, so that all stop at
the same step), flushes within ``flush_timeout_s`` and exits with status 128 + SIGTERM, after
giving the handler that was installed before a chance to run.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, NoReturn

__all__ = ["StopSignal"]


class StopSignal:
    """Catches SIGTERM while installed (only from the main thread; an ignored SIGTERM stays so)."""

    def __init__(self) -> None:
        self.received = False
        self._previous: Any = None  # the handler to give SIGTERM back to, while installed
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN):
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        self._chained = self._previous  # what exit() runs, also after uninstall()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received = True

    def uninstall(self) -> None:
        """Give SIGTERM back to the handler it had before."""
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def exit(self) -> NoReturn:
        """After flushing: run the previous handler, if it is a function, then exit as SIGTERM does."""
        self.uninstall()
        if callable(self._chained):
            self._chained(signal.SIGTERM, None)
        raise SystemExit(128 + signal.SIGTERM)
