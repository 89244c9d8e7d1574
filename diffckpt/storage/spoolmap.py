"""A kept spool file's pages mapped into memory, so that appending a record over them is a copy at
memory speed.

A temporary spool's file is written over by the spools after it (``freespools.py``). ``pwritev``
into its pages still looks up and locks each 4 KiB page in the kernel, and Linux holds the file's
inode lock through each write, so threads writing one file take turns. Measured on the 2-core VM,
330 MiB into the existing pages of a ``/dev/shm`` file: ``pwritev`` 2.9 GB/s; a copy into a mapping
of those pages made once, 8.6 GB/s from one thread and 10.7 from two. On a GPU host the record
of a 124M model (330 MiB a step) took 146 ms to append through ``pwritev``, longer than the step.

So an append of at least :data:`MAP_MIN` bytes to a temporary spool, into pages its file already
has, is copied into :class:`FileMap`'s mapping of them, in pieces, from the helper threads
(numpy's copy releases the GIL). The mapping is made once per file, in windows of up to
:data:`WINDOW` bytes, and goes along when the file is kept for the next spool.

A new file has no pages: allocating them (the kernel zeroes each) is most of what writing a new
file costs (330 MiB: ``pwritev`` into a new file 1.5 GB/s, into an old one 2.9). So after each large
append a helper thread allocates the pages of the next :data:`AHEAD` appends of that size
(``posix_fallocate``) and maps them (:meth:`FileMap.reserve`), beside training and off the writer's
path, on machines with cores to spare; an append that finds its pages there is a copy, one that does not is written with
``pwritev``. A page touched through a mapping that the file system cannot allocate is a ``SIGBUS``,
so a mapping is only ever written where the pages are there: a full file system stops the
reservation (``ENOSPC``, quietly) and the appends past it fail as writes do, with ``ENOSPC``. The
file may so be up to :data:`AHEAD` appends longer than what was appended; every reader of a spool
reads the ranges its journal or size names, never to the end of the file.
"""

from __future__ import annotations

import mmap
import os
import threading
from concurrent import futures

import numpy as np

from .spoolwrite import WRITERS, helpers, pieces

__all__ = ["AHEAD", "CPU_QUOTA", "MAPPABLE", "MAP_MIN", "SPARE_CORES", "WINDOW", "FileMap", "usable_cores"]

WINDOW = 64 << 20
"""Bytes of a file each mapping covers at most: a record spans a few."""

MAP_MIN = 8 << 20
"""Appends smaller than this are written (a lead, an index, a small record): a mapping's copy
saves nothing on them."""

CPU_QUOTA = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "<quota> <period>" in microseconds, or "max <period>"


def usable_cores(quota_file: str = CPU_QUOTA) -> float:
    """The cores this process may use: those it may run on, or its container's CPU quota when lower."""
    try:
        cores: float = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        with open(quota_file) as f:
            quota, period = f.read().split()[:2]
        if quota != "max" and int(period) > 0:
            cores = min(cores, int(quota) / int(period))
    except (OSError, ValueError):  # no cgroup v2 here, or no quota
        pass
    return cores


def _spare_cores() -> bool:
    forced = os.environ.get("DIFFCKPT_ALLOCATE_AHEAD", "").strip()
    return forced == "1" if forced in ("0", "1") else usable_cores() >= 4


SPARE_CORES = _spare_cores()
"""Whether a core is spare to allocate pages ahead beside training: four or more usable (the
affinity mask, and the container's CPU quota), or ``DIFFCKPT_ALLOCATE_AHEAD=1`` (``0``: never).
On the 2-core VM there is none: allocating ahead there slowed fast steps (100 ms a step, 70 of
them launching work from Python) from 1.4x to 1.8x."""

AHEAD = 2 if SPARE_CORES else 0
"""Appends of the last one's size whose pages are allocated ahead of them."""

MAPPABLE = hasattr(mmap, "MAP_POPULATE") and hasattr(os, "posix_fallocate")
"""Whether this platform maps a file's pages in at once and allocates them (Linux)."""


