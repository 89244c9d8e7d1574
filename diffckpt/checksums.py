"""Hash algorithms: the one place that knows them.

Checksums detect damage (truncation, bit flips, a torn upload), they do not resist attackers,
so format 2 uses XXH3-128 (7-12 GB/s) instead of format 1's SHA-256 (~1.5 GB/s): the writer
thread and the prefetch threads hash every byte of every segment and base. 128 bits make an
accidental collision negligible. :mod:`diffckpt.format` picks the :class:`Algorithm` of a
format version; everything else asks this module.

The GIL: ``xxhash``'s ``update`` hashes a buffer larger than 64 KiB with the GIL released
(``Py_BEGIN_ALLOW_THREADS`` around ``XXH3_128bits_update`` in python-xxhash's ``_xxhash.c``;
``xxhash._xxhash._GIL_MINSIZE`` is 65536 in 4.1; releases since 2017 did so above 100 kB), as
``hashlib`` does for SHA-256 above 2 KiB. Checked with xxhash 4.1: a 256 MiB ``update`` on one
thread left a pure-Python loop on another running throughout. So the writer and prefetch
threads hash tensor data while the training or replay thread runs; only small pieces (a
header, a small tensor) are hashed under the GIL, and they take microseconds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import xxhash

from .errors import CorruptRecordError

if TYPE_CHECKING:  # torch only where tensors are hashed: `diffckpt ls` and `gc` read runs without it
    import torch

__all__ = [
    "CURRENT",
    "SHA256",
    "XXH3_128",
    "Algorithm",
    "Buffer",
    "Hasher",
    "fingerprint",
    "fingerprint_matches",
]

Buffer = bytes | memoryview


class Hasher(Protocol):
    """A streaming hash: ``update`` over buffers in order hashes them as if concatenated."""

    def update(self, data: Buffer, /) -> None: ...

    def digest(self) -> bytes: ...

    def hexdigest(self) -> str: ...


@dataclass(frozen=True)
class Algorithm:
    """A hash algorithm as the format names it.

    ``key``: its name in segment header entries and COMMIT markers; ``prefix``: what starts a
    parameter fingerprint made with it (empty for SHA-256: format 1 wrote bare hex);
    ``digest_size``: bytes of a raw digest (a segment trailer)."""

    key: str
    prefix: str
    digest_size: int
    new: Callable[[], Hasher]

    def hash_parts(self, parts: Iterable[Buffer]) -> Hasher:
        """A hasher fed ``parts`` in order, as if they were concatenated."""
        h = self.new()
        for part in parts:
            h.update(part)
        return h

    def hexdigest(self, *parts: Buffer) -> str:
        """Hex digest of ``parts`` concatenated."""
        return self.hash_parts(parts).hexdigest()

    def digest(self, *parts: Buffer) -> bytes:
        """Raw digest of ``parts`` concatenated."""
        return self.hash_parts(parts).digest()


SHA256 = Algorithm(key="sha256", prefix="", digest_size=32, new=hashlib.sha256)
XXH3_128 = Algorithm(key="xxh3_128", prefix="xxh3-128:", digest_size=16, new=xxhash.xxh3_128)
CURRENT = XXH3_128
"""What diffckpt hashes with now: format 2's checksums and every new fingerprint."""
_PREFIXED = {a.prefix: a for a in (XXH3_128,)}


def _tensor_parts(tensors: Iterable[torch.Tensor]) -> Iterable[Buffer]:
    """Each tensor's dtype and shape as text, then its raw CPU bytes, in order. A contiguous CPU
    tensor is hashed in place (a ``numpy`` view, no copy)."""
    import torch

    from .sharding import local
    for t in tensors:
        t = local(t).detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        yield str((t.dtype, tuple(t.shape))).encode()
        if t.numel():
            yield t.reshape(-1).view(torch.uint8).numpy().data


def _fingerprint(tensors: Iterable[torch.Tensor], algorithm: Algorithm) -> str:
    return algorithm.prefix + algorithm.hash_parts(_tensor_parts(tensors)).hexdigest()


def fingerprint(tensors: Iterable[torch.Tensor]) -> str:
    """A self-describing hash (``"xxh3-128:<hex>"``) of ``tensors`` in order: dtype, shape and
    raw bytes of each, so two fingerprints are equal iff the tensors are bitwise equal."""
    return _fingerprint(tensors, CURRENT)


def fingerprint_matches(tensors: Iterable[torch.Tensor], recorded: str) -> bool:
    """Whether ``tensors`` hash to ``recorded``, with the algorithm it names: a prefixed
    fingerprint (format 2) or bare hex, which format 1 wrote with SHA-256.

    Raises:
        CorruptRecordError: ``recorded`` names an algorithm this version does not know.
    """
    prefix, sep, _ = recorded.partition(":")
    if not sep:
        algorithm = SHA256
    elif prefix + sep in _PREFIXED:
        algorithm = _PREFIXED[prefix + sep]
    else:
        raise CorruptRecordError(
            f"fingerprint {recorded[:40]!r} uses a hash this diffckpt does not know; upgrade diffckpt")
    return _fingerprint(tensors, algorithm) == recorded
