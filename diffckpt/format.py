"""Byte format of everything diffckpt writes: object names, segments, bases, commit markers.

``docs/format.md`` describes this file byte for byte; golden-file tests pin it. Bump
:data:`FORMAT_VERSION` on any incompatible change. Writers write the current version only;
readers accept every version in :data:`CHECKSUMS`, each verified with its own hash algorithm.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import Any

import zstandard

from .checksums import SHA256, XXH3_128, Algorithm, Buffer
from .errors import CorruptRecordError

__all__ = [
    "CHECKSUMS",
    "FORMAT_VERSION",
    "LEAD_READ",
    "SEGMENT_MAGIC",
    "BaseName",
    "SegmentEncoder",
    "SegmentIndex",
    "SegmentName",
    "base_commit",
    "checksum_for",
    "decode_commit",
    "decode_segment",
    "encode_commit",
    "encode_segment",
    "encode_segment_parts",
    "index_length",
    "lead_length",
    "parse_index",
    "segment_lead",
    "state_entry",
]

FORMAT_VERSION = 3
CHECKSUMS: dict[int, Algorithm] = {1: SHA256, 2: XXH3_128, 3: XXH3_128}
"""The hash algorithm of each format version readers accept (format 1: SHA-256, formats 2 and 3:
XXH3-128); its ``key`` names the digests in segment headers and COMMIT markers. Format 3 moved a
segment's index to its end, so that a segment is written as its records arrive."""
# Unchanged in format 2: the version that governs decoding is the header's ``format`` key, read
# before anything that depends on it (the digest key, the trailer's size). One magic for every
# version also gives older readers nothing worse to say than they would about a new magic.
SEGMENT_MAGIC = b"DCKSEG\x00\x01"
_SEG_RE = re.compile(r"^diffs/(\d{12})-(\d{12})\.g(\d{6})\.seg$", re.ASCII)
_BASE_RE = re.compile(r"^bases/(\d{12})\.g(\d{6})/COMMIT$", re.ASCII)


def checksum_for(version: Any, name: str) -> Algorithm:
    """The hash algorithm of format ``version``, which ``name`` (e.g. ``"x.seg: segment"``) has.

    Raises:
        CorruptRecordError: naming the version, when this diffckpt does not read it.
    """
    if _is_int(version) and version in CHECKSUMS:
        return CHECKSUMS[version]
    *earlier, newest = sorted(CHECKSUMS)  # "formats 1, 2 and 3": a sentence a user reads
    readable = f"{', '.join(map(str, earlier))} and {newest}" if earlier else str(newest)
    raise CorruptRecordError(
        f"{name} format {version!r} is not one this diffckpt reads (formats {readable}); it was "
        "written by a newer diffckpt (upgrade diffckpt to read it) or it is damaged")


@dataclass(frozen=True, order=True)
class SegmentName:
    """``diffs/<after>-<last>.g<gen>.seg``: the step records of session ``gen`` that follow step
    ``after`` up to and including step ``last``. The next segment of the chain has
    ``after == last``; a base at step ``b`` continues with the segment whose ``after == b``."""

    after: int
    last: int
    gen: int

    @property
    def path(self) -> str:
        return f"diffs/{self.after:012d}-{self.last:012d}.g{self.gen:06d}.seg"

    @classmethod
    def parse(cls, path: str) -> SegmentName | None:
        m = _SEG_RE.match(path)
        return cls(int(m[1]), int(m[2]), int(m[3])) if m else None


@dataclass(frozen=True, order=True)
class BaseName:
    """``bases/<step>.g<gen>/``: a full snapshot; committed once its ``COMMIT`` exists."""

    step: int
    gen: int

    @property
    def dir(self) -> str:
        return f"bases/{self.step:012d}.g{self.gen:06d}"

    @property
    def commit_path(self) -> str:
        return f"{self.dir}/COMMIT"

    @property
    def state_path(self) -> str:
        return f"{self.dir}/state.safetensors"

    @classmethod
    def parse(cls, path: str) -> BaseName | None:
        m = _BASE_RE.match(path)
        return cls(int(m[1]), int(m[2])) if m else None


_SAMPLE = 1 << 18
_WORTHWHILE = 1.1


