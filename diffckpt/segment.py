"""The segment container: a session's step records after a step, as one object (format 3,
read in every format).

Layout (``docs/format.md`` section 4): magic | u32 lead length | lead JSON | record blobs | index
JSON | u32 index length | XXH3-128 of lead and index. :class:`SegmentEncoder` writes one record
at a time; :func:`parse_index` reads a segment's two ends (ranged reads), :func:`decode_segment`
a whole one.
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zstandard

from .checksums import Algorithm, Buffer
from .errors import CorruptRecordError
from .format import CHECKSUMS, FORMAT_VERSION, checksum_for, is_int

__all__ = [
    "LEAD_READ",
    "SEGMENT_MAGIC",
    "ZSTD_THREADS",
    "Blob",
    "SegmentEncoder",
    "SegmentIndex",
    "decode_segment",
    "encode_segment",
    "encode_segment_parts",
    "index_length",
    "lead_length",
    "parse_index",
    "segment_lead",
    "zstd_shortens",
]

# Unchanged in format 2: the version that governs decoding is the header's ``format`` key, read
# before anything that depends on it (the digest key, the trailer's size). One magic for every
# version also gives older readers nothing worse to say than they would about a new magic.
SEGMENT_MAGIC = b"DCKSEG\x00\x01"

_SAMPLE = 1 << 18
_WORTHWHILE = 1.1


def _zstd_threads() -> int:
    """zstd's worker threads for a record: half the cores, at most 8 (on 16 cores, 4 threads
    compressed about 3.4 times as fast as one, 8 hardly more), none below 4 cores, where a worker
    only adds its handoff (2 cores: one worker compressed at two thirds of the caller's rate)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return 0 if cores < 4 else min(8, cores // 2)


ZSTD_THREADS = _zstd_threads()


def zstd_shortens(raw: int, packed: int, seconds: float, write_rate: float | None) -> bool:
    """Whether zstd shortens writing data like a sample of ``raw`` bytes that compressed to
    ``packed`` bytes in ``seconds``, to a target that takes ``write_rate`` bytes per second.

    It must shrink the sample by at least 10% (dense float32 gradients shrink by ~8%; RNG states,
    indices and low-precision payloads far more), and compressing must cost less time than
    writing the bytes it saves: ``seconds < (raw - packed) / write_rate``. That is the rule
    "zstd's throughput above the target's bandwidth" made exact for a record that is compressed
    and then written: at a ratio ``r`` zstd must run ``r / (r - 1)`` times as fast as the target
    (at 1.29, bfloat16 gradients', 4.4 times). The sample is compressed on one thread, so with
    :data:`ZSTD_THREADS` workers the records compress faster than it says: the rule errs towards
    writing them raw. ``write_rate=None`` (a target whose rate could not be measured): the ratio
    alone decides."""
    if raw < _WORTHWHILE * packed:
        return False
    return write_rate is None or seconds * write_rate < raw - packed


def _decide(parts: list[Buffer], level: int, write_rate: float | None, clock: Callable[[], float]) -> str:
    """``"zstd"`` or ``"none"`` for a segment, from a sample from the middle of its first
    record's largest part, compressed and timed here (:func:`zstd_shortens`)."""
    largest = memoryview(max(parts, key=len)).cast("B")
    start = max(0, len(largest) // 2 - _SAMPLE // 2)
    sample = largest[start : start + _SAMPLE]
    compressor = zstandard.ZstdCompressor(level=level)
    began = clock()
    packed = len(compressor.compress(sample))
    return "zstd" if zstd_shortens(len(sample), packed, clock() - began, write_rate) else "none"


@dataclass
class Blob:
    """A record encoded and not yet hashed: its stored bytes (compressed or the tree buffer's
    parts as views of the tensors), preceded in :attr:`parts` by the segment's lead for its
    first record."""

    step: int
    lead: bytes | None
    stored: list[Buffer]
    raw_length: int

    @property
    def parts(self) -> list[Buffer]:
        """What to append, in order."""
        return [self.lead, *self.stored] if self.lead is not None else self.stored

    @property
    def length(self) -> int:
        return sum(len(p) for p in self.stored)


class SegmentEncoder:
    """Encodes one segment record by record, as the writer receives them (format 3).

    :meth:`add` returns the bytes to append for each record (the lead first, with the first
    record); :meth:`tail` the index and trailer that end the segment. Nothing of an earlier record
    is kept but its index entry, so a segment of any size is written with one record in memory.
    The writer splits :meth:`add` in two, :meth:`encode` and :meth:`added`, to hash a record
    (:meth:`checksum`) while its bytes are written.

    ``compression="auto"`` is decided on a sample of the first record (:func:`zstd_shortens`:
    zstd only where it shrinks the sample by at least 10% and shortens the write to a target
    that takes ``write_rate()`` bytes per second); ``decided`` carries a decision over from a
    segment whose records move on. ``clock`` times the sample (tests pass their own).
    """

    def __init__(self, header: dict[str, Any], compression: str, level: int, decided: str | None = None,
                 write_rate: Callable[[], float | None] = lambda: None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.header = header
        self.level = level
        self.compression = decided if decided is not None else (None if compression == "auto" else compression)
        if self.compression not in (None, "zstd", "none"):
            raise ValueError(f"unknown compression {compression!r}")
        self.write_rate = write_rate
        self.clock = clock
        self.compressor: zstandard.ZstdCompressor | None = None
        self.lead: bytes | None = None
        self.entries: list[dict[str, Any]] = []
        self.raw_bytes = 0
        self.stored_bytes = 0

    def add(self, record: Any) -> list[Buffer]:
        """The buffers that append ``record``'s blob (preceded, for the first, by the lead).
        Tensor memory is not copied unless compressed."""
        blob = self.encode(record)
        self.added(blob, self.checksum(blob))
        return blob.parts

    def encode(self, record: Any) -> Blob:
        """``record`` packed (views of its tensors) and compressed if the segment is; the lead
        made first, with the first record, once the compression is decided."""
        # torch: `diffckpt ls` and `gc` read names and commits without it
        from .tree import pack_parts

        parts = pack_parts(record)
        lead = None
        if self.lead is None:
            if self.compression is None:
                self.compression = _decide(parts, self.level, self.write_rate(), self.clock)
            lead = self.start()
        raw_length = sum(len(p) for p in parts)
        if self.compression == "zstd":
            if self.compressor is None:  # zstd's workers compress with the GIL released
                self.compressor = zstandard.ZstdCompressor(level=self.level, threads=ZSTD_THREADS)
            stream = self.compressor.compressobj(size=raw_length)  # one frame, its size in its header
            parts = [piece for piece in (*(stream.compress(p) for p in parts), stream.flush()) if piece]
        return Blob(record["step"], lead, parts, raw_length)

    @staticmethod
    def checksum(blob: Blob) -> str:
        """The hex digest of ``blob``'s stored bytes (XXH3-128, without a copy)."""
        return CHECKSUMS[FORMAT_VERSION].hash_parts(blob.stored).hexdigest()

    def added(self, blob: Blob, checksum: str) -> None:
        """``blob`` is in the segment: its index entry, with its :meth:`checksum`."""
        length = blob.length
        self.entries.append({"step": blob.step, "length": length, "raw_length": blob.raw_length,
                             CHECKSUMS[FORMAT_VERSION].key: checksum})
        self.raw_bytes += blob.raw_length
        self.stored_bytes += length

    def start(self) -> bytes:
        """The lead, which begins the segment (its compression decided by then)."""
        self.compression = self.compression or "none"
        self.lead = self._lead()
        return self.lead

    def _lead(self) -> bytes:
        lead = dict(self.header, format=FORMAT_VERSION, compression=self.compression)
        body = json.dumps(lead, separators=(",", ":"), sort_keys=True).encode()
        return SEGMENT_MAGIC + struct.pack("<I", len(body)) + body

    def tail(self, entries: list[dict[str, Any]] | None = None, **index: Any) -> bytes:
        """The end of a segment holding ``entries`` (default: every record added): the index
        JSON (``records`` and ``index``, e.g. ``last``), its length and the XXH3-128 of the lead
        and the index, which through the per-record digests covers every byte."""
        # a segment without records (never written by the writer) has no lead yet
        lead = self.lead if self.lead is not None else self.start()
        body = json.dumps(dict(index, records=self.entries if entries is None else entries),
                          separators=(",", ":"), sort_keys=True).encode()
        end = body + struct.pack("<I", len(body))
        return end + CHECKSUMS[FORMAT_VERSION].hash_parts([lead, end]).digest()


def encode_segment_parts(header: dict[str, Any], records: list[Any], compression: str, level: int,
                         info: dict[str, Any] | None = None) -> list[Buffer]:
    """Pack step records into one segment (format 3), returned as buffers to write in order.

    Layout (``docs/format.md`` section 4): magic (8) | u32 lead length | lead JSON | record blobs
    | index JSON | u32 index length | XXH3-128 of lead and index. ``header`` holds ``gen``,
    ``after`` and ``last``; ``last`` goes to the index, written once the records are known.
    ``info`` (optional) receives the totals.
    """
    lead = {k: v for k, v in header.items() if k != "last"}
    encoder = SegmentEncoder(lead, compression, level)
    parts: list[Buffer] = []
    for record in records:
        parts.extend(encoder.add(record))
    index = {"last": header["last"]} if "last" in header else {}
    tail = encoder.tail(**index)
    if info is not None:
        info.update(raw_bytes=encoder.raw_bytes, compression=encoder.compression)
    return [*parts, tail] if parts else [encoder.lead or b"", tail]


def encode_segment(header: dict[str, Any], records: list[Any], compression: str, level: int,
                   info: dict[str, Any] | None = None) -> bytes:
    """:func:`encode_segment_parts` joined into one bytes object."""
    return b"".join(encode_segment_parts(header, records, compression, level, info))


@dataclass
class SegmentIndex:
    """What a segment's header and index say (any format): the merged header (``after``,
    ``gen``, ``last``, ``compression``, ``format``, ``records``), where each record's blob lies
    (``spans``: offset and length), and a problem with the whole (``None`` when intact)."""

    header: dict[str, Any]
    spans: list[tuple[dict[str, Any], int]]
    problem: str | None
    name: str

    @property
    def algorithm(self) -> Algorithm:
        return CHECKSUMS[self.header["format"]]

    def decode(self, entry: dict[str, Any], blob: Buffer) -> Any:
        """The record of ``entry`` from its stored blob; raises :class:`CorruptRecordError`
        naming the step when the blob fails its checksum or cannot be decoded."""
        from .tree import unpack_tree  # torch, as in SegmentEncoder.add

        algorithm = self.algorithm
        if len(blob) != entry["length"] or algorithm.hexdigest(blob) != entry[algorithm.key]:
            raise CorruptRecordError(f"{self.name}: record for step {entry['step']} fails its checksum")
        try:
            if self.header["compression"] == "zstd":
                raw: Buffer = zstandard.ZstdDecompressor().decompress(blob, max_output_size=entry["raw_length"])
            else:
                raw = blob
            if len(raw) != entry["raw_length"]:
                raise CorruptRecordError(f"length {len(raw)} instead of {entry['raw_length']}")
            record = unpack_tree(raw)
            if not isinstance(record, dict) or not is_int(record.get("step")):
                raise CorruptRecordError("not a step record")
        except (CorruptRecordError, zstandard.ZstdError) as exc:
            raise CorruptRecordError(f"{self.name}: record for step {entry['step']} cannot be decoded: {exc}") from None
        return record


LEAD_READ = 4096
"""Bytes a ranged reader reads first from each end of a format-3 segment: the lead and the index
of a segment fit in them unless it holds thousands of records (then it reads the rest)."""


def lead_length(head: bytes, name: str) -> int:
    """Bytes of the lead (magic, its length and the JSON) from the first bytes of a segment."""
    if len(head) < len(SEGMENT_MAGIC) + 4 or head[:8] != SEGMENT_MAGIC:
        raise CorruptRecordError(f"{name}: not a diffckpt segment (bad magic or truncated)")
    return 12 + struct.unpack_from("<I", head, 8)[0]


def segment_lead(head: bytes, name: str) -> dict[str, Any]:
    """The lead JSON of a segment (the header of formats 1 and 2) from its first bytes (at least
    :func:`lead_length`), its ``format`` checked first: a newer format is named as such, not
    taken for damage."""
    hlen = lead_length(head, name) - 12
    try:
        lead = json.loads(head[12 : 12 + hlen])
    except (ValueError, RecursionError):
        lead = None
    if not isinstance(lead, dict) or not is_int(lead.get("format")):
        raise CorruptRecordError(f"{name}: segment header is damaged or truncated")
    checksum_for(lead["format"], f"{name}: segment")
    return lead


def index_length(tail: bytes, name: str, digest_size: int = 16) -> int:
    """Bytes of a format-3 segment's end (index JSON, its length, the digest) from its last bytes."""
    if len(tail) < 4 + digest_size:
        raise CorruptRecordError(f"{name}: segment index is damaged or truncated")
    return struct.unpack_from("<I", tail, len(tail) - digest_size - 4)[0] + 4 + digest_size


def parse_index(head: bytes, tail: bytes, size: int, name: str = "segment") -> SegmentIndex:
    """The :class:`SegmentIndex` of a segment of ``size`` bytes from its lead (``head``, at
    least :func:`lead_length` bytes) and, for format 3, its end (``tail``, at least
    :func:`index_length` bytes; ignored for formats 1 and 2, whose header holds the index).

    A damaged lead or index, or one of a format version this diffckpt does not read, raises
    :class:`CorruptRecordError`; a size or whole-segment checksum that does not match is the
    ``problem`` (records that pass their own checksum stay usable).
    """
    lead = segment_lead(head, name)
    hlen = lead_length(head, name) - 12
    algorithm = CHECKSUMS[lead["format"]]
    size_d = algorithm.digest_size
    problem = None
    if lead["format"] >= 3:
        end = index_length(tail, name, size_d)
        if end > len(tail) or end > size - 12 - hlen:
            raise CorruptRecordError(f"{name}: segment index is damaged or truncated")
        body = tail[len(tail) - end : len(tail) - 4 - size_d]
        try:
            index = json.loads(body)
        except (ValueError, RecursionError):
            index = None
        if not isinstance(index, dict) or not isinstance(index.get("records"), list):
            raise CorruptRecordError(f"{name}: segment index is damaged or truncated")
        header = {**index, **lead}  # the lead's keys (format, compression) decided how to read
        covered = [head[: 12 + hlen], tail[len(tail) - end : len(tail) - size_d]]
        trailer = tail[len(tail) - size_d :]
    else:
        if not isinstance(lead.get("records"), list):
            raise CorruptRecordError(f"{name}: segment header is damaged or truncated")
        header, end = lead, size_d
        covered = [head[: 12 + hlen]]
        trailer = tail[len(tail) - size_d :] if len(tail) >= size_d else b""
    entries = header["records"]
    if not all(_is_entry(e, algorithm.key) for e in entries):
        # the entries are in the index from format 3 on: name the part that is damaged
        part = "index" if lead["format"] >= 3 else "header"
        raise CorruptRecordError(f"{name}: segment {part} is damaged or truncated")
    if header.get("compression") not in ("zstd", "none"):
        raise CorruptRecordError(f"{name}: unknown compression {header.get('compression')!r}")
    if size != 12 + hlen + sum(e["length"] for e in entries) + end or algorithm.hash_parts(covered).digest() != trailer:
        problem = f"{name}: segment checksum does not match (truncated or modified)"
    spans, offset = [], 12 + hlen
    for entry in entries:
        spans.append((entry, offset))
        offset += entry["length"]
    return SegmentIndex(header, spans, problem, name)


def decode_segment(data: bytes, name: str = "segment") -> tuple[dict[str, Any], list[Any], str | None]:
    """Return ``(header, good records, problem)`` of a whole segment of any readable format.

    Records are returned up to the first one whose checksum or decoding fails; ``problem`` names
    what was wrong (``None`` for an intact segment). A damaged header or index, or one of a
    format version this diffckpt does not read, raises :class:`CorruptRecordError`. Each format
    version is verified with its own hash algorithm (:data:`CHECKSUMS`).
    """
    view = memoryview(data)  # blobs are views, not copies (see tree._load_tensors)
    index = parse_index(data, data, len(data), name)
    problem = index.problem
    records: list[Any] = []
    for entry, offset in index.spans:
        try:
            records.append(index.decode(entry, view[offset : offset + entry["length"]]))
        except CorruptRecordError as exc:
            problem = str(exc)
            break
    return index.header, records, problem


def _is_entry(entry: Any, key: str) -> bool:
    """Whether a segment header's record entry has what :func:`decode_segment` reads (its digest
    under ``key``, the format's algorithm)."""
    return (isinstance(entry, dict) and is_int(entry.get("step")) and isinstance(entry.get(key), str)
            and all(is_int(entry.get(k)) and entry[k] >= 0 for k in ("length", "raw_length")))
