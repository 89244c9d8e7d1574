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
    "SEGMENT_MAGIC",
    "BaseName",
    "SegmentName",
    "base_commit",
    "checksum_for",
    "decode_commit",
    "decode_segment",
    "encode_commit",
    "encode_segment",
    "encode_segment_parts",
    "state_entry",
]

FORMAT_VERSION = 2
CHECKSUMS: dict[int, Algorithm] = {1: SHA256, 2: XXH3_128}
"""The hash algorithm of each format version readers accept (format 1: SHA-256, format 2:
XXH3-128); its ``key`` names the digests in segment headers and COMMIT markers."""
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
    readable = " and ".join(str(v) for v in sorted(CHECKSUMS))
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


def encode_segment_parts(header: dict[str, Any], records: list[Any], compression: str, level: int,
                         info: dict[str, Any] | None = None) -> list[Buffer]:
    """Pack step records into one segment, returned as buffers to write in order.

    Layout: magic (8) | u32 header length | header JSON | record blobs | XXH3-128 of the first
    three (which, through the per-record digests in the header, covers everything).
    Each record blob is a :func:`pack_parts` buffer, zstd-compressed when asked, with its own
    XXH3-128 in the header so a reader can keep the good records before a damaged one. Tensor
    memory is not copied unless compressed. ``compression="auto"`` compresses the segment only
    if a sample of its first record shrinks by at least 10%; the header names what was used.
    ``info`` (optional) receives the totals.
    """
    algorithm = CHECKSUMS[FORMAT_VERSION]
    from .tree import pack_parts  # torch: `diffckpt ls` and `gc` read names and commits without it

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
                        "raw_length": raw_length, algorithm.key: algorithm.hash_parts(parts).hexdigest()})
    head = dict(header, format=FORMAT_VERSION, compression=compression, records=entries)
    head_bytes = json.dumps(head, separators=(",", ":"), sort_keys=True).encode()
    lead: list[Buffer] = [SEGMENT_MAGIC, struct.pack("<I", len(head_bytes)), head_bytes]
    if info is not None:
        info.update(raw_bytes=raw_total, compression=compression)
    # The header lists every blob's length and digest, so hashing the lead covers the whole
    # segment while the data is hashed only once.
    return [*lead, *blobs, algorithm.hash_parts(lead).digest()]


def encode_segment(header: dict[str, Any], records: list[Any], compression: str, level: int,
                   info: dict[str, Any] | None = None) -> bytes:
    """:func:`encode_segment_parts` joined into one bytes object."""
    return b"".join(encode_segment_parts(header, records, compression, level, info))


def decode_segment(data: bytes, name: str = "segment") -> tuple[dict[str, Any], list[Any], str | None]:
    """Return ``(header, good records, problem)``.

    Records are returned up to the first one whose checksum or decoding fails; ``problem`` names
    what was wrong (``None`` for an intact segment). A damaged header, or one of a format
    version this diffckpt does not read, raises :class:`CorruptRecordError`. Each format version
    is verified with its own hash algorithm (:data:`CHECKSUMS`).
    """
    from .tree import unpack_tree  # torch, as in encode_segment_parts
    if len(data) < len(SEGMENT_MAGIC) + 4 or data[:8] != SEGMENT_MAGIC:
        raise CorruptRecordError(f"{name}: not a diffckpt segment (bad magic or truncated)")
    (hlen,) = struct.unpack_from("<I", data, 8)
    try:
        header = json.loads(data[12 : 12 + hlen])
    except (ValueError, RecursionError):
        header = None
    if (not isinstance(header, dict) or not _is_int(header.get("format"))
            or not isinstance(header.get("records"), list)):
        raise CorruptRecordError(f"{name}: segment header is damaged or truncated")
    # The version decides what the entries hold, so it is checked first: a newer format is
    # named as such, not taken for damage.
    algorithm = checksum_for(header["format"], f"{name}: segment")
    entries = header["records"]
    if not all(_is_entry(e, algorithm.key) for e in entries):
        raise CorruptRecordError(f"{name}: segment header is damaged or truncated")
    problem = None
    size = algorithm.digest_size
    expected_size = 12 + hlen + sum(e["length"] for e in entries) + size
    if len(data) != expected_size or algorithm.digest(data[: 12 + hlen]) != data[-size:]:
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
        if len(blob) != entry["length"] or algorithm.hexdigest(blob) != entry[algorithm.key]:
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
