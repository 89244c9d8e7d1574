"""The codec interface: how gradients are compressed for communication, and how the dense
gradient the optimizer consumes is rebuilt from the payload, bit for bit, in training and replay.

``encode`` takes the gradients of one step (keyed by parameter name) and, given a process group,
exchanges them across ranks; the payloads it returns are then identical on every rank and
``decode`` turns each into the *averaged* gradient. Without a group it is the same computation
for a world of one process. ``decode`` is a pure function of the payload, so replay, which only
sees payloads, rebuilds exactly what training consumed.

Codec state comes in two kinds. What a payload carries (PowerSGD's warm-start factor) is rebuilt
from the last replayed payloads by :meth:`Codec.resume`. What it does not carry (error-feedback
residuals, one per rank) is saved per rank with every base: a resume at a base step is exact end
to end, a resume between bases restarts the residuals from zero.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

__all__ = ["Codec", "Payload", "all_gather_rows", "all_reduce_sum", "world_size"]

Payload = dict[str, torch.Tensor]


@runtime_checkable
class Codec(Protocol):
    """Compression of a step's gradients, one payload per tensor."""

    name: str
    lossy: bool  # training with it differs from uncompressed training
    error_feedback: bool  # keeps per-rank residuals that payloads do not carry

    def config(self) -> dict[str, Any]:
        """JSON-able settings, recorded with every step (``codec_from_config`` rebuilds it)."""

    def encode(self, grads: dict[str, torch.Tensor], group: Any = None) -> dict[str, Payload]:
        """Compress ``grads`` (and, with ``group``, exchange them across its ranks), updating the
        state kept per key; return one payload per key, identical on every rank."""

    def decode(self, payload: Payload, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The averaged dense gradient ``payload`` stands for: a new tensor (never a view of the
        payload, which training may clip in place); deterministic, no state."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's state, flat (``"<key>/<name>"``)."""

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the state with what :meth:`state_dict` returned (``{}`` clears it)."""

    def resume(self, payloads: dict[str, Payload]) -> None:
        """Rebuild the state that the last payloads of each key carry (after replay)."""


def world_size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    order: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        order.setdefault(t.dtype, []).append(i)
    return order


def all_gather_rows(tensors: list[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """Every rank's version of each (flat) tensor, stacked as ``[world, n]``, with one collective
    per dtype. Without a group: each tensor as a single row."""
    if group is None:
        return [t.reshape(1, -1) for t in tensors]
    world = world_size(group)
    out: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    for indices in _by_dtype(tensors).values():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        rows = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(rows, flat, group=group)
        stacked = torch.stack(rows)
        offset = 0
        for i in indices:
            n = tensors[i].numel()
            out[i] = stacked[:, offset:offset + n]
            offset += n
    return out


def all_reduce_sum(tensors: list[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """The sum over ranks of each tensor (new tensors, same shapes), one collective per dtype.
    Without a group: the tensors themselves."""
    if group is None:
        return list(tensors)
    out: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    for indices in _by_dtype(tensors).values():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        dist.all_reduce(flat, group=group)
        offset = 0
        for i in indices:
            n = tensors[i].numel()
            out[i] = flat[offset:offset + n].reshape(tensors[i].shape)
            offset += n
    return out
