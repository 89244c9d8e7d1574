"""``LowPrecision``: gradients communicated in bfloat16 or float16."""

from __future__ import annotations

from typing import Any

import torch

from .base import Payload, all_reduce_sum, world_size

__all__ = ["LowPrecision"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LowPrecision:
    """Half-precision all-reduce, as PyTorch's ``bf16_compress_hook``: each rank casts its
    gradient to half precision and divides it by the world size, the halves are summed, and the
    optimizer consumes the widened sum. Lossy for training, lossless as a diff: the payload is
    exactly that half-precision sum.

    Args:
        dtype: ``"bf16"`` or ``"fp16"`` (fp16 overflows above 65504; prefer bf16).
    """

    lossy = True
    error_feedback = False

    def __init__(self, dtype: str = "bf16") -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"LowPrecision dtype must be 'bf16' or 'fp16', got {dtype!r}")
        self.dtype = dtype
        self.name = f"lowprec({dtype})"

    def config(self) -> dict[str, Any]:
        return {"codec": "lowprec", "dtype": self.dtype}

    def encode(self, grads: dict[str, torch.Tensor], group: Any = None) -> dict[str, Payload]:
        world = world_size(group)
        halves = []
        for g in grads.values():
            half = g.detach().to(_DTYPES[self.dtype], copy=True)  # never alias the gradient
            halves.append(half.div_(world) if world > 1 else half)
        summed = all_reduce_sum(halves, group)
        return {key: {"values": v} for key, v in zip(grads, summed)}

    def decode(self, payload: Payload, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return payload["values"].reshape(shape).to(dtype, copy=True)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pass

    def resume(self, payloads: dict[str, Payload]) -> None:
        pass
