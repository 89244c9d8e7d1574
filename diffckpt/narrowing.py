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

Two ways to the same bytes: :func:`narrowed` for a gradient on the host (the writer thread, a
cache-sized chunk at a time), and :func:`exact_flags` with :func:`high_halves` for gradients on a
GPU, which the writer's host stage (``staging.py``) runs on its side stream before the
device-to-host copy, so that half the bytes cross the bus. A host gradient is narrowed only when
contiguous (a copy would cost more than it saves); a device gradient is copied to a contiguous
host buffer in any case, and is narrowed as that buffer would be.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["exact_flags", "high_halves", "narrowable", "narrowed"]

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


def exact_flags(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Whether each of ``grads`` (:func:`narrowable`, on one device) holds only bfloat16 values:
    one bool tensor on their device, queued on its current stream and not waited for (reading it
    is what waits; a caller reads all of them with one copy)."""
    return torch.stack([_halves(g)[:, _LOW].any() for g in grads]).logical_not_()


def high_halves(g: torch.Tensor) -> torch.Tensor:
    """``g``'s high halves as a contiguous bfloat16 tensor of its shape: exactly ``g`` when its
    :func:`exact_flags` flag is set (on ``g``'s device and current stream)."""
    return _halves(g)[:, _HIGH].contiguous().view(torch.bfloat16).view(g.shape)


def narrowed(g: torch.Tensor, pool: Any = None, taken: list[torch.Tensor] | None = None) -> torch.Tensor:
    """``g`` in bfloat16 when that loses nothing, else ``g`` (a host gradient; see the module
    doc). A sample is checked first, so ordinary float32 gradients cost almost nothing.

    ``pool``: where the 16-bit copy's memory comes from (``staging.PinnedPool``: the same buffers
    record after record, whose pages are not faulted in anew for every record: at 124M, 162 MiB
    a record), each buffer taken appended to ``taken`` for the caller to give back once written."""
    if not narrowable(g) or not g.is_contiguous():
        return g
    # numpy, not torch: its reduction over the strided low halves is faster (check and copy of
    # 160 MB of float32 on one quiet core: torch 1.2 GB/s, numpy 1.6, numpy into a pooled buffer
    # 3.75), both release the GIL, and the writer's memory traffic slows the training thread's.
    halves = _halves(g.detach()).numpy()
    if halves[:64, _LOW].any():
        return g
    # Checked and copied a cache-sized chunk at a time: one pass over memory instead of three
    # and no temporary as large as the gradient.
    n = halves.shape[0]
    buf = torch.empty(n, dtype=torch.int16) if pool is None else pool.take(torch.empty(n, dtype=torch.int16, device="meta"))
    if pool is not None and taken is not None:
        taken.append(buf)
    out = buf.numpy()
    for start in range(0, out.size, _NARROW_CHUNK):
        end = start + _NARROW_CHUNK
        if halves[start:end, _LOW].any():
            return g
        out[start:end] = halves[start:end, _HIGH]
    return buf.view(torch.bfloat16).view(g.shape)