class FileMap:
    """The pages of one open file that it already has (``allocated`` bytes from its start),
    mapped shared in windows made at first use. Owned by one spool at a time; :meth:`close`
    before the file is closed."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        # A kept spool's file has pages from its start to its end (written or allocated): every
        # page below its size is there. Appends and reservations past it extend this; truncation
        # moves it back (cut()).
        self.allocated = os.fstat(fd).st_size
        self._windows: dict[int, mmap.mmap] = {}
        self._lock = threading.Lock()  # the windows and `allocated`, shared with a reservation
        self._reserving: futures.Future[None] | None = None
        self._stop = False
        self._pid = os.getpid()  # a forked child's copy has no thread to wait for

    def reserve(self, end: int) -> None:
        """Allocate and map the file's pages up to ``end`` (rounded up to a window) on a helper
        thread, unless a reservation runs already."""
        with self._lock:
            if self._stop or end <= self.allocated or (self._reserving is not None and not self._reserving.done()):
                return
            self._reserving = helpers().submit(self._reserve, -(-end // WINDOW) * WINDOW)

    def map_all(self) -> None:
        """Map every window of the pages the file has (a file allocated ahead, before it is used)."""
        for index in range(-(-self.allocated // WINDOW)):
            self._window(index, min(WINDOW, self.allocated - index * WINDOW))

    def settle(self) -> None:
        """Wait for a reservation that runs (before the file is truncated or closed)."""
        reserving = self._reserving
        if reserving is not None and self._pid == os.getpid():
            futures.wait([reserving])

    def _reserve(self, end: int) -> None:
        while not self._stop:
            with self._lock:
                start = self.allocated
            if start >= end:
                return
            index = start // WINDOW
            stop = min(end, (index + 1) * WINDOW)
            try:
                os.posix_fallocate(self.fd, start, stop - start)
                # Mapped (and populated) outside the lock: the writer's appends look windows up meanwhile.
                window: mmap.mmap | None = None if index in self._windows else self._map(index, stop - index * WINDOW)
            except OSError:  # a full file system: the appends past here are written, and fail as writes do
                return
            with self._lock:
                moved = self._stop or self.allocated != start  # truncated meanwhile (settle() prevents it)
                if not moved:
                    self.allocated = stop
                    if window is not None and index not in self._windows:  # a shorter one stays until needed
                        self._windows[index], window = window, None
            if window is not None:
                window.close()
            if moved:
                return

    def covers(self, offset: int, size: int) -> bool:
        """Whether ``size`` bytes at ``offset`` are in pages the file has."""
        with self._lock:
            return offset + size <= self.allocated

    def grown(self, size: int) -> None:
        """The file was written (``pwritev``) up to ``size`` bytes."""
        with self._lock:
            self.allocated = max(self.allocated, size)

    def cut(self, size: int) -> None:
        """The file was truncated to ``size`` bytes (after :meth:`settle`): the pages past it are gone."""
        with self._lock:
            self.allocated = min(self.allocated, size)

    def write(self, views: list[memoryview], offset: int) -> int:
        """Copy ``views`` in order to ``offset`` (a range :meth:`covers`) from :data:`WRITERS`
        helper threads; return the bytes written."""
        size = sum(v.nbytes for v in views)
        if not self.covers(offset, size):
            raise ValueError(f"bytes [{offset}, {offset + size}) are past the file's pages ({self.allocated})")
        # Mapped here, before the copies start: the helper threads only read the windows.
        for index in range(offset // WINDOW, (offset + size - 1) // WINDOW + 1):
            self._window(index, min(WINDOW, offset + size - index * WINDOW))
        runs = pieces(views, offset)
        if WRITERS == 1 or len(runs) == 1:
            for run, start in runs:
                self._copy(run, start)
        else:
            jobs = [helpers().submit(self._copy, run, start) for run, start in runs]
            futures.wait(jobs)
            for job in jobs:
                job.result()
        return size

    def flush(self) -> None:
        """Write the windows' pages back to the file's storage (``msync``; before an ``fsync``)."""
        self.settle()
        with self._lock:
            windows = list(self._windows.values())
        for window in windows:
            window.flush()

    def close(self) -> None:
        """Stop a reservation, wait for it, and unmap every window (the file stays open)."""
        self._stop = True
        self.settle()
        windows, self._windows = self._windows, {}
        for window in windows.values():
            window.close()

    def _window(self, index: int, end: int) -> None:
        """Map window ``index`` at least to ``end`` bytes into it (again, longer, where the file
        had fewer pages when it was first mapped: no copy runs then, nor maps this index)."""
        with self._lock:
            window = self._windows.get(index)
            if window is None or len(window) < end:
                if window is not None:
                    window.close()
                self._windows[index] = self._map(index, min(WINDOW, self.allocated - index * WINDOW))

    def _map(self, index: int, length: int) -> mmap.mmap:
        return mmap.mmap(self.fd, length, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, offset=index * WINDOW)

    def _copy(self, run: list[memoryview], offset: int) -> None:
        for view in run:
            src = np.frombuffer(view, dtype=np.uint8)
            done = 0
            while done < src.size:
                index, at = divmod(offset + done, WINDOW)
                n = min(src.size - done, WINDOW - at)
                with self._lock:  # a reservation may add windows meanwhile
                    window = self._windows[index]
                dst = np.frombuffer(window, dtype=np.uint8, count=n, offset=at)
                np.copyto(dst, src[done:done + n])  # releases the GIL
                del dst, window  # a window with a view on it cannot be closed
                done += n
            offset += src.size
