"""Reading a restore's segments (or, for large ones, their records) ahead of replay, and
preparing its records ahead of the optimizer, in background threads.

Replay spends its time in ``optimizer.step()``; without reading ahead, each segment's read,
checksums and zstd would add to it, and without preparing ahead, each record's gradients would be
decoded (codec payloads) between two steps. :meth:`diffckpt.recordreads.RecordReader.read` sets
the limits (``diffckpt.recordreads.PREFETCH_*``, read when each restore starts).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["THREAD_PREFIX", "Fetched", "Prefetcher", "Preparer", "ReadyAhead"]

THREAD_PREFIX = "diffckpt-prefetch"
"""What the names of every thread started here begin with."""

Fetched = tuple[dict[str, Any], list[Any], "str | None", int]  # header, records, problem, bytes
T = TypeVar("T")
K = TypeVar("K")
R = TypeVar("R")


class Prefetcher(Generic[K, R]):
    """Fetches items in order, up to ``depth`` counted items (and ``max_bytes``) ahead of the one
    the caller takes, in up to ``workers`` background threads; iterating gives ``(item, result)``.

    ``items`` yields ``(item, bytes, counted)`` lazily (it may read storage itself: a segment's
    index before its records); only ``counted`` items count against ``depth`` (whole segments, not
    the records of a segment read by range, which only the bytes bound limits). One item with
    bytes is always fetched, however large, whatever items without bytes (an index) are ahead. Replay spends its time in ``optimizer.step()``; without this, each
    read, checksums and zstd would add to it. Results are taken strictly in order and an error
    raised by a fetch reaches the caller only when it takes that item, so what the caller sees
    does not depend on ``depth``. With ``depth`` 0 each item is fetched on the caller's thread.
    """

    def __init__(self, fetch: Callable[[K], R], items: Iterable[tuple[K, int, bool]], depth: int, *,
                 max_bytes: int, workers: int) -> None:
        self.fetch = fetch
        self.max_bytes = max_bytes
        self.workers = workers
        self.items = iter(items)
        self.depth = max(0, depth)
        self.upcoming: tuple[K, int, bool] | None = None  # taken from ``items``, not submitted yet
        self.pending: deque[tuple[int, bool, Future[R], K]] = deque()  # (bytes, counted, fetch, item)
        self.taking: Future[R] | None = None  # the fetch the caller waits for
        self.pool: ThreadPoolExecutor | None = None
        self.held = 0  # bytes submitted and not taken yet: what ``max_bytes`` bounds
        self.peak = 0  # the most bytes ever held (tests account the window with it)

    def __iter__(self) -> Iterator[tuple[K, R]]:
        return self

    def start(self) -> None:
        """Begin fetching now, before the caller takes an item (a restore, while it loads its base)."""
        if self.depth:
            self._fill()

    def __next__(self) -> tuple[K, R]:
        if self.depth == 0:
            key, size, _ = self._pull()
            self.peak = max(self.peak, size)
            return key, self.fetch(key)
        self._fill()
        if not self.pending:
            raise StopIteration
        size, _, self.taking, key = self.pending.popleft()
        self.held -= size  # the window is what is ahead of the item the caller uses
        self._fill()  # it moves on while the caller waits for, then uses, this one
        return key, self.taking.result()

    def _pull(self) -> tuple[K, int, bool]:
        """The next item not submitted yet; StopIteration at the end."""
        if self.upcoming is None:
            self.upcoming = next(self.items)
        item, self.upcoming = self.upcoming, None
        return item

    def _fill(self) -> None:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(min(self.depth, self.workers), thread_name_prefix=THREAD_PREFIX)
        while True:
            if self.upcoming is None:
                try:
                    self.upcoming = next(self.items)
                except StopIteration:
                    return
            key, size, counts = self.upcoming
            counted = sum(1 for _, c, _, _ in self.pending if c)
            # ``held``, not ``pending``: a segment's index (no bytes) ahead must not stop its one
            # large record from being read while replay works on the record before it
            if (self.held and self.held + size > self.max_bytes) or (self.pending and counts and counted >= self.depth):
                return
            self.upcoming = None
            self.pending.append((size, counts, self.pool.submit(self.fetch, key), key))
            self.held += size
            self.peak = max(self.peak, self.held)

    def close(self) -> None:
        """Cancel the fetches not started. Without a fetch running, the idle threads are joined
        (they end at once); a running fetch is not waited for: it ends on its own, unused."""
        if self.pool is not None:
            reads = [future for _, _, future, _ in self.pending]
            if self.taking is not None:
                reads.append(self.taking)
            for future in reads:
                future.cancel()
            running = any(not future.done() for future in reads)  # e.g. Ctrl-C while waiting for one
            self.pool.shutdown(wait=not running, cancel_futures=True)
            self.pending.clear()
        close = getattr(self.items, "close", None)
        if close is not None:
            close()


class Preparer(Protocol[T]):
    """What :class:`ReadyAhead` runs over items. ``prepare`` must change nothing but the item it
    returns: it may run twice on an item, on another thread than the caller's."""

    @property
    def ahead(self) -> bool:
        """Whether the work is worth a thread of its own. Decoding gradients is; a few checks
        are not: handing items between threads, and the GIL the thread competes for, cost the
        caller more."""

    def size(self, item: T) -> int:
        """Bytes ``item`` holds once prepared (known before preparing it)."""

    def prepare(self, item: T) -> T:
        """``item`` ready for the caller; what it raises, the caller meets when it takes the item."""


