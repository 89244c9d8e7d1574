"""The hand-off between the training thread and the writer thread: a queue bounded in bytes.

Training hands over records, bases and requests (a flush, a call, a new ``write_batch``). It
waits while handing over more would hold more than ``max_pending_bytes`` and, with the node-local
tier, while the record handed over before is not journaled yet; nothing is dropped. A wait that
lasts, or one caused by a storage outage, is logged; during an outage with
``on_storage_error="raise"`` the wait ends in a :class:`~diffckpt.StorageUnavailableError`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .options import CheckpointOptions
from .outage import Outage
from .units import format_bytes

if TYPE_CHECKING:
    from .writerstats import WriterStats

__all__ = ["HandOff"]

log = logging.getLogger("diffckpt")
_WARN_AFTER_S = 1.0  # a wait for the writer this long is worth a warning
_WARN_EVERY_S = 60.0  # and then at most one a minute


class HandOff:
    """What training handed to the writer thread and the writer has not finished with.

    ``failed``: whether the writer thread has failed (a wait ends then; the caller raises).
    ``durable``: the newest durable step, for the outage's error."""

    def __init__(self, options: CheckpointOptions, outage: Outage, stats: WriterStats,
                 failed: Callable[[], bool], durable: Callable[[], int | None]) -> None:
        self.cond = threading.Condition()
        self.queued_bytes = 0  # handed over and not written yet (queued, or being encoded)
        self.closed = False
        self._queue: collections.deque[tuple[str, Any, int]] = collections.deque()
        self._records_in = self._records_out = 0  # records handed over / appended (or failed)
        self._warned_at = -_WARN_EVERY_S
        self._options, self._outage, self._stats = options, outage, stats
        self._failed, self._durable = failed, durable

    # ------------------------------------------------------------ training side
    def must_wait(self, nbytes: int, behind: bool = False) -> bool:
        """Whether handing over ``nbytes`` now would hold more than ``max_pending_bytes``; a
        record larger than the bound waits only until what is held is within it, so the writer
        never holds more than the bound plus one record. ``behind``: also while a record handed
        over before is not journaled, unless storage is in an outage: then records wait in
        memory, within the bound, as without a journal, so that training rides out the outage."""
        if behind and self._records_in > self._records_out and self._outage.since is None:
            return True
        bound = self._options.max_pending_bytes
        if not nbytes:  # a flush, a call, a retarget: they hold nothing (a flush waits anyway)
            return False
        return bool(self.queued_bytes) and self.queued_bytes + nbytes > bound + (nbytes if nbytes > bound else 0)

    def put(self, kind: str, item: Any, nbytes: int, behind: bool) -> None:
        """Queue ``item`` once there is room (see :meth:`must_wait`); the time waited counts as
        a stall."""
        with self.cond:
            start = warned = None
            while self.must_wait(nbytes, behind):
                if self._failed():
                    break
                self._outage.raise_if(f"the checkpoint buffer is full ({format_bytes(self.queued_bytes)}, "
                                      f"max_pending_bytes {format_bytes(self._options.max_pending_bytes)})",
                                      self._durable())
                now = time.monotonic()
                start = now if start is None else start
                # A record larger than the bound waits for the one before it at every step, which
                # is the bound at work, not news: only a wait that lasts is worth a warning.
                # An outage is news at once.
                outage = self._outage.cause(start, self._durable())
                if warned is None and (outage or (now - start >= _WARN_AFTER_S and now - self._warned_at >= _WARN_EVERY_S)):
                    warned = self._warned_at = now
                    cause = outage or "storage is slower than training"
                    log.warning(
                        "diffckpt: writer is behind (%s held, limit %s): %s; training waits "
                        "for storage and nothing is dropped. Raise max_pending_bytes, write_batch or "
                        "every_n_steps, or use faster storage.", format_bytes(self.queued_bytes),
                        format_bytes(self._options.max_pending_bytes), cause)
                self.cond.wait(0.1)
            if start is not None:
                self._stats.stall_seconds += time.monotonic() - start
            self._queue.append((kind, item, nbytes))
            self._records_in += kind == "record"
            self.queued_bytes += nbytes
            self._stats.peak_held_bytes = max(self._stats.peak_held_bytes, self.queued_bytes)
            self.cond.notify_all()

    def close(self) -> None:
        """No more hand-overs; the writer thread ends once the queue is empty."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    # -------------------------------------------------------------- writer side
    def take(self) -> tuple[str, Any, int] | None:
        """The next item, waiting for one; ``None`` once closed and empty."""
        with self.cond:
            while not self._queue and not self.closed:
                self.cond.wait()
            return self._queue.popleft() if self._queue else None

    def done(self, nbytes: int) -> None:
        """An item taken is finished with: its bytes no longer count."""
        with self.cond:
            self.queued_bytes -= nbytes
            self.cond.notify_all()

    def journaled(self) -> None:
        """A record taken is in the open segment (or failed): the next one may be handed over."""
        with self.cond:
            self._records_out += 1
            self.cond.notify_all()
