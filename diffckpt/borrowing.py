"""Decoding tensors as views of the buffer they were read from (``borrowing``), for a caller
that only reads them: replay installs a segment's gradients as ``.grad`` and ``step()`` reads
them. Tensors whose data are not 64-byte aligned are copied into one recycled block per record
(:class:`BlockPool`). :func:`diffckpt.tree.unpack_tree` asks :func:`borrowed` first.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["ALIGN", "BlockPool", "aligned", "borrowed", "borrowing"]

Span = tuple[int, int, str, torch.dtype, list[int]]  # (begin, end, name, dtype, shape) in the data

ALIGN = 64
"""Where torch's allocator places a tensor's data: a tensor decoded in place must start there."""


def aligned(base: np.ndarray, nbytes: int) -> np.ndarray:
    """``nbytes`` of ``base`` (``nbytes + ALIGN`` long) starting at an ``ALIGN``-byte boundary."""
    shift = -base.ctypes.data % ALIGN
    return base[shift : shift + nbytes]


class BlockPool:
    """64-byte aligned memory for records read by range (decoded in place) and for the copies
    :func:`borrowing` makes of misaligned data, taken back once no tensor uses it. Fresh memory
    costs a page fault per 4 KiB, several times the copy itself: 13 MB copied into fresh memory
    took 6.5 ms, into recycled memory 0.9 ms (with 40 such blocks alive, as in a restore's
    read-ahead window). Safe to share between threads."""

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` whose memory comes back here when the last tensor
        viewing it is freed (a finalizer on the array DLPack holds for torch)."""
        with self._lock:  # the smallest free block that fits (by position: arrays compare by value)
            fits = [i for i, b in enumerate(self._free) if b.nbytes - ALIGN >= nbytes]
            base = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes)) if fits else None
        if base is None:
            base = np.empty(nbytes + ALIGN, dtype=np.uint8)
        lease = aligned(base, nbytes)
        weakref.finalize(lease, self._give_back, base)
        return torch.from_dlpack(lease)

    def _give_back(self, base: np.ndarray) -> None:
        with self._lock:
            self._free.append(base)


_BORROWING: contextvars.ContextVar[BlockPool | None] = contextvars.ContextVar(
    "diffckpt_tree_borrowing", default=None)


@contextlib.contextmanager
def borrowing(blocks: BlockPool | None = None) -> Iterator[None]:
    """Within the block, :func:`unpack_tree` (on this thread) returns tensors that are views of
    the buffer it decodes, not copies.

    For a caller that only reads the tensors (replay installs a segment's gradients as ``.grad``
    and ``step()`` reads them): no copy and no fresh memory to fault in; the views keep the
    buffer alive. The buffer may be ``bytes``: the views then alias read-only memory and must
    never be written, so copy whatever outlives the read (``capture.clone_tree``). A tensor is a
    view only where its data start at a multiple of 64 bytes, as torch's allocator places
    tensors: kernels may round differently at another alignment (MKL's matrix products do), and
    some compiled ones assume at least natural alignment. The others are copied into one block
    of a record from ``blocks`` (one pool per reader recycles them). Bases are never decoded
    this way: ``Optimizer.load_state_dict`` keeps the tensors it is given and updates them in
    place.
    """
    token = _BORROWING.set(blocks if blocks is not None else BlockPool())
    try:
        yield
    finally:
        _BORROWING.reset(token)


def _alias(data: memoryview) -> torch.Tensor | None:
    """A uint8 tensor over ``data`` without a copy (``None`` where this numpy and torch cannot).

    DLPack is the interface that shares read-only memory without PyTorch's one-time warning
    about non-writable buffers (``torch.frombuffer``, ``torch.from_numpy``); the array it
    exports holds ``data``, which holds the buffer, for as long as a view lives. numpy < 2.1
    refuses to export read-only memory: then every tensor is copied, as outside ``borrowing``.
    """
    try:
        return torch.from_dlpack(np.frombuffer(data, dtype=np.uint8))
    except (BufferError, TypeError, RuntimeError):
        return None


def borrowed(data: memoryview, spans: list[Span]) -> dict[str, torch.Tensor] | None:
    """Inside :func:`borrowing`, the tensors of ``spans`` as views of ``data`` (aligned copies
    where needed); ``None`` outside it, or where this numpy cannot alias ``data``."""
    blocks = _BORROWING.get()
    block = _alias(data) if blocks is not None else None
    if blocks is None or block is None:
        return None
    return _borrow(block, spans, blocks)


def _borrow(block: torch.Tensor, spans: list[Span],
            blocks: BlockPool) -> dict[str, torch.Tensor]:
    """:func:`_load_tensors` inside :func:`borrowing`: views of ``block`` where a tensor starts
    at a multiple of 64 bytes, copies into one block from ``blocks`` for the others."""
    align = ALIGN
    base = block.data_ptr()
    # Where torch's allocator would have put the tensor: training's kernels saw that alignment,
    # and some round by it (MKL's matrix products, for one); a segment puts data at any byte.
    moved = {begin: -((begin - end) // align) * align  # the span's bytes, rounded up to ``align``
             for begin, end, _, dtype, _ in spans
             if end > begin and ((base + begin) % align or begin % dtype.itemsize)}
    copies = blocks.take(sum(moved.values())) if moved else None
    out, at = {}, 0
    for begin, end, name, dtype, shape in spans:
        if begin == end:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        piece = block[begin:end]
        if copies is not None and begin in moved:
            piece = copies[at : at + end - begin].copy_(piece)  # torch copies without the GIL
            at += moved[begin]
        out[name] = piece.view(dtype).reshape(shape)
    return out
