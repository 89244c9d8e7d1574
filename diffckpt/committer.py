"""How the background writer puts objects in the run root: each write fenced against newer
sessions and retried through outages, and segments and bases committed in order, one at a time,
in a thread of their own, so the writer encodes the next records while an upload runs.

Finished segments wait their turn as spools on local disk (journaled, so a crash loses none of
them on this node); at most ``WAITING`` segments or bases wait, then the writer waits too. A base
waits in memory (:class:`PendingBase`, its bytes counted against ``max_pending_bytes`` until
written): the segments after it, which continue from its step, commit only once it is durable.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .checksums import Buffer, fingerprint
from .errors import ConcurrentWriterError, StorageUnavailableError
from .format import BaseName, SegmentName, base_commit
from .openseg import OpenSegment
from .outage import Outage
from .runstore import RunStore
from .storage import Storage
from .storage.protocol import data_size
from .tuning.meter import Meter

__all__ = ["Committer", "PendingBase"]

log = logging.getLogger("diffckpt")
WAITING = 2  # finished segments waiting for the one being committed, before the writer waits


@dataclass
class PendingBase:
    """A base packed by the writer, waiting for its turn in the commit thread: ``parts`` are
    views of the host copies in ``params``' tree, so they stay in memory until written.
    ``release`` lets them go (once: written, failed, or given up); ``pack_s`` is the writer's time
    on it, counted in ``write_seconds`` with the commit's, as a segment's encoding is."""

    name: BaseName
    parts: list[Buffer]
    params: list[torch.Tensor]
    size: int
    pack_s: float
    release: Callable[[], None]
    _released: bool = field(default=False, repr=False)

    def keep(self) -> None:
        """Given up (the writer was abandoned): nothing of a base stays; its memory goes."""
        self.let_go()

    def let_go(self) -> None:
        if not self._released:
            self._released = True
            self.parts, self.params = [], []
            self.release()


class Committer:
    """The writes of one writer (session ``gen``): ``storage`` and ``fence`` already stop
    retrying once ``abandon`` is set; ``stats`` is the writer's ``WriterStats``; ``held`` says
    how many bytes the writer holds (for the outage's messages); ``fail`` keeps a commit thread's
    error for the training thread."""

    def __init__(self, store: RunStore, gen: int, storage: Storage, fence: Storage, abandon: threading.Event,
                 outage: Outage, stats: Any, meter: Meter | None, max_backoff_s: float,
                 held: Callable[[], int], fail: Callable[[BaseException], None]) -> None:
        self.store, self.gen, self.storage, self.fence = store, gen, storage, fence
        self.abandon, self.outage, self.stats, self.meter = abandon, outage, stats, meter
        self.max_backoff_s, self.held, self.fail = max_backoff_s, held, fail
        self.durable_step: int | None = None
        self.thread: threading.Thread | None = None  # the commit thread, while it has segments
        self.error: BaseException | None = None  # the commit thread's, once it failed
        self._queue: collections.deque[tuple[OpenSegment | PendingBase, SegmentName | BaseName, int, int]] = \
            collections.deque()
        self._lock = threading.Lock()
        # Whether the commit thread takes the queue on: set and cleared under the lock, so a
        # segment handed over just as the thread ends is never left without one.
        self._running = False

    def write(self, path: str, data: Any) -> None:
        """Write one object: fenced against newer sessions, retried through outages until it is
        written or the writer is abandoned."""
        start, failed = time.monotonic(), False
        while True:
            if self.abandon.is_set():  # close() gave up: start no write it has reported lost
                raise StorageUnavailableError(f"the writer was abandoned before {path} was written")
            try:
                self.check_fence()
                self.storage.write(path, data)
                break
            except StorageUnavailableError as exc:
                if self.abandon.is_set():
                    raise
                failed = True
                self.outage.note(path, exc, self.durable_step, self.held())
                if self.abandon.wait(self.max_backoff_s):
                    raise
        if self.meter is not None and not failed:  # what a request costs here, fence check included
            self.meter.add_write(data_size(data), time.monotonic() - start)
        self.outage.over(self.held())

    def check_fence(self) -> None:
        newer = self.store.newer_session(self.gen, self.fence)
        if newer is not None:
            raise ConcurrentWriterError(
                f"another job started writing to {self.store.storage.url} (session g{newer.get('gen')}, host "
                f"{newer.get('host', '?')}, pid {newer.get('pid', '?')}, resumed from step "
                f"{newer.get('resumed_from', '?')}); this job (session g{self.gen}) stopped writing so the two do "
                f"not interleave. Its steps up to {self.durable_step} stay restorable. Stop this job, or give "
                "each job its own dirpath")

    def start(self, segment: OpenSegment | PendingBase, name: SegmentName | BaseName, records: int, raw: int) -> None:
        """Commit a finished segment after those handed over before it, in the commit thread;
        wait first while ``WAITING`` segments already wait. A wait that ends in an error (the writer
        abandoned, a commit failed) keeps the segment's spool and journal for the local tier."""
        try:
            self.settle(WAITING)
        except BaseException:
            segment.keep()
            raise
        with self._lock:
            self._queue.append((segment, name, records, raw))
            if self._running:
                return
            self._running = True
            thread = threading.Thread(target=self._commit_segments, name=f"diffckpt-commit-g{self.gen}", daemon=True)
            try:
                thread.start()
                self.thread = thread
                return
            except RuntimeError:  # Python 3.12+ starts no thread at interpreter shutdown (a flush at exit)
                pass
        self._commit_segments()  # so the writer thread commits, in order, before it goes on

    def settle(self, waiting: int = 0) -> None:
        """Wait until at most ``waiting`` segments are handed over and not committed (``0``: all
        are; an abandoned writer stops waiting), and raise the commit thread's error."""
        while self.error is None and len(self._queue) > waiting:
            assert self.thread is not None  # a segment is queued: the commit thread runs
            self.thread.join(0.05)
            if self.abandon.is_set():
                raise StorageUnavailableError("the writer was abandoned while a segment was being committed")
        if self.error is not None:
            raise self.error

    @property
    def in_flight(self) -> bool:
        """Whether a segment is handed over and not committed (or given up) yet."""
        return self._running

    def _commit_segments(self) -> None:
        while True:
            with self._lock:
                if not self._queue or self.error is not None:
                    self._running = False
                    return
                item = self._queue[0]
            segment, name, records, raw = item
            if isinstance(segment, PendingBase):
                self._commit_base(segment)
            else:
                assert isinstance(name, SegmentName)
                self._commit_segment(segment, name, records, raw)
            with self._lock:
                if self._queue and self._queue[0] is item:  # keep_waiting may have taken it
                    self._queue.popleft()

    def keep_waiting(self) -> None:
        """Keep the spools of the segments not committed (the writer gave up): their journals
        let a resume on this node take their records back."""
        with self._lock:
            busy = self.in_flight  # the one being committed is the commit thread's to keep or discard
            while len(self._queue) > busy:
                self._queue.pop()[0].keep()

    def _commit_segment(self, segment: OpenSegment, name: SegmentName, records: int, raw: int) -> None:
        start = time.monotonic()
        size = segment.spool.size
        try:
            self.write(name.path, segment.spool)
        except BaseException as exc:  # re-raised on the training thread, as the writer's are
            self.error = exc
            if not self.abandon.is_set():  # close() logs what an abandoned writer lost
                log.error("diffckpt: background write failed: %s", exc)
            self.fail(exc)
            segment.keep()
            return
        segment.discard()
        self.stats.write_seconds += time.monotonic() - start + segment.encode_s
        self.stats.segments += 1
        self.stats.records += records
        self.stats.segment_bytes += size
        self.stats.raw_record_bytes += raw
        self.durable_step = name.last

    def _commit_base(self, base: PendingBase) -> None:
        """``state.safetensors`` first and ``COMMIT`` last (readers ignore a base without it);
        the fingerprint and the file's hash are computed here, off the writer thread."""
        name, size, start = base.name, base.size, time.monotonic()
        try:
            self.write(name.state_path, base.parts)
            self.write(name.commit_path, base_commit(name.step, self.gen, fingerprint(base.params), base.parts))
        except BaseException as exc:  # as a segment's: no later segment commits (it would continue nothing)
            self.error = exc
            if not self.abandon.is_set():
                log.error("diffckpt: background write failed: %s", exc)
            self.fail(exc)
            return
        finally:
            base.let_go()
        self.stats.write_seconds += time.monotonic() - start + base.pack_s
        self.stats.bases += 1
        self.stats.base_bytes += size
        self.durable_step = name.step if self.durable_step is None else max(self.durable_step, name.step)
