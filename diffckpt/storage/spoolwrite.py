"""How an append reaches a spool's file, and what each file system was measured to take.

Every append is ``pwritev`` at the offset it belongs at: from the writer thread, or, for a large
record, in chunks from a few helper threads at once where that measured faster on the spool's file
system. Measured, not assumed: Linux holds a file's inode lock (``i_rwsem``) through the whole of a
buffered write (ext4, tmpfs and xfs alike), so threads writing one file mostly take turns, and
each handoff costs. On 16 cores, 2 to 8 threads wrote 64 to 256 MiB into tmpfs and ext4 at -20%
to +18% of one thread's rate; on a 2-core VM, 2 threads wrote to its ext4 disk at 0.75 to 2.2
times one thread's rate from one minute to the next (docs/benchmarks.md, "The writer pipeline"). So
each file system is tried both ways for :data:`TRIALS` large appends, then the faster way is
taken, and the slower one again every :data:`RETRIAL` large appends, so both figures stay current.

:class:`Target` holds those figures per file system (``st_dev``), for the whole process: the
segment encoder reads :meth:`Target.rate` to decide whether zstd shortens a write
(``segment.py``), and a segment's spool is a new file each time, so a figure per file would
always start from nothing.

:func:`helpers` is the pool those threads come from; the writer also hashes a record there while
it writes the record's bytes (``openseg.py``). Work run there releases the GIL (``pwritev``,
XXH3 over large buffers, ``checksums.py``), so it runs beside the training thread too.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
from collections.abc import Sequence
from concurrent import futures

# One definition, in checksums.py (a leaf): the storage modules take it from here, and
# ``diffckpt.storage.protocol.Buffer`` re-exports it.
from ..checksums import Buffer

__all__ = ["CHUNK", "PARALLEL_MIN", "RETRIAL", "TRIALS", "WRITERS", "Buffer", "Target", "helpers", "pieces",
           "target_of", "views_of", "write_at"]


PARALLEL_MIN = 64 << 20
"""Appends at least this large may go out from several threads; smaller ones always go from the
writer thread, since a thread's handoff costs more than it could save (at 1 MiB, 2 to 8 threads
took about twice as long as one on every target measured)."""

CHUNK = 16 << 20
"""Bytes each helper writes at a time in a parallel append."""

WRITERS = max(1, min(4, os.cpu_count() or 1))
"""Threads of a parallel append: beyond 4, no target measured gained anything."""

TRIALS = 2
"""Large appends made each way on a file system before the faster way is kept."""

RATED_MIN = 1 << 20
"""Appends smaller than this (a lead, an index, a small record) measure a call's cost, not a
file system's bandwidth, and do not count in its rate."""

RETRIAL = 8
"""Of the large appends after the trials, every this many goes the slower way, to measure it again."""

_DECAY = 0.8  # each new measurement weighs a fifth: the figures follow a target that changes


def _iov_max() -> int:
    # pwritev takes at most IOV_MAX buffers at once (1024 on Linux); a record may have more tensors.
    try:
        return max(16, os.sysconf("SC_IOV_MAX"))
    except (ValueError, OSError):
        return 1024


