"""16-bit gradients: float32 gradients that hold bfloat16 values, stored in 16 bits.

Under bf16 autocast, or a bfloat16 reduction (FSDP2 ``MixedPrecisionPolicy(reduce_dtype=
torch.bfloat16)``), the optimizer gets float32 gradients whose elements all have their low 16
bits zero: each element's high 16 bits are its bfloat16 value, exactly. Such a gradient is stored
as those high halves, read through a 16-bit integer view of its memory rather than converted: a
float-to-bfloat16 conversion is exact for numbers too, but it rewrites NaNs (to one canonical
NaN, which differs between the CPU and CUDA), while the halves keep every bit on every device.
Replay casts a stored gradient back to the parameter's dtype (``docs/format.md`` section 6),
which restores the float32 bits. Clipping that engages rescales gradients in float32, so this is
decided per tensor from the bits, never from a precision setting.

**Row-split gradients.** An embedding's gradient under autocast is bfloat16-valued except in the
rows of the tokens the batch held: their part comes from the embedding's backward, in float32,
while every row gets the (bfloat16-valued) part of a tied output head, or zeros. Such a gradient
(two or more dimensions, rows along the first) is stored as a :data:`Split`: the high halves of
every element, the indices of the rows that have a nonzero low half, and those rows' low halves,
when that saves at least a quarter of the float32 bytes (:func:`worth_splitting`). At GPT-2 124M
the tied embedding is 154 MB of a 330 MB record; split, 77 MB and its touched rows.

Two ways to the same bytes: :func:`narrowed` for a gradient on the host (the writer thread, a
cache-sized chunk at a time), and :func:`row_flags`, :func:`plan`, :func:`high_halves` and
:func:`low_rows` for gradients on a GPU, which the writer's host stage (``staging.py``) runs on
its side stream before the device-to-host copy, so that only the bytes stored cross the bus. A
host gradient is narrowed only when contiguous (a copy would cost more than it saves); a device
gradient is copied to a contiguous host buffer in any case, and is narrowed as that buffer
would be. :func:`widened` is the way back, on replay.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch

__all__ = ["Split", "high_halves", "is_split", "low_rows", "narrowable", "narrowed", "plan", "row_flags",
           "shape_rows", "widened", "worth_splitting"]

# Which of the two int16 halves of a float32 holds its sign, exponent and top 7 mantissa bits
# (the bfloat16 value): the second in memory on a little-endian machine (every CUDA host).
_HIGH = 1 if sys.byteorder == "little" else 0
_LOW = 1 - _HIGH

_NARROW_CHUNK = 1 << 18  # elements: 1 MiB of float32, which stays in cache between check and copy


def narrowable(g: torch.Tensor) -> bool:
    """Whether ``g`` could be stored in 16 bits: float32 and not empty (its bits decide)."""
    return g.dtype == torch.float32 and g.numel() > 0


def _halves(g: torch.Tensor) -> torch.Tensor:
    """``g``'s elements as rows of two int16 halves, in row-major order (a view when ``g`` is
    contiguous; otherwise a contiguous copy first, on ``g``'s device and current stream). Not
    ``reshape(-1)``: a tensor of uniform stride (``t[:, ::2]`` of a contiguous ``t``) flattens to a
    strided view, which cannot be read as halves."""
    return g.contiguous().view(-1).view(torch.int16).view(-1, 2)


def shape_rows(g: torch.Tensor) -> tuple[int, int]:
    """``(rows, width)``: ``g`` as rows along its first dimension (one row below two dimensions),
    the unit a :data:`Split` keeps in float32."""
    rows = g.shape[0] if g.dim() >= 2 else 1
    return rows, g.numel() // max(rows, 1)


def worth_splitting(k: int, rows: int, width: int) -> bool:
    """Whether a gradient of ``rows`` rows of ``width`` with ``k`` float32-valued rows is stored
    as a :data:`Split`: it then takes at most three quarters of its float32 bytes (the high
    halves, 8 bytes of index and the low halves of each such row), else it stays float32, which
    is simpler to read and no larger than a quarter more."""
    n = rows * width
    return rows >= 2 and 0 < k and 2 * n + k * (2 * width + 8) <= 3 * n


def row_flags(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Whether each row (:func:`shape_rows`) of each of ``grads`` (:func:`narrowable`, on one
    device) has a nonzero low half: one bool tensor on their device, their rows back to back,
    queued on its current stream and not waited for (reading it is what waits; a caller reads all
    of them with one copy, then :func:`plan` each)."""
    return torch.cat([_halves(g)[:, _LOW].view(*shape_rows(g)).ne(0).any(1) for g in grads])