def _compression_pays(parts: list[Buffer], compressor: zstandard.ZstdCompressor) -> bool:
    """Whether zstd shrinks a sample from the middle of a record's largest part by at least 10%.

    Dense float32 gradients shrink by only ~8% at a CPU cost that competes with training on
    small machines; RNG states, indices and low-precision payloads shrink far more.
    """
    largest = memoryview(max(parts, key=len)).cast("B")
    start = max(0, len(largest) // 2 - _SAMPLE // 2)
    sample = largest[start : start + _SAMPLE]
    return len(sample) >= _WORTHWHILE * len(compressor.compress(sample))


class SegmentEncoder:
    """Encodes one segment record by record, as the writer receives them (format 3).

    :meth:`add` returns the bytes to append for each record (the lead first, with the first
    record); :meth:`tail` the index and trailer that end the segment. Nothing of an earlier record
    is kept but its index entry, so a segment of any size is written with one record in memory.
    ``compression="auto"`` is decided on a sample of the first record (zstd only if it shrinks by
    at least 10%); ``decided`` carries a decision over from a segment whose records move on.
    """

    def __init__(self, header: dict[str, Any], compression: str, level: int, decided: str | None = None) -> None:
        self.header = header
        self.level = level
        self.compression = decided if decided is not None else (None if compression == "auto" else compression)
        if self.compression not in (None, "zstd", "none"):
            raise ValueError(f"unknown compression {compression!r}")
        self.compressor = zstandard.ZstdCompressor(level=level)
        self.lead: bytes | None = None
        self.entries: list[dict[str, Any]] = []
        self.raw_bytes = 0
        self.stored_bytes = 0

    def add(self, record: Any) -> list[Buffer]:
        """The buffers that append ``record``'s blob (preceded, for the first, by the lead).
        Tensor memory is not copied unless compressed."""
        # torch: `diffckpt ls` and `gc` read names and commits without it
        from .tree import pack_parts

        parts = pack_parts(record)
        out: list[Buffer] = []
        if self.lead is None:
            if self.compression is None:
                self.compression = "zstd" if _compression_pays(parts, self.compressor) else "none"
            out.append(self.start())
        raw_length = sum(len(p) for p in parts)
        if self.compression == "zstd":
            stream = self.compressor.compressobj(size=raw_length)
            parts = [b"".join([*(stream.compress(p) for p in parts), stream.flush()])]
        self.entries.append(self.entry(record["step"], parts, raw_length))
        self.raw_bytes += raw_length
        self.stored_bytes += sum(len(p) for p in parts)
        return [*out, *parts]

    @staticmethod
    def entry(step: int, parts: list[Buffer], raw_length: int) -> dict[str, Any]:
        algorithm = CHECKSUMS[FORMAT_VERSION]
        return {"step": step, "length": sum(len(p) for p in parts), "raw_length": raw_length,
                algorithm.key: algorithm.hash_parts(parts).hexdigest()}

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
            if not isinstance(record, dict) or not _is_int(record.get("step")):
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
    if not isinstance(lead, dict) or not _is_int(lead.get("format")):
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
    return (isinstance(entry, dict) and _is_int(entry.get("step")) and isinstance(entry.get(key), str)
            and all(_is_int(entry.get(k)) and entry[k] >= 0 for k in ("length", "raw_length")))


def encode_commit(info: dict[str, Any]) -> bytes:
    """Serialize a base's COMMIT marker (JSON, sorted keys)."""
    return json.dumps(dict(info, format=FORMAT_VERSION), indent=1, sort_keys=True).encode()


def state_entry(parts: list[Buffer]) -> dict[str, Any]:
    """A COMMIT marker's ``files`` entry of a file whose bytes are ``parts``: its size and its
    hash in the current format (``{"size", "xxh3_128"}``)."""
    algorithm = CHECKSUMS[FORMAT_VERSION]
    return {"size": sum(len(p) for p in parts), algorithm.key: algorithm.hash_parts(parts).hexdigest()}


def base_commit(step: int, gen: int, fingerprint: str, parts: list[Buffer], **extra: Any) -> bytes:
    """The COMMIT marker of a base whose ``state.safetensors`` is ``parts``: its step, session,
    parameter fingerprint and the file's size and hash (``extra``: e.g. ``compacted``)."""
    return encode_commit({"step": step, "gen": gen, "fingerprint": fingerprint, **extra,
                          "files": {"state.safetensors": state_entry(parts)}})


def decode_commit(data: bytes, name: str) -> dict[str, Any]:
    """Parse a COMMIT marker, raising :class:`CorruptRecordError` if it is damaged.

    Everything readers index is checked here, explicitly (``assert`` is gone under ``python -O``),
    so that a damaged marker is a :class:`CorruptRecordError`, which the fallback to an older
    base catches, and never a ``KeyError`` or ``TypeError`` later. A marker of a format version
    this diffckpt does not read is refused with a message naming it.
    """
    try:
        info = json.loads(data)
    except (ValueError, RecursionError):  # not JSON (UnicodeDecodeError is a ValueError)
        info = None
    if isinstance(info, dict) and _is_int(info.get("format")):
        checksum_for(info["format"], f"{name}: COMMIT marker")  # raises for a version not read here
    problem = _commit_problem(info)
    if problem is not None:
        raise CorruptRecordError(f"{name}: COMMIT marker is damaged or of an unknown format ({problem})")
    return info


def _commit_problem(info: Any) -> str | None:
    """What is wrong with a parsed COMMIT marker of a readable format version, or ``None``."""
    if not isinstance(info, dict):
        return "not a JSON object"
    if not _is_int(info.get("format")):
        return f"format {info.get('format')!r} is not a version number"
    for key in ("step", "gen"):
        if not _is_int(info.get(key)) or info[key] < 0:
            return f"{key} {info.get(key)!r} is not a step or session number"
    files = info.get("files")
    state = files.get("state.safetensors") if isinstance(files, dict) else None
    if not isinstance(state, dict):
        return "files lists no state.safetensors"
    key = CHECKSUMS[info["format"]].key
    if not _is_int(state.get("size")) or state["size"] < 0 or not isinstance(state.get(key), str):
        return f"state.safetensors has no size and {key}"
    if info.get("fingerprint") is not None and not isinstance(info["fingerprint"], str):
        return "fingerprint is not a string"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
