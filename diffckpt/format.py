"""Byte format of everything diffckpt writes: object names, segments, bases, commit markers.

``docs/format.md`` describes this file byte for byte; golden-file tests pin it. Bump
:data:`FORMAT_VERSION` on any incompatible change.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from typing import Any

import zstandard

from .errors import CorruptRecordError
from .tree import pack_parts, unpack_tree

__all__ = [
    "FORMAT_VERSION",
    "SEGMENT_MAGIC",
    "BaseName",
    "SegmentName",
    "base_commit",
    "decode_commit",
    "decode_segment",
    "digest_parts",
    "encode_commit",
    "encode_segment",
    "encode_segment_parts",
    "sha256",
]

FORMAT_VERSION = 1
SEGMENT_MAGIC = b"DCKSEG\x00\x01"
_DIGEST = 32
_SEG_RE = re.compile(r"^diffs/(\d{12})-(\d{12})\.g(\d{6})\.seg$", re.ASCII)
_BASE_RE = re.compile(r"^bases/(\d{12})\.g(\d{6})/COMMIT$", re.ASCII)


def sha256(data: bytes | memoryview) -> str:
    """Hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


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


Buffer = bytes | memoryview


def _compression_pays(parts: list[Buffer], compressor: zstandard.ZstdCompressor) -> bool:
    """Whether zstd shrinks a sample from the middle of a record's largest part by at least 10%.

    Dense float32 gradients shrink by only ~8% at a CPU cost that competes with training on
    small machines; RNG states, indices and low-precision payloads shrink far more.
    """
    largest = memoryview(max(parts, key=len)).cast("B")
    start = max(0, len(largest) // 2 - _SAMPLE // 2)
    sample = largest[start : start + _SAMPLE]
    return len(sample) >= _WORTHWHILE * len(compressor.compress(sample))


def digest_parts(parts: list[Buffer]) -> hashlib._Hash:
    """SHA-256 over buffers in order, as if they were concatenated."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h


def encode_segment_parts(header: dict[str, Any], records: list[Any], compression: str, level: int,
                         info: dict[str, Any] | None = None) -> list[Buffer]:
    """Pack step records into one segment, returned as buffers to write in order.

    Layout: magic (8) | u32 header length | header JSON | record blobs | SHA-256 of the first
    three (which, through the per-record digests in the header, covers everything).
    Each record blob is a :func:`pack_parts` buffer, zstd-compressed when asked, with its own
    SHA-256 in the header so a reader can keep the good records before a damaged one. Tensor
    memory is not copied unless compressed. ``compression="auto"`` compresses the segment only
    if a sample of its first record shrinks by at least 10%; the header names what was used.
    ``info`` (optional) receives the totals.
    """
    packed = [pack_parts(record) for record in records]
    compressor = zstandard.ZstdCompressor(level=level) if compression in ("zstd", "auto") else None
    if compression == "auto":
        pays = bool(packed) and compressor is not None and _compression_pays(packed[0], compressor)
        compression = "zstd" if pays else "none"
    if compression != "zstd":
        compressor = None
    blobs: list[Buffer] = []
    entries = []
    raw_total = 0
    for record, parts in zip(records, packed):
        raw_length = sum(len(p) for p in parts)
        raw_total += raw_length
        if compressor is not None:
            stream = compressor.compressobj(size=raw_length)
            parts = [b"".join([*(stream.compress(p) for p in parts), stream.flush()])]
        blobs.extend(parts)
        entries.append({"step": record["step"], "length": sum(len(p) for p in parts),
                        "raw_length": raw_length, "sha256": digest_parts(parts).hexdigest()})
    head = dict(header, format=FORMAT_VERSION, compression=compression, records=entries)
    head_bytes = json.dumps(head, separators=(",", ":"), sort_keys=True).encode()
    lead: list[Buffer] = [SEGMENT_MAGIC, struct.pack("<I", len(head_bytes)), head_bytes]
    if info is not None:
        info.update(raw_bytes=raw_total, compression=compression)
    # The header lists every blob's length and SHA-256, so hashing the lead covers the whole
    # segment while the data is hashed only once.
    return [*lead, *blobs, digest_parts(lead).digest()]


def encode_segment(header: dict[str, Any], records: list[Any], compression: str, level: int,
                   info: dict[str, Any] | None = None) -> bytes:
    """:func:`encode_segment_parts` joined into one bytes object."""
    return b"".join(encode_segment_parts(header, records, compression, level, info))


def decode_segment(data: bytes, name: str = "segment") -> tuple[dict[str, Any], list[Any], str | None]:
    """Return ``(header, good records, problem)``.

    Records are returned up to the first one whose checksum or decoding fails; ``problem`` names
    what was wrong (``None`` for an intact segment). A damaged header raises
    :class:`CorruptRecordError`.
    """
    if len(data) < len(SEGMENT_MAGIC) + 4 or data[:8] != SEGMENT_MAGIC:
        raise CorruptRecordError(f"{name}: not a diffckpt segment (bad magic or truncated)")
    (hlen,) = struct.unpack_from("<I", data, 8)
    try:
        header = json.loads(data[12 : 12 + hlen])
    except (ValueError, RecursionError):
        header = None
    entries = header.get("records") if isinstance(header, dict) else None
    if not isinstance(entries, list) or not all(_is_entry(e) for e in entries):
        raise CorruptRecordError(f"{name}: segment header is damaged or truncated")
    if header.get("format") != FORMAT_VERSION:
        raise CorruptRecordError(f"{name}: segment format {header.get('format')} is not supported")
    problem = None
    expected_size = 12 + hlen + sum(e["length"] for e in entries) + _DIGEST
    if len(data) != expected_size or hashlib.sha256(data[: 12 + hlen]).digest() != data[-_DIGEST:]:
        problem = f"{name}: segment checksum does not match (truncated or modified)"
    if header.get("compression") not in ("zstd", "none"):
        raise CorruptRecordError(f"{name}: unknown compression {header.get('compression')!r}")
    decompressor = zstandard.ZstdDecompressor() if header["compression"] == "zstd" else None
    records: list[Any] = []
    offset = 12 + hlen
    view = memoryview(data)  # blobs are views, not copies (see tree._load_tensors)
    for entry in entries:
        blob = view[offset : offset + entry["length"]]
        offset += entry["length"]
        if len(blob) != entry["length"] or sha256(blob) != entry["sha256"]:
            problem = f"{name}: record for step {entry['step']} fails its checksum"
            break
        try:
            raw = decompressor.decompress(blob, max_output_size=entry["raw_length"]) if decompressor else blob
            if len(raw) != entry["raw_length"]:
                raise CorruptRecordError(f"length {len(raw)} instead of {entry['raw_length']}")
            record = unpack_tree(raw)
            if not isinstance(record, dict) or not _is_int(record.get("step")):
                raise CorruptRecordError("not a step record")
            records.append(record)
        except (CorruptRecordError, zstandard.ZstdError) as exc:
            problem = f"{name}: record for step {entry['step']} cannot be decoded: {exc}"
            break
    return header, records, problem


def _is_entry(entry: Any) -> bool:
    """Whether a segment header's record entry has what :func:`decode_segment` reads."""
    return (isinstance(entry, dict) and _is_int(entry.get("step")) and isinstance(entry.get("sha256"), str)
            and all(_is_int(entry.get(k)) and entry[k] >= 0 for k in ("length", "raw_length")))


def encode_commit(info: dict[str, Any]) -> bytes:
    """Serialize a base's COMMIT marker (JSON, sorted keys)."""
    return json.dumps(dict(info, format=FORMAT_VERSION), indent=1, sort_keys=True).encode()


def base_commit(step: int, gen: int, fingerprint: str, parts: list[Buffer], **extra: Any) -> bytes:
    """The COMMIT marker of a base whose ``state.safetensors`` is ``parts``: its step, session,
    parameter fingerprint and the file's size and hash (``extra``: e.g. ``compacted``)."""
    size = sum(len(p) for p in parts)
    return encode_commit({"step": step, "gen": gen, "fingerprint": fingerprint, **extra,
                          "files": {"state.safetensors": {"size": size, "sha256": digest_parts(parts).hexdigest()}}})


def decode_commit(data: bytes, name: str) -> dict[str, Any]:
    """Parse a COMMIT marker, raising :class:`CorruptRecordError` if it is damaged.

    Everything readers index is checked here, explicitly (``assert`` is gone under ``python -O``),
    so that a damaged marker is a :class:`CorruptRecordError`, which the fallback to an older
    base catches, and never a ``KeyError`` or ``TypeError`` later.
    """
    try:
        info = json.loads(data)
    except (ValueError, RecursionError):  # not JSON (UnicodeDecodeError is a ValueError)
        info = None
    problem = _commit_problem(info)
    if problem is not None:
        raise CorruptRecordError(f"{name}: COMMIT marker is damaged or of an unknown format ({problem})")
    return info


def _commit_problem(info: Any) -> str | None:
    """What is wrong with a parsed COMMIT marker, or ``None``."""
    if not isinstance(info, dict):
        return "not a JSON object"
    if not _is_int(info.get("format")) or info["format"] != FORMAT_VERSION:
        return f"format {info.get('format')!r}, expected {FORMAT_VERSION}"
    for key in ("step", "gen"):
        if not _is_int(info.get(key)) or info[key] < 0:
            return f"{key} {info.get(key)!r} is not a step or session number"
    files = info.get("files")
    state = files.get("state.safetensors") if isinstance(files, dict) else None
    if not isinstance(state, dict):
        return "files lists no state.safetensors"
    if not _is_int(state.get("size")) or state["size"] < 0 or not isinstance(state.get("sha256"), str):
        return "state.safetensors has no size and sha256"
    if info.get("fingerprint") is not None and not isinstance(info["fingerprint"], str):
        return "fingerprint is not a string"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
