"""The codec interface: how a gradient is compressed for communication, and how the optimizer's
dense gradient is rebuilt from the payload, bit for bit, during training and during replay.

A codec keeps per-tensor state (error feedback residuals, warm-start factors) keyed by a name the
caller chooses (a parameter name). ``compress`` advances that state; ``decompress`` is a pure
function of the payload, so replay, which only sees payloads, rebuilds exactly the gradient the
optimizer consumed.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Codec", "Payload"]

Payload = dict[str, torch.Tensor]


@runtime_checkable
class Codec(Protocol):
    """Compression of one gradient tensor at a time."""

    name: str
    lossy: bool  # training with it differs from uncompressed training
    has_state: bool  # keeps per-tensor state that must be saved for an exact resume

    def config(self) -> dict[str, Any]:
        """JSON-able settings, recorded with the run."""

    def compress(self, key: str, grad: torch.Tensor) -> Payload:
        """Compress ``grad`` (updating the state kept for ``key``); return the payload."""

    def decompress(self, payload: Payload, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The dense gradient ``payload`` stands for; deterministic, no state."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Per-tensor state, flat (``"<key>/<name>"``)."""

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`state_dict` returned."""
