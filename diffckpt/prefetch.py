"""Reading a restore's segments ahead of replay, in background threads.

Replay spends its time in ``optimizer.step()``; without reading ahead, each segment's read,
checksums and zstd would add to it. :meth:`diffckpt.runstore.RunStore.read_records` sets the
limits (``diffckpt.runstore.PREFETCH_*``, read when each restore starts).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .format import SegmentName

__all__ = ["Fetched", "Prefetcher"]

Fetched = tuple[dict[str, Any], list[Any], "str | None", int]  # header, records, problem, bytes


class Prefetcher:
    """Reads and decodes segments in order, up to ``depth`` of them (and ``max_bytes``) ahead of
    the one the caller takes, in up to ``workers`` background threads.

    Replay spends its time in ``optimizer.step()``; without this, each segment's read, checksums
    and zstd would add to it. Results are taken strictly in order and an error raised by a read
    reaches the caller only when it takes that segment, so what the caller sees does not depend
    on ``depth``. With ``depth`` 0, or a single segment, each is read on the caller's thread.
    """

    def __init__(self, fetch: Callable[[SegmentName], Fetched], segments: list[SegmentName],
                 sizes: dict[str, int], depth: int, *, max_bytes: int, workers: int) -> None:
        self.fetch = fetch
        self.max_bytes = max_bytes
        self.workers = workers
        self.segments = segments
        self.sizes = sizes
        self.depth = max(0, depth) if len(segments) > 1 else 0
        self.next = 0  # index of the next segment to submit (or, without threads, to read)
        self.pending: deque[tuple[int, Future[Fetched]]] = deque()  # (bytes, read) in order
        self.taking: Future[Fetched] | None = None  # the read the caller waits for
        self.pool: ThreadPoolExecutor | None = None

    def take(self) -> Fetched:
        """The next segment, read and decoded; what the read raised, raised here."""
        if self.depth == 0:
            self.next += 1
            return self.fetch(self.segments[self.next - 1])
        self._fill()
        _, self.taking = self.pending.popleft()
        self._fill()  # the window moves on while the caller waits for, then replays, this one
        return self.taking.result()

    def _fill(self) -> None:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(min(self.depth, self.workers),
                                           thread_name_prefix="diffckpt-prefetch")
        ahead = sum(n for n, _ in self.pending)
        while self.next < len(self.segments) and len(self.pending) < self.depth:
            seg = self.segments[self.next]
            size = self.sizes.get(seg.path, 0)
            if self.pending and ahead + size > self.max_bytes:
                return
            self.pending.append((size, self.pool.submit(self.fetch, seg)))
            ahead += size
            self.next += 1

    def close(self) -> None:
        """Cancel the reads not started. Without a read running, the idle threads are joined
        (they end at once); a running read is not waited for: it ends on its own, unused."""
        if self.pool is None:
            return
        reads = [future for _, future in self.pending]
        if self.taking is not None:
            reads.append(self.taking)
        for future in reads:
            future.cancel()
        running = any(not future.done() for future in reads)  # e.g. Ctrl-C while waiting for one
        self.pool.shutdown(wait=not running, cancel_futures=True)
        self.pending.clear()
