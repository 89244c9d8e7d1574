"""``PowerSGD``: rank-``r`` approximation of each gradient matrix (Vogels et al., 2019)."""

from __future__ import annotations

import zlib
from typing import Any

import torch

from .base import Payload

__all__ = ["PowerSGD"]


class PowerSGD:
    """Low-rank gradients: ``P @ Q.T`` with ``P`` (rows × rank) and ``Q`` (cols × rank).

    Each gradient is viewed as a matrix (first dimension × the rest). One power-iteration step per
    training step: ``P = M Q``, orthonormalise ``P``, ``Q = Mᵀ P``, starting from the previous
    step's ``Q`` (warm start). With error feedback, ``M`` is the gradient plus what the previous
    approximation missed. Vectors (biases, norms) and matrices too small to gain are sent whole.

    State (residuals and warm-start factors) is per tensor and must be saved for an exact resume;
    the first ``Q`` of a tensor is drawn from a generator seeded by the tensor's key, never from
    the global RNG.

    Args:
        rank: rank of the approximation.
        error_feedback: carry the approximation error over to the next step.
        warm_start: start each power iteration from the previous ``Q``.
    """

    lossy = True

    def __init__(self, rank: int = 4, *, error_feedback: bool = True, warm_start: bool = True) -> None:
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGD rank must be a positive integer, got {rank!r}")
        self.rank = rank
        self.error_feedback = bool(error_feedback)
        self.warm_start = bool(warm_start)
        self.has_state = self.error_feedback or self.warm_start
        self.name = f"powersgd(rank={rank})"
        self._residual: dict[str, torch.Tensor] = {}
        self._q: dict[str, torch.Tensor] = {}

    def config(self) -> dict[str, Any]:
        return {"codec": "powersgd", "rank": self.rank, "error_feedback": self.error_feedback,
                "warm_start": self.warm_start}

    def _compressible(self, shape: torch.Size) -> bool:
        if len(shape) < 2:
            return False
        rows, cols = shape[0], int(torch.Size(shape[1:]).numel())
        return self.rank * (rows + cols) < rows * cols

    def compress(self, key: str, grad: torch.Tensor) -> Payload:
        if not self._compressible(grad.shape):
            return {"dense": grad.detach().clone()}
        m = grad.detach().reshape(grad.shape[0], -1)
        if self.error_feedback and key in self._residual:
            m = m + self._residual[key]
        q = self._q.get(key) if self.warm_start else None
        if q is None:
            gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(key.encode()))
            q = torch.randn(m.shape[1], self.rank, generator=gen, dtype=m.dtype).to(m.device)
        p = torch.linalg.qr(m @ q).Q
        q = m.T @ p
        payload = {"p": p, "q": q}
        if self.warm_start:
            self._q[key] = q.clone()
        if self.error_feedback:
            self._residual[key] = m - self.decompress(payload, m.shape, m.dtype)
        return payload

    def decompress(self, payload: Payload, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if "dense" in payload:
            return payload["dense"].reshape(shape).to(dtype)
        return (payload["p"] @ payload["q"].T).reshape(shape).to(dtype)

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {f"{key}/residual": r.clone() for key, r in self._residual.items()}
        out.update({f"{key}/q": q.clone() for key, q in self._q.items()})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._residual = {k.rsplit("/", 1)[0]: t.clone() for k, t in state.items() if k.endswith("/residual")}
        self._q = {k.rsplit("/", 1)[0]: t.clone() for k, t in state.items() if k.endswith("/q")}
