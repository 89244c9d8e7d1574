"""``TopK``: keep the largest-magnitude fraction of a gradient's entries."""

from __future__ import annotations

import math
from typing import Any

import torch

from .base import Payload, all_gather_rows

__all__ = ["TopK"]


class TopK:
    """Sparse gradients: the ``ratio`` share of entries with the largest magnitude, per rank.

    The payload holds, for every rank, the kept values and their flat indices in ascending order,
    stored as int32 deltas (small numbers that zstd compresses well): ``[world, k]`` each. The
    averaged gradient is the sum of the ranks' sparse gradients, added in rank order, divided by
    the world size. With ``error_feedback``, what a rank dropped is added to its next gradient of
    the same tensor; that residual is per-rank state, saved with the run's bases.

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
        self.name = f"topk({self.ratio:g}{', ef' if self.error_feedback else ''})"
        self._residual: dict[str, torch.Tensor] = {}

    def config(self) -> dict[str, Any]:
        return {"codec": "topk", "ratio": self.ratio, "error_feedback": self.error_feedback}

    def _select(self, key: str, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
        return torch.diff(index, prepend=index.new_zeros(1)).to(torch.int32), values

    def encode(self, grads: dict[str, torch.Tensor], group: Any = None) -> dict[str, Payload]:
        keys = list(grads)
        selected = [self._select(key, grads[key]) for key in keys]
        rows = all_gather_rows([t for pair in selected for t in pair], group)
        return {key: {"delta": rows[2 * i], "values": rows[2 * i + 1]} for i, key in enumerate(keys)}

    def decode(self, payload: Payload, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        deltas, values = payload["delta"], payload["values"]
        dense = torch.zeros(math.prod(shape), dtype=values.dtype, device=values.device)
        for delta, vals in zip(deltas, values):  # in rank order; indices are unique per rank
            index = torch.cumsum(delta.to(torch.int64), 0)
            dense[index] += vals
        if len(values) > 1:
            dense /= len(values)
        return dense.reshape(shape).to(dtype)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{key}/residual": r.clone() for key, r in self._residual.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._residual = {key.rsplit("/", 1)[0]: t.clone() for key, t in state.items()
                          if key.endswith("/residual")}

    def resume(self, payloads: dict[str, Payload]) -> None:
        pass  # payloads carry no state
