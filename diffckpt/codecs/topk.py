"""``TopK``: keep the largest-magnitude fraction of a gradient's entries."""

from __future__ import annotations

import math
from typing import Any

import torch

from .base import Payload

__all__ = ["TopK"]


class TopK:
    """Sparse gradients: the ``ratio`` share of entries with the largest magnitude.

    The payload holds the kept values and their flat indices in ascending order, stored as int32
    deltas (small numbers that zstd compresses well). With ``error_feedback``, what was dropped is
    added to the next gradient of the same tensor, so nothing is lost for good; that residual is
    state, saved with the run's bases.

    Args:
        ratio: fraction of entries kept, in (0, 1]; at least one entry is always kept.
        error_feedback: carry the dropped remainder over to the next step.
    """

    lossy = True

    def __init__(self, ratio: float = 0.01, *, error_feedback: bool = False) -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"TopK ratio must be in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)
        self.error_feedback = bool(error_feedback)
        self.has_state = self.error_feedback
        self.name = f"topk({self.ratio:g}{', ef' if self.error_feedback else ''})"
        self._residual: dict[str, torch.Tensor] = {}

    def config(self) -> dict[str, Any]:
        return {"codec": "topk", "ratio": self.ratio, "error_feedback": self.error_feedback}

    def compress(self, key: str, grad: torch.Tensor) -> Payload:
        flat = grad.detach().reshape(-1)
        if self.error_feedback and key in self._residual:
            flat = flat + self._residual[key]
        k = max(1, math.ceil(self.ratio * flat.numel()))
        index = torch.topk(flat.abs(), k, sorted=False).indices.sort().values
        values = flat[index]
        if self.error_feedback:
            residual = flat.clone()
            residual[index] = 0
            self._residual[key] = residual
        delta = torch.diff(index, prepend=index.new_zeros(1))
        return {"delta": delta.to(torch.int32), "values": values.clone()}

    def decompress(self, payload: Payload, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        index = torch.cumsum(payload["delta"].to(torch.int64), 0)
        values = payload["values"]
        dense = torch.zeros(math.prod(shape), dtype=values.dtype, device=values.device)
        dense[index] = values
        return dense.reshape(shape).to(dtype)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{key}/residual": r.clone() for key, r in self._residual.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._residual = {key.rsplit("/", 1)[0]: t.clone() for key, t in state.items()
                          if key.endswith("/residual")}