def plan(g: torch.Tensor, flags: torch.Tensor) -> torch.Tensor | None:
    """How ``g`` is stored, from its rows' :func:`row_flags` (on the host): ``None``, in float32;
    else the int64 indices of its float32-valued rows, empty when it is stored whole in bfloat16
    (:func:`high_halves`), else a :data:`Split` of those rows (:func:`low_rows`)."""
    rows = flags.nonzero().view(-1)
    if not len(rows):
        return rows
    if _mostly_wide(flags[_sampled(len(flags))]):
        return None
    return rows if worth_splitting(len(rows), *shape_rows(g)) else None


def low_rows(g: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The low halves of ``g``'s rows ``rows`` (on ``g``'s device), int16 ``[len(rows), width]``."""
    return _halves(g)[:, _LOW].view(*shape_rows(g)).index_select(0, rows.to(g.device))


def high_halves(g: torch.Tensor) -> torch.Tensor:
    """``g``'s high halves as a contiguous bfloat16 tensor of its shape: exactly ``g`` when its
    :func:`plan` is empty, and a :data:`Split`'s ``high`` otherwise (on ``g``'s device and
    current stream)."""
    return _halves(g)[:, _HIGH].contiguous().view(torch.bfloat16).view(g.shape)


Split = dict[str, torch.Tensor]
"""A row-split gradient as stored (``docs/format.md`` section 6): ``high``, the bfloat16 high
halves of every element in the gradient's shape; ``rows``, int64, the ascending indices of the
rows (first dimension) that hold float32 values; ``low``, int16 ``[len(rows), width]``, their low
halves."""


def is_split(obj: Any) -> bool:
    """Whether a stored gradient is a :data:`Split` (else a tensor or ``None``)."""
    return isinstance(obj, dict) and set(obj) == {"high", "rows", "low"}


def narrowed(g: torch.Tensor, pool: Any = None, taken: list[torch.Tensor] | None = None) -> torch.Tensor | Split:
    """``g`` in bfloat16 when that loses nothing, else a :data:`Split` where that saves enough,
    else ``g`` (a host gradient; see the module doc). A sample is checked first, so ordinary
    float32 gradients cost almost nothing.

    ``pool``: where the 16-bit copies' memory comes from (``staging.PinnedPool``: the same buffers
    record after record, whose pages are not faulted in anew for every record: at 124M, 162 MiB
    a record), each buffer taken appended to ``taken`` for the caller to give back once written."""
    if not narrowable(g) or not g.is_contiguous():
        return g
    # numpy, not torch: its reductions over the strided low halves are faster (check and copy of
    # 160 MB of float32 on one quiet core: torch 1.2 GB/s, numpy 1.6, numpy into a pooled buffer
    # 3.75), both release the GIL, and the writer's memory traffic slows the training thread's.
    halves = _halves(g.detach()).numpy()
    rows, width = shape_rows(g)
    if rows < 2:
        return _narrowed_whole(g, halves, pool, taken)
    grid = halves.reshape(rows, width, 2)
    # Flags from the float32s' bits as integers, whose low 16 bits are the low halves on every
    # byte order: OR-reducing them runs ~20% faster than testing the strided int16 halves.
    bits = g.detach().view(torch.int32).numpy().reshape(rows, width)
    if _mostly_wide(_low_bits(bits[_sampled(rows)])):
        return g
    # Checked and copied a cache-sized chunk of rows at a time: one pass over memory instead of
    # three and no temporary as large as the gradient.
    high = _buffer(pool, taken, (rows * width,))
    out = high.numpy().reshape(rows, width)
    low: torch.Tensor | None = None
    found: list[np.ndarray] = []
    k = 0
    step = max(1, _NARROW_CHUNK // width)
    for start in range(0, rows, step):
        block = grid[start:start + step]
        wide = _low_bits(bits[start:start + step])
        if wide.any():
            at = np.flatnonzero(wide)
            if not worth_splitting(k + len(at), rows, width):
                return g
            if low is None:
                low = _buffer(pool, taken, (rows, width))
            low.numpy()[k:k + len(at)] = block[at, :, _LOW]
            found.append(at + start)
            k += len(at)
        out[start:start + step] = block[:, :, _HIGH]
    high_bf16 = high.view(torch.bfloat16).view(g.shape)
    if low is None:
        return high_bf16
    return {"high": high_bf16, "rows": torch.from_numpy(np.concatenate(found).astype(np.int64)), "low": low[:k]}


def _narrowed_whole(g: torch.Tensor, halves: np.ndarray, pool: Any, taken: list[torch.Tensor] | None) -> torch.Tensor:
    """:func:`narrowed` of a gradient of one row: all in bfloat16, or ``g``. The buffer is taken
    only once the sample passed: an ordinary float32 gradient costs no allocation."""
    if halves[:64, _LOW].any():
        return g
    buf = _buffer(pool, taken, (halves.shape[0],))
    out = buf.numpy()
    for start in range(0, out.size, _NARROW_CHUNK):
        end = start + _NARROW_CHUNK
        if halves[start:end, _LOW].any():
            return g
        out[start:end] = halves[start:end, _HIGH]
    return buf.view(torch.bfloat16).view(g.shape)


def _buffer(pool: Any, taken: list[torch.Tensor] | None, shape: tuple[int, ...]) -> torch.Tensor:
    """An int16 buffer of ``shape``: from ``pool`` (noted in ``taken``), else new."""
    if pool is None:
        return torch.empty(shape, dtype=torch.int16)
    buf = cast(torch.Tensor, pool.take(torch.empty(shape, dtype=torch.int16, device="meta")))
    if taken is not None:
        taken.append(buf)
    return buf


def _low_bits(bits: np.ndarray) -> np.ndarray:
    """Whether each row of float32 bits (as int32) has a nonzero low half."""
    return (np.bitwise_or.reduce(bits, axis=1) & 0xFFFF) != 0


def _sampled(rows: int) -> slice:
    """The rows whose flags decide at once that a gradient stays float32 (:func:`_mostly_wide`):
    about 16, spread over it."""
    return slice(None, None, max(1, rows // 16))


def _mostly_wide(sample: Any) -> bool:
    """Whether more than half the sampled rows hold float32 values: an ordinary float32 gradient,
    whose check then costs a few rows instead of half of it."""
    return bool(sample.sum() * 2 > len(sample))


def widened(split: Split, device: torch.device | str | None = None) -> torch.Tensor:
    """The float32 gradient a :data:`Split` holds, bit for bit, on ``device`` (else the high
    halves' own).

    Raises:
        ValueError: naming what is inconsistent, when the parts do not fit together (a record
            that passed its checksum was written so: a writer of another format).
    """
    high, rows, low = split["high"], split["rows"], split["low"]
    n_rows, width = shape_rows(high)
    if (high.dtype, rows.dtype, low.dtype) != (torch.bfloat16, torch.int64, torch.int16) or rows.dim() != 1 \
            or tuple(low.shape) != (len(rows), width) or high.dim() < 2 \
            or (len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= n_rows)):
        raise ValueError(f"a row-split gradient's parts do not fit: high {high.dtype} {tuple(high.shape)}, rows "
                         f"{rows.dtype} {tuple(rows.shape)}, low {low.dtype} {tuple(low.shape)}")
    device = high.device if device is None else device
    # The cast widens every element exactly (a shift of its bits, NaNs included: replay relies on
    # it for every 16-bit gradient); the listed rows then get their low halves back.
    out = high.to(device=device, dtype=torch.float32)
    bits = out.view(torch.int32).view(n_rows, width)
    at = rows.to(device)
    bits[at] = bits[at] | (low.to(device=device, dtype=torch.int32) & 0xFFFF)
    return out
