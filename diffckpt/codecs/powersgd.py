"""``PowerSGD``: rank-``r`` approximation of each gradient matrix (Vogels et al., 2019)."""

from __future__ import annotations

import zlib
from typing import Any

import torch

from .base import Payload, all_reduce_sum, world_size

__all__ = ["PowerSGD"]


class PowerSGD:
    """Low-rank gradients: ``P @ Q.T`` with ``P`` (rows × rank) and ``Q`` (cols × rank).

    Each gradient is viewed as a matrix (first dimension × the rest) and computed on in float32.
    One power-iteration step per training step, as in PyTorch's ``powerSGD_hook``: ``P = M Q``,
    summed over ranks and orthonormalised, then ``Q = Mᵀ P`` averaged over ranks, starting from
    the previous step's ``Q`` (warm start). With error feedback, ``M`` is the gradient plus what
    the previous approximation missed on this rank. Vectors (biases, norms) and matrices too
    small to gain are averaged whole.

    The payload is the reduced ``P`` and ``Q``, identical on every rank. The warm-start ``Q`` is
    the last payload's, so replay rebuilds it; residuals are per rank and saved with bases. The
    first ``Q`` of a tensor is drawn from a generator seeded by the tensor's key, never from the
    global RNG.

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

    def _start_q(self, key: str, m: torch.Tensor) -> torch.Tensor:
        q = self._q.get(key) if self.warm_start else None
        if q is None or q.shape != (m.shape[1], self.rank):
            gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(key.encode()))
            q = torch.randn(m.shape[1], self.rank, generator=gen, dtype=torch.float32).to(m.device)
        return q

    def encode(self, grads: dict[str, torch.Tensor], group: Any = None) -> dict[str, Payload]:
        world = world_size(group)
        dense = [k for k, g in grads.items() if not self._compressible(g.shape)]
        low = [k for k, g in grads.items() if self._compressible(g.shape)]
        out: dict[str, Payload] = {}
        sums = all_reduce_sum([grads[k].detach().clone() for k in dense], group)
        for key, total in zip(dense, sums):
            out[key] = {"dense": total.div_(world) if world > 1 else total}
        ms = {}
        for key in low:
            m = grads[key].detach().reshape(grads[key].shape[0], -1).float()
            if self.error_feedback and key in self._residual:
                m = m + self._residual[key]
            ms[key] = m
        ps = all_reduce_sum([ms[k] @ self._start_q(k, ms[k]) for k in low], group)
        ps = [torch.linalg.qr(p).Q.contiguous() for p in ps]  # QR returns column-major Q
        qs = all_reduce_sum([ms[k].T @ p for k, p in zip(low, ps)], group)
        for key, p, q in zip(low, ps, qs):
            out[key] = payload = {"p": p, "q": q.div_(world) if world > 1 else q}
            if self.warm_start:
                self._q[key] = payload["q"].clone()
            if self.error_feedback:
                self._residual[key] = ms[key] - self.decode(payload, ms[key].shape, torch.float32)
        return out

    def decode(self, payload: Payload, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if "dense" in payload:
            return payload["dense"].reshape(shape).to(dtype, copy=True)
        # Layouts change matmul's rounding: decode from row-major factors, as read from storage.
        return (payload["p"].contiguous() @ payload["q"].contiguous().T).reshape(shape).to(dtype)

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {f"{key}/residual": r.clone() for key, r in self._residual.items()}
        out.update({f"{key}/q": q.clone() for key, q in self._q.items()})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._residual = {k.rsplit("/", 1)[0]: t.clone() for k, t in state.items() if k.endswith("/residual")}
        self._q = {k.rsplit("/", 1)[0]: t.clone() for k, t in state.items() if k.endswith("/q")}

    def resume(self, payloads: dict[str, Payload]) -> None:
        if self.warm_start:
            self._q.update({key: p["q"].clone() for key, p in payloads.items() if "q" in p})
