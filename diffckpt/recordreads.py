"""Verified reads of a restore plan's step records, read and decoded ahead of replay.

:meth:`RecordReader.read` (what :meth:`diffckpt.runstore.RunStore.read_records` runs) yields the records
after a plan's base up to its target, in order, each checked against its segment's checksums
and the chain (each record follows the one before, each segment continues the previous one).
Small segments are read whole; a large one, on a storage that reads ranges, by its index and
then record by record, so that a restore holds records, not segments. Reads run ahead in
background threads (:mod:`diffckpt.prefetch`) within the limits below, which are module
settings read when each restore starts.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import CheckpointNotFoundError, CorruptRecordError
from .format import SegmentName
from .inventory import RestorePlan
from .prefetch import Fetched, Prefetcher, Preparer, ReadyAhead
from .segment import (
    LEAD_READ,
    SegmentIndex,
    decode_segment,
    index_length,
    lead_length,
    parse_index,
    segment_lead,
)
from .storage import Storage
from .storage.spool import ranged, read_into, read_range

if TYPE_CHECKING:  # tree imports torch, which `diffckpt ls` and `gc` do without: imported where records are read
    from .borrowing import BlockPool

__all__ = ["PREFETCH_BYTES", "PREFETCH_READY_BYTES", "PREFETCH_SEGMENTS", "PREFETCH_WORKERS", "RANGED_ABOVE",
           "ReadStats", "RecordReader"]

PREFETCH_SEGMENTS = 4
"""Segments :meth:`RecordReader.read` reads and decodes ahead of replay when not told
otherwise; 0 reads each one on the replay thread when replay reaches it. A module setting so that
a benchmark (``bench/restore.py``) can compare both through ``CheckpointEngine.restore``."""
PREFETCH_BYTES = 256 * 2**20
"""At most this many encoded bytes are read ahead of the segment being replayed (one segment is
always read, however large): the window's memory stays bounded whatever the segment size."""
PREFETCH_READY_BYTES = 64 * 2**20
"""At most this many bytes of records (their tensors and the gradients decoded from them) are
prepared for replay ahead of the record being replayed, besides the segments read ahead. A
record larger than this is prepared by replay itself when it reaches it."""
RANGED_ABOVE = 8 << 20
"""Segments larger than this are read record by record (their index first, by ranged reads),
so that a restore holds records, not segments; smaller ones are read whole, in one request."""
PREFETCH_WORKERS = 2
"""Threads that read and decode ahead. Reads wait on storage, and checksums, zstd and the copies
out of the segment release the GIL, so they overlap with replay; more threads than this slowed
replay on two cores (``bench/restore.py``)."""


@dataclass
class ReadStats:
    """What :meth:`RecordReader.read` handed its caller, for replay throughput figures."""

    bytes: int = 0  # encoded segment bytes, as stored
    segments: int = 0
    wait_s: float = 0.0  # time the caller waited for segments (records, with prepare=): what prefetch did not hide