_IOV_MAX = _iov_max()
_pool: tuple[int, futures.ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


def helpers() -> futures.ThreadPoolExecutor:
    """The process's helper threads (:data:`WRITERS` for a parallel append, one more for the
    hash that runs beside it), made at first use and again in a forked child, whose copy of the
    pool has no threads."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), futures.ThreadPoolExecutor(WRITERS + 1, thread_name_prefix="diffckpt-io"))
        return _pool[1]


class _Rate:
    """Bytes and seconds of the appends measured, each older one weighing less."""

    def __init__(self) -> None:
        self.count = 0
        self.bytes = 0.0
        self.seconds = 0.0

    def note(self, size: int, seconds: float) -> None:
        self.count += 1
        self.bytes = self.bytes * _DECAY + size
        self.seconds = self.seconds * _DECAY + seconds

    def value(self) -> float | None:
        return self.bytes / self.seconds if self.count and self.seconds > 0 else None


class Target:
    """One file system as this process measured appends to it: its rate over all appends (which
    the compression decision reads) and, for appends of :data:`PARALLEL_MIN` or more, its rate
    with one thread and with :data:`WRITERS`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._all = _Rate()
        self._ways = {1: _Rate(), WRITERS: _Rate()}
        self._large = 0  # large appends since both ways were tried

    def rate(self) -> float | None:
        """Bytes per second appends took here (``None`` before the first)."""
        with self._lock:
            return self._all.value()

    def workers(self, size: int) -> int:
        """Threads for an append of ``size`` bytes: one below :data:`PARALLEL_MIN`; above it,
        each way in turn until both were measured :data:`TRIALS` times, then the faster, but
        every :data:`RETRIAL`-th time the other: a disk's rate swings (2x between minutes on the
        VM measured), and a way measured once in a slow minute would never be taken again."""
        if size < PARALLEL_MIN or WRITERS == 1:
            return 1
        with self._lock:
            for way, rate in self._ways.items():
                if rate.count < TRIALS:
                    return way
            self._large += 1
            slow, fast = sorted(self._ways, key=lambda way: self._ways[way].value() or 0.0)
            return slow if self._large % RETRIAL == 0 else fast

    def note(self, size: int, seconds: float, workers: int) -> None:
        """An append of ``size`` bytes took ``seconds`` with ``workers`` threads."""
        with self._lock:
            if size >= RATED_MIN:
                self._all.note(size, seconds)
            if size >= PARALLEL_MIN and workers in self._ways:  # (a copy into a mapping is in neither)
                self._ways[workers].note(size, seconds)


_targets: dict[int, Target] = {}
_targets_lock = threading.Lock()


def target_of(fd: int) -> Target:
    """The :class:`Target` of the file system ``fd`` is on (a file in memory: that of memory)."""
    device = os.fstat(fd).st_dev
    with _targets_lock:
        return _targets.setdefault(device, Target())


def views_of(parts: Sequence[Buffer]) -> list[memoryview]:
    """``parts`` as flat byte views, the empty ones left out (nothing is copied)."""
    return [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]


def write_at(fd: int, views: list[memoryview], offset: int, workers: int = 1) -> int:
    """Write ``views`` (:func:`views_of`) in order at ``offset``; return the bytes written.
    ``workers`` > 1: in :data:`CHUNK` pieces from that many helper threads, every piece finished
    or failed before it returns, so that a caller that cuts off a failed append cuts it all.

    Raises:
        OSError: of the first piece that failed (a full disk: ``ENOSPC``).
    """
    if workers == 1:
        return _write_all(fd, views, offset)
    jobs = [helpers().submit(_write_all, fd, piece, start) for piece, start in pieces(views, offset)]
    futures.wait(jobs)
    return sum(job.result() for job in jobs)  # the first failure raises, once none is running


def pieces(views: list[memoryview], offset: int) -> list[tuple[list[memoryview], int]]:
    """``views`` cut into runs of :data:`CHUNK` bytes (the last shorter), each with its offset."""
    pieces: list[tuple[list[memoryview], int]] = []
    run: list[memoryview] = []
    size = 0
    for view in views:
        while view.nbytes:
            take = view[: CHUNK - size]
            run.append(take)
            size += take.nbytes
            view = view[take.nbytes :]
            if size == CHUNK:
                pieces.append((run, offset))
                offset, run, size = offset + size, [], 0
    if run:
        pieces.append((run, offset))
    return pieces


def _write_all(fd: int, views: list[memoryview], offset: int) -> int:
    """Write ``views`` at ``offset`` with as few ``pwritev`` calls as the kernel allows (it may
    write fewer bytes than asked, and takes at most IOV_MAX buffers); return the count."""
    pending = collections.deque(views)
    total = 0
    while pending:
        written = os.pwritev(fd, list(itertools.islice(pending, _IOV_MAX)), offset + total)
        total += written
        while written:  # drop the buffers that went out, keep the rest of one cut short
            if written >= pending[0].nbytes:
                written -= pending.popleft().nbytes
            else:
                pending[0] = pending[0][written:]
                written = 0
    return total
