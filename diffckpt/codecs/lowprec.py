"""``LowPrecision``: gradients communicated in bfloat16 or float16."""

from __future__ import annotations

from typing import Any

import torch

from .base import Payload

__all__ = ["LowPrecision"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LowPrecision:
    """Half-precision gradients. Lossy for training, lossless as a diff: the optimizer consumes
    exactly the widened half-precision values, which the payload holds.

    Args:
        dtype: ``"bf16"`` or ``"fp16"`` (fp16 overflows above 65504; prefer bf16).
    """

    lossy = True
    has_state = False

    def __init__(self, dtype: str = "bf16") -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"LowPrecision dtype must be 'bf16' or 'fp16', got {dtype!r}")
        self.dtype = dtype
        self.name = f"lowprec({dtype})"

    def config(self) -> dict[str, Any]:
        return {"codec": "lowprec", "dtype": self.dtype}

    def compress(self, key: str, grad: torch.Tensor) -> Payload:
        return {"values": grad.detach().to(_DTYPES[self.dtype])}

    def decompress(self, payload: Payload, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return payload["values"].reshape(shape).to(dtype)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pass
