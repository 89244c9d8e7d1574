"""Byte format of everything diffckpt writes: object names, format versions and their hash
algorithms, bases' commit markers (segments: ``segment.py``).

``docs/format.md`` describes these bytes; golden-file tests pin them. Bump
:data:`FORMAT_VERSION` on any incompatible change. Writers write the current version only;
readers accept every version in :data:`CHECKSUMS`, each verified with its own hash algorithm.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from .checksums import SHA256, XXH3_128, Algorithm, Buffer
from .errors import CorruptRecordError

__all__ = [
    "CHECKSUMS",
    "FORMAT_VERSION",
    "BaseName",
    "SegmentName",
    "base_commit",
    "checksum_for",
    "decode_commit",
    "encode_commit",
    "is_int",
    "state_entry",
]

FORMAT_VERSION = 4
CHECKSUMS: dict[int, Algorithm] = {1: SHA256, 2: XXH3_128, 3: XXH3_128, 4: XXH3_128}
"""The hash algorithm of each format version readers accept (format 1: SHA-256, formats 2 to 4:
XXH3-128); its ``key`` names the digests in segment headers and COMMIT markers. Format 3 moved a
segment's index to its end, so that a segment is written as its records arrive; format 4 added
row-split gradients (``narrowing.py``), which a format-3 reader would not understand."""
_SEG_RE = re.compile(r"^diffs/(\d{12})-(\d{12})\.g(\d{6})\.seg$", re.ASCII)
_BASE_RE = re.compile(r"^bases/(\d{12})\.g(\d{6})/COMMIT$", re.ASCII)


def checksum_for(version: Any, name: str) -> Algorithm:
    """The hash algorithm of format ``version``, which ``name`` (e.g. ``"x.seg: segment"``) has.

    Raises:
        CorruptRecordError: naming the version, when this diffckpt does not read it.
    """
    if is_int(version) and version in CHECKSUMS:
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
    if isinstance(info, dict) and is_int(info.get("format")):
        checksum_for(info["format"], f"{name}: COMMIT marker")  # raises for a version not read here
    problem = _commit_problem(info)
    if problem is not None:
        raise CorruptRecordError(f"{name}: COMMIT marker is damaged or of an unknown format ({problem})")
    return info


def _commit_problem(info: Any) -> str | None:
    """What is wrong with a parsed COMMIT marker of a readable format version, or ``None``."""
    if not isinstance(info, dict):
        return "not a JSON object"
    if not is_int(info.get("format")):
        return f"format {info.get('format')!r} is not a version number"
    for key in ("step", "gen"):
        if not is_int(info.get(key)) or info[key] < 0:
            return f"{key} {info.get(key)!r} is not a step or session number"
    files = info.get("files")
    state = files.get("state.safetensors") if isinstance(files, dict) else None
    if not isinstance(state, dict):
        return "files lists no state.safetensors"
    key = CHECKSUMS[info["format"]].key
    if not is_int(state.get("size")) or state["size"] < 0 or not isinstance(state.get(key), str):
        return f"state.safetensors has no size and {key}"
    if info.get("fingerprint") is not None and not isinstance(info["fingerprint"], str):
        return "fingerprint is not a string"
    return None


def is_int(value: Any) -> bool:
    """Whether a decoded JSON value is an integer (``True`` is not a step number)."""
    return isinstance(value, int) and not isinstance(value, bool)
