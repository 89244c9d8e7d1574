"""The other training processes, and the few small exchanges checkpointing needs with them.

Checkpointing coordinates processes only at a handful of points: a restorable step gathers every
rank's RNG and data position, a base gathers every rank's codec state, a review sends rank 0's
tuner decision and byte-sized base interval to everyone, a restore sends the step rank 0
resolved, and a stop request must reach every rank at the same step. Each is one small
collective over Python objects, never a tensor of the model. :class:`Collective` is that interface; the engine picks :class:`TorchCollective` when a
``torch.distributed`` process group spans several processes, else :class:`LocalCollective`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

__all__ = ["Collective", "LocalCollective", "TorchCollective", "default_collective"]


@runtime_checkable
class Collective(Protocol):
    """Rank, world size and the small object exchanges of a group of training processes."""

    @property
    def rank(self) -> int:
        """This process's rank, 0 to ``world_size - 1``; rank 0 leads."""

    @property
    def world_size(self) -> int:
        """How many processes train together."""

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on rank 0, ``None`` elsewhere (every rank calls)."""

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (the others' ``obj`` is ignored; every rank calls)."""

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on at least one rank (every rank calls)."""

    def barrier(self) -> None:
        """Return once every rank has called it."""


class LocalCollective:
    """A single process: every exchange is with itself and costs nothing."""

    rank = 0
    world_size = 1

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        return obj

    def any(self, flag: bool) -> bool:
        return bool(flag)

    def barrier(self) -> None:
        return None


class TorchCollective:
    """The processes of a ``torch.distributed`` process group (gloo, NCCL...).

    Args:
        group: the process group; ``None`` is the default (world) group.
    """

    def __init__(self, group: Any = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("TorchCollective needs an initialised torch.distributed process group "
                               "(torch.distributed.init_process_group)")
        self.group = group

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=self._global(0), group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=self._global(0), group=self.group)
        return box[0]

    def any(self, flag: bool) -> bool:
        # NCCL reduces only CUDA tensors; every other backend takes CPU ones.
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" \
            else torch.device("cpu")
        value = torch.tensor([int(bool(flag))], device=device)
        dist.all_reduce(value, group=self.group)
        return bool(value.item())

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def _global(self, rank: int) -> int:
        """The global rank of ``rank`` in the group (what ``src``/``dst`` arguments take)."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)


def default_collective() -> Collective:
    """The default process group when it spans several processes, else this process alone."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchCollective()
    return LocalCollective()