class RecordReader:
    """Reads restore plans' records from one storage."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def fetch(self, plan: RestorePlan) -> Prefetcher[_Piece, Any]:
        """The reads of ``plan``'s records, begun now, for :meth:`read` to take (``fetching``): a
        restore has them run while it loads the base. Close it when it is not read to the end."""
        ahead = self._prefetcher(plan, PREFETCH_SEGMENTS)
        ahead.start()
        return ahead

    def read(self, plan: RestorePlan, *, prefetch: int | None = None,
             stats: ReadStats | None = None, prepare: Preparer[dict[str, Any]] | None = None,
             fetching: Prefetcher[_Piece, Any] | None = None
             ) -> Generator[tuple[dict[str, Any] | None, str | None], None, None]:
        """Yield ``(record, None)`` for each record after the base up to the target, in order.

        On damage it yields ``(None, problem)`` once and stops: the caller decides whether
        the newest good step is acceptable.

        While the caller replays one segment's records, the next ``prefetch`` segments (default
        :data:`PREFETCH_SEGMENTS`, at most :data:`PREFETCH_BYTES` ahead; 0: none) are read and
        decoded in background threads, so ``Storage.read`` may run on several threads at once.
        Results are taken in order, so records, problems and errors are those of a sequential
        read, and nothing past the segment holding the target is read. Closing the generator
        early cancels the reads not yet started. ``stats``, if given, adds up what was read.

        The tensors of a record are views of the segment it was read from where aligned
        (``borrowing.borrowing``), which they keep in memory: read them, never write them, and copy
        what outlives replay. ``fetching``: this plan's reads begun already (:meth:`fetch`).
        ``prepare`` readies each record before it is yielded (replay decodes a step's gradients):
        with prefetching and ``prepare.ahead``, in one more background thread, at most
        :data:`PREFETCH_READY_BYTES` ahead (:class:`~diffckpt.prefetch.ReadyAhead`); otherwise
        on the caller's thread.
        """
        depth = PREFETCH_SEGMENTS if prefetch is None else prefetch
        ahead = prepare is not None and prepare.ahead and depth > 0
        pairs = self._records(plan, fetching or self._prefetcher(plan, depth), stats, count_wait=not ahead)
        if prepare is None:
            yield from pairs
            return
        ready = ReadyAhead(pairs, _Pairs(prepare), PREFETCH_READY_BYTES) if ahead else None
        try:
            while True:
                waited = time.perf_counter()
                try:
                    record, problem = next(ready) if ready is not None else next(pairs)
                except StopIteration:
                    return
                if ready is None and record is not None:
                    record = prepare.prepare(record)
                elif ready is not None and stats is not None:
                    stats.wait_s += time.perf_counter() - waited
                yield record, problem
        finally:
            if ready is not None:
                ready.close()  # which closes ``pairs`` on its thread
            else:
                pairs.close()

    def _prefetcher(self, plan: RestorePlan, depth: int) -> Prefetcher[_Piece, Any]:
        """The reads of ``plan``'s records, ``depth`` segments ahead, not begun."""
        from .borrowing import BlockPool

        blocks = BlockPool()
        return Prefetcher(lambda piece: self._fetch_piece(piece, blocks), self._pieces(plan), depth,
                          max_bytes=PREFETCH_BYTES, workers=PREFETCH_WORKERS)

    def _records(self, plan: RestorePlan, ahead: Prefetcher[_Piece, Any], stats: ReadStats | None,
                 count_wait: bool) -> Generator[tuple[dict[str, Any] | None, str | None], None, None]:
        """:meth:`read` before preparation, from ``ahead``'s reads; ``count_wait``: add the time
        spent waiting for reads to ``stats.wait_s`` (not when this runs on a thread of its own)."""
        expected_after, prev = plan.base.step, plan.base.step
        problem: str | None = None
        try:
            while True:
                waited = time.perf_counter()
                try:
                    piece, result = next(ahead)
                except StopIteration:
                    return
                except (CorruptRecordError, CheckpointNotFoundError) as exc:
                    yield None, str(exc)
                    return
                if count_wait and stats is not None:
                    stats.wait_s += time.perf_counter() - waited
                seg = piece.seg
                if piece.error is not None:
                    yield None, piece.error
                    return
                if piece.span is None:  # a segment begins (read whole, or its index)
                    header, records, problem, nbytes = result
                    if stats is not None:
                        stats.bytes += nbytes
                        stats.segments += 1
                    if header.get("after") != expected_after or header.get("gen") != seg.gen:
                        yield None, f"{seg.path}: header does not continue the chain at step {expected_after}"
                        return
                    prev = expected_after
                else:
                    records = [result]
                    if stats is not None:
                        stats.bytes += piece.span[0]["length"]
                for record in records:
                    if record.get("prev") != prev:
                        yield None, f"{seg.path}: record {record.get('step')} does not follow step {prev}"
                        return
                    if record["step"] > plan.target:
                        return
                    yield record, None
                    prev = record["step"]
                if not piece.ends:
                    continue
                if prev >= plan.target:  # damage after the target does not concern it
                    return
                if problem is not None:
                    yield None, problem
                    return
                if prev != seg.last or header.get("last") != seg.last:
                    yield None, f"{seg.path}: ends at step {prev}, not at step {seg.last} as its name says"
                    return
                expected_after = seg.last
        finally:
            ahead.close()

    def _pieces(self, plan: RestorePlan) -> Iterator[tuple[_Piece, int, bool]]:
        """What :meth:`_records` fetches, in order, with the bytes each holds once read: a whole
        segment, or for a large one on a storage that reads ranges, its index (read here) and then
        each record up to the target, so that the window and replay hold records, not segments."""
        for seg in plan.through_target():
            size = plan.sizes.get(seg.path, 0)
            if size <= RANGED_ABOVE or not ranged(self.storage):
                yield _Piece(seg, ends=True), size, True
                continue
            try:
                index = self._index(seg, size)
            except (CorruptRecordError, CheckpointNotFoundError) as exc:
                yield _Piece(seg, error=str(exc)), 0, True
                return
            spans = [span for span in index.spans if span[0]["step"] <= plan.target]
            yield _Piece(seg, index=index, ends=not spans), 0, True
            for i, span in enumerate(spans):
                yield _Piece(seg, span=span, index=index, ends=i == len(spans) - 1), span[0]["length"], False
                # the index marker above carries the header; records follow it

    def _index(self, seg: SegmentName, size: int) -> SegmentIndex:
        """A segment's :class:`~diffckpt.segment.SegmentIndex` from ranged reads of its two ends."""
        head = read_range(self.storage, seg.path, 0, min(size, LEAD_READ))
        need = lead_length(head, seg.path)
        if need > len(head):
            head = read_range(self.storage, seg.path, 0, min(size, need))
        tail = read_range(self.storage, seg.path, max(0, size - LEAD_READ), size)
        if segment_lead(head, seg.path)["format"] >= 3:
            need = index_length(tail, seg.path)
            if need > len(tail):
                tail = read_range(self.storage, seg.path, max(0, size - need), size)
        return parse_index(head, tail, size, seg.path)

    def _fetch_piece(self, piece: _Piece, blocks: BlockPool) -> Any:
        """What a piece holds, read and decoded (on a prefetch thread, or the caller's): a whole
        segment as :meth:`_fetch` returns it, a segment's start (its header, no records yet, and
        the whole-segment problem), or one record read by range."""
        if piece.index is None:
            return self._fetch(piece.seg, blocks)
        if piece.span is None:
            return piece.index.header, [], piece.index.problem, 0
        from .borrowing import borrowing

        entry, offset = piece.span
        # Read straight into a recycled aligned block: the record's tensors, aligned within it
        # (``tree.pack_parts``), are then its views, with no copy (decoded in place). Recycled, as
        # fresh memory for each record cost more than the copy saved (page faults on the read,
        # unmapping on replay's thread when the last view goes), and numpy's blocks are in huge
        # pages where the kernel gives them: replay's AdamW steps at GPT-2 124M took 7.3 s over
        # those and 12.6 s over torch's 4 KiB pages (one py-spy profile each).
        blob = blocks.take(entry["length"]).numpy().data
        got = read_into(self.storage, piece.seg.path, offset, blob)
        with borrowing(blocks):
            return piece.index.decode(entry, blob[:got])

    def _fetch(self, seg: SegmentName, blocks: BlockPool) -> Fetched:
        """Read and decode one whole segment (on a prefetch thread, or the caller's); its tensors
        are views of the bytes read where 64-byte aligned, else copies into ``blocks``
        (``borrowing.borrowing``)."""
        from .borrowing import borrowing

        data = self.storage.read(seg.path)
        with borrowing(blocks):
            header, records, problem = decode_segment(data, seg.path)
        return header, records, problem, len(data)


@dataclass
class _Piece:
    """One read of a restore: a whole segment (no ``index``), a segment's start (``index``, no
    ``span``), one of its records (both), or a segment whose index could not be read (``error``).
    ``ends``: the last piece of its segment."""

    seg: SegmentName
    span: tuple[dict[str, Any], int] | None = None
    index: SegmentIndex | None = None
    ends: bool = False
    error: str | None = None


@dataclass
class _Pairs:
    """A record :class:`~diffckpt.prefetch.Preparer` over :meth:`RecordReader.read`'
    ``(record, problem)`` pairs (a problem has no record: nothing to prepare)."""

    records: Preparer[dict[str, Any]]

    @property
    def ahead(self) -> bool:
        return self.records.ahead

    def size(self, item: tuple[dict[str, Any] | None, str | None]) -> int:
        return 0 if item[0] is None else self.records.size(item[0])

    def prepare(self, item: tuple[dict[str, Any] | None, str | None]
                ) -> tuple[dict[str, Any] | None, str | None]:
        return item if item[0] is None else (self.records.prepare(item[0]), item[1])