class ReadyAhead(Generic[T]):
    """Iterates over ``source`` in a background thread and runs ``preparer.prepare`` on each
    item, at most ``max_bytes`` of items ahead of the caller (one item is always allowed); the
    caller takes them in order.

    An item larger than ``max_bytes``, or whose preparation raised, is handed over as it is and
    prepared by the caller when it takes it: what the caller sees does not depend on the thread,
    and nothing larger than the bound is built ahead. What ``source`` raises is raised to the
    caller after the items before it. :meth:`close` stops the thread, which closes ``source``
    itself (a generator can only be closed by the thread running it).
    """

    def __init__(self, source: Iterator[T], preparer: Preparer[T], max_bytes: int) -> None:
        self.source = source
        self.preparer = preparer
        self.max_bytes = max_bytes
        self.cond = threading.Condition()
        self.ready: deque[tuple[T, bool, int]] = deque()  # (item, prepared, bytes held)
        self.held = 0  # bytes of the items in ``ready``
        self.error: BaseException | None = None
        self.ended = False  # the thread is done: source exhausted, failed or closed
        self.closed = False
        self.pulling = False  # the thread waits for ``source`` (a storage read)
        self.thread: threading.Thread | None = None

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=f"{THREAD_PREFIX}-ready", daemon=True)
            self.thread.start()
        with self.cond:
            while not self.ready and not self.ended:
                self.cond.wait()
            if not self.ready:
                error, self.error = self.error, None
                if error is not None:
                    raise error
                raise StopIteration
            item, prepared, size = self.ready.popleft()
            self.held -= size
            self.cond.notify_all()
        return item if prepared else self.preparer.prepare(item)

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    if self.closed:
                        return
                    self.pulling = True
                try:
                    item = next(self.source)
                except StopIteration:
                    return
                finally:
                    with self.cond:
                        self.pulling = False
                size = self.preparer.size(item)
                with self.cond:  # room first: the bound covers what is being prepared
                    while self.held and self.held + size > self.max_bytes and not self.closed:
                        self.cond.wait()
                    if self.closed:
                        return
                prepared = size <= self.max_bytes
                if prepared:
                    try:
                        item = self.preparer.prepare(item)
                    except Exception:  # the caller prepares it again and meets the error in order
                        prepared = False
                with self.cond:
                    self.ready.append((item, prepared, size))
                    self.held += size
                    self.cond.notify_all()
        except BaseException as exc:  # handed to the caller, after the items before it
            with self.cond:
                self.error = exc
        finally:
            close = getattr(self.source, "close", None)
            if close is not None:
                close()
            with self.cond:
                self.ended = True
                self.cond.notify_all()

    def close(self) -> None:
        """Drop the items prepared ahead and stop the thread. Unless it is waiting for
        ``source`` (a storage read, which is not waited for: it ends on its own, unused), the
        thread is joined; it then has closed ``source``."""
        with self.cond:
            self.closed = True
            self.ready.clear()
            self.held = 0
            self.cond.notify_all()
            waiting = self.pulling
        if self.thread is None:
            close = getattr(self.source, "close", None)
            if close is not None:
                close()
        elif not waiting:
            self.thread.join()
