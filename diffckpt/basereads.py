"""Verified reads of a base's state, straight into the tensors that will hold it.

A base is one safetensors file (``state.safetensors``, :func:`diffckpt.tree.pack_tree`): a header,
then every tensor's bytes in a fixed order. :class:`BaseFile` reads the header alone (its
:class:`~diffckpt.tree.Layout`), so that the caller can check the tree against its model and
optimizers on a skeleton of meta tensors before anything is read, and choose where each tensor
goes: a live parameter, the optimizer state it will adopt, or a new tensor on a device.
:meth:`BaseFile.fill` then reads each tensor's span into its destination, in file order, feeding
the checksum as it goes, so the state crosses memory once: no whole-file buffer and no second
copy (what a restore at 350M held twice, issue 37).

Large spans into host memory are read in place (``read_into``: ``preadv`` on a local root); small
ones, and anything bound for an accelerator, go through a staging buffer of at most
:data:`CHUNK` bytes (pinned for CUDA, copied on the current stream), several small spans to one
read. Reads run in :data:`WORKERS` threads ahead of the thread that hashes them in order.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .checksums import Algorithm
from .errors import CheckpointNotFoundError, CorruptRecordError, UnsupportedConfigurationError
from .storage.spool import ranged, read_into, read_range
from .tree import Layout, decode_tree, header_length, read_layout

__all__ = ["CHUNK", "HEAD_READ", "SMALL", "WORKERS", "BaseFile"]

HEAD_READ = 1 << 20
"""The first read of a base: its header fits in it unless the tree is very large (one more read)."""
CHUNK = 32 << 20
"""The most one read asks for: large tensors are read in pieces of this size, so that the checksum
follows close behind the reads, and a staging buffer never holds more."""
SMALL = 1 << 20
"""Spans smaller than this are read together, through a staging buffer, rather than one read each
(an object store would otherwise answer hundreds of small requests)."""
WORKERS = 2
"""Reads in flight at once, besides the thread that hashes them and copies staged bytes out."""


@dataclass
class _Read:
    """One read of the file: ``length`` bytes at ``offset``, into ``view`` (a destination's own
    memory) or, without one, into a staging buffer whose ``pieces`` are then copied out:
    ``(destination's bytes, offset in the buffer)``."""

    offset: int
    length: int
    view: memoryview | None = None
    pieces: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    pinned: bool = False


class BaseFile:
    """A base's state file, its header read and checked, its tensors not yet.

    Args:
        storage: the run root's storage.
        path: the file (``bases/<step>.g<gen>/state.safetensors``).
        size: its size, as its COMMIT marker records it.
        algorithm: the hash of its format version, and ``digest`` its recorded hex digest.

    Raises:
        CorruptRecordError: the file is missing, shorter than its header, or its header is
            malformed (checked against the checksum, which then names the damage).
    """

    def __init__(self, storage: Any, path: str, size: int, algorithm: Algorithm, digest: str) -> None:
        if sys.byteorder != "little":
            raise UnsupportedConfigurationError("diffckpt reads bases on little-endian machines only")
        self.storage, self.path, self.size = storage, path, size
        self.algorithm, self.digest = algorithm, digest
        # A storage that cannot read ranges gives the whole object once; every read is a slice of it.
        self._whole: memoryview | None = None if ranged(storage) else memoryview(self._read_whole())
        head = self._read(0, min(size, HEAD_READ))
        try:
            need = header_length(head)
            if size >= need > len(head):
                head += self._read(len(head), need - len(head))
            self.layout: Layout = read_layout(head, size)
            self.skeleton, self._names = self.layout.skeleton()
        except CorruptRecordError as exc:
            self.verify()  # damage, if the checksum says so; else a base written wrong
            raise CorruptRecordError(f"{path}: {exc}") from None
        self._head = head[: self.layout.start]

    def fill(self, into: dict[int, torch.Tensor] | None = None) -> Any:
        """Read every tensor and return the tree, verified against the checksum.

        ``into`` maps a tensor of :attr:`skeleton` (by ``id``) to the tensor to read it into, of
        the same dtype and shape, on any device; the others are read into new CPU tensors.

        Raises:
            CorruptRecordError: the file fails its checksum or its size. The destinations of
                ``into`` were written by then: load again, from another base.
        """
        dests: dict[str, torch.Tensor] = {}
        for key, t in (into or {}).items():
            name = self._names[key]
            dests[name] = t
        tensors: dict[str, torch.Tensor] = {}
        late: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, what was read for it)
        reads: list[_Read] = []
        batch: _Read | None = None
        start = self.layout.start
        for begin, end, name, dtype, shape in self.layout.spans:
            given = dests.get(name)
            t = torch.empty(shape, dtype=dtype) if given is None else given
            if t.dtype != dtype or list(t.shape) != shape:
                raise ValueError(f"tensor {name} of {self.path} is {dtype}{shape}, its destination "
                                 f"{t.dtype}{list(t.shape)}")
            tensors[name] = t
            if not t.is_contiguous():  # read into memory of its own, copied once all is verified
                late.append((t, read := torch.empty(shape, dtype=dtype)))
                t = read
            n = end - begin
            if n == 0:
                continue
            flat = t.detach().reshape(-1).view(torch.uint8)
            if t.device.type == "cpu" and n >= SMALL:
                batch = None
                for at in range(0, n, CHUNK):
                    size = min(CHUNK, n - at)
                    reads.append(_Read(start + begin + at, size, view=flat[at : at + size].numpy().data))
                continue
            for at in range(0, n, CHUNK):  # staged: a large tensor bound for a device in pieces
                size = min(CHUNK, n - at)
                if batch is None or batch.length + size > CHUNK:
                    batch = _Read(start + begin + at, 0, pinned=t.device.type == "cuda")
                    reads.append(batch)
                batch.pieces.append((flat[at : at + size], batch.length))
                batch.length += size
                batch.pinned |= t.device.type == "cuda"
        hasher = self.algorithm.new()
        hasher.update(self._head)
        self._run(reads, hasher)
        self._check(hasher)
        with torch.no_grad():
            for t, read in late:
                t.copy_(read)
        return decode_tree(self.layout.structure, tensors)

    def verify(self) -> None:
        """Hash the whole file in :data:`CHUNK` pieces (a bounded buffer); raise
        :class:`CorruptRecordError` unless it matches its size and checksum."""
        hasher, at = self.algorithm.new(), 0
        while at < self.size:
            data = self._read(at, min(CHUNK, self.size - at))
            if not data:
                raise self._damaged(f"size {at}, expected {self.size}")
            hasher.update(data)
            at += len(data)
        self._check(hasher)

    def _check(self, hasher: Any) -> None:
        """The file read whole into ``hasher``: nothing after its recorded size, and its digest."""
        if self._read(self.size, 1):
            raise self._damaged(f"longer than the {self.size} bytes recorded")
        if hasher.hexdigest() != self.digest:
            raise self._damaged(f"its size, {self.size}, as recorded, but not its {self.algorithm.key} digest")

    # ------------------------------------------------------------------ reads
    def _run(self, reads: list[_Read], hasher: Any) -> None:
        """Do ``reads`` in :data:`WORKERS` threads, at most ``2 * WORKERS`` ahead, and hash and
        copy out each one in order on this thread."""
        pending: deque[tuple[_Read, Future[tuple[torch.Tensor | None, memoryview]]]] = deque()
        todo = iter(reads)
        with ThreadPoolExecutor(WORKERS, thread_name_prefix="diffckpt-base") as pool:
            try:
                while True:
                    while len(pending) < 2 * WORKERS and (read := next(todo, None)) is not None:
                        pending.append((read, pool.submit(self._fetch, read)))
                    if not pending:
                        return
                    read, future = pending.popleft()
                    staged, data = future.result()
                    hasher.update(data)
                    if staged is not None:
                        for dest, at in read.pieces:
                            # from pinned memory to CUDA: asynchronous, on the current stream; the
                            # caching host allocator keeps the buffer until the copy is done
                            dest.copy_(staged[at : at + dest.numel()], non_blocking=read.pinned)
            except BaseException:
                for _, future in pending:
                    future.cancel()
                raise
        if any(read.pinned for read in reads):
            torch.cuda.current_stream().synchronize()  # the staging buffers' copies have landed

    def _fetch(self, read: _Read) -> tuple[torch.Tensor | None, memoryview]:
        """Read one :class:`_Read` (on a worker thread): its staging buffer (``None`` for a read
        in place) and the bytes read, to hash."""
        staged = None
        if read.view is not None:
            out = read.view
        else:
            staged = torch.empty(read.length, dtype=torch.uint8, pin_memory=read.pinned)
            out = staged.numpy().data
        got = self._read_into(read.offset, out)
        if got < read.length:
            raise self._damaged(f"size {read.offset + got}, expected {self.size}")
        return staged, out

    def _read_into(self, offset: int, out: memoryview) -> int:
        if self._whole is not None:
            got = self._whole[offset : offset + out.nbytes]
            out[: got.nbytes] = got
            return got.nbytes
        return self._guard(lambda: read_into(self.storage, self.path, offset, out))

    def _read(self, offset: int, length: int) -> bytes:
        if self._whole is not None:
            return bytes(self._whole[offset : offset + length])
        return self._guard(lambda: read_range(self.storage, self.path, offset, offset + length))

    def _read_whole(self) -> bytes:
        return self._guard(lambda: self.storage.read(self.path))

    def _guard(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except CheckpointNotFoundError:
            raise CorruptRecordError(
                f"{self.path} is missing although its COMMIT exists; the base is unusable. "
                "Restore an earlier step or remove the damaged base directory") from None

    def _damaged(self, found: str) -> CorruptRecordError:
        """``found``: what is wrong, e.g. ``"size 10, expected 20"``."""
        return CorruptRecordError(
            f"{self.path} fails its checksum ({found}); the base is damaged. "
            "Restore an earlier step or verify the storage")
