"""The rest of an interrupted epoch, dealt over the ranks that resume it.

Every distributed sampler the adapters track draws one *global* order per epoch that does not
depend on the number of ranks, and deals it out so that the samples consumed after ``c`` batches on
each of ``N`` ranks are exactly the first ``c × (samples per batch) × N`` of that order:
``DistributedSampler`` deals sample by sample (rank ``r`` takes positions ``r, r+N, ...``),
Accelerate's ``BatchSamplerShard`` deals whole batches of its global sampler. So a position
recorded as ``skip`` (where the epoch's dealing started) plus ``consumed × samples`` names the
consumed prefix on any number of ranks, and a resume on another number of ranks deals the rest of
the same order over the new ranks: every sample of the epoch is seen once, apart from the padding
a distributed sampler adds to give every rank as many batches (as it does in every epoch).

The position a tracked loader records carries a *dealing*: the world it was dealt over, the
global samples per batch, the ``skip`` it started from, and how to draw the order again without
the live sampler (``order``), when that is possible.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.utils.data import DistributedSampler, Sampler, SequentialSampler

__all__ = ["IndexSampler", "Remainder", "deal", "distributed_dealing", "drawn_order", "global_order"]


class IndexSampler(Sampler[int]):
    """A fixed list of indices: one rank's share of an epoch's rest."""

    def __init__(self, indices: Sequence[int]) -> None:
        self.indices = list(indices)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class Remainder(Sampler[int]):
    """``sampler``'s order without its first ``skip`` indices: the sampler draws its order as it
    always does (so from the same generator states), and the consumed prefix is dropped."""

    def __init__(self, sampler: Any, skip: int) -> None:
        self.sampler, self.skip = sampler, skip

    def __iter__(self) -> Iterator[int]:
        for i, index in enumerate(self.sampler):
            if i >= self.skip:
                yield index

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)

    def set_epoch(self, epoch: int) -> None:
        """Passed on: a sampler seeded per epoch draws the epoch's order as without the remainder."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def deal(rest: Sequence[int], world: int, rank: int, drop_last: bool) -> list[int]:
    """``rank``'s share of ``rest`` dealt over ``world`` ranks as ``DistributedSampler`` deals:
    padded from its start to a multiple of ``world`` (or cut to one, with ``drop_last``), then
    every ``world``-th index from ``rank``."""
    rest = list(rest)
    if drop_last:
        rest = rest[:len(rest) - len(rest) % world]
    elif rest and len(rest) % world:
        pad = world - len(rest) % world
        rest += (rest * (pad // len(rest) + 1))[:pad]
    return rest[rank::world]


def distributed_dealing(sampler: Any, epoch: int) -> dict[str, Any] | None:
    """The order ``sampler`` draws for ``epoch``, as a recipe that needs no live sampler, or
    ``None``. A plain ``DistributedSampler``'s permutation depends on its seed, the epoch and the
    dataset size only; a ``SequentialSampler``'s on the size only. Others (a subclass, a random
    sampler drawing from the global RNG) cannot be named this way."""
    if type(sampler) is DistributedSampler:
        return {"kind": "distributed", "n": len(sampler.dataset), "seed": sampler.seed,  # type: ignore[arg-type]
                "shuffle": sampler.shuffle, "epoch": epoch}
    if type(sampler) is SequentialSampler:
        return {"kind": "distributed", "n": len(sampler), "seed": 0, "shuffle": False, "epoch": epoch}
    return None


def drawn_order(order: dict[str, Any]) -> list[int]:
    """The global order a recipe from :func:`distributed_dealing` names, drawn by torch's own
    ``DistributedSampler`` over a single rank (no padding)."""
    sampler: DistributedSampler[int] = DistributedSampler(
        range(order["n"]), num_replicas=1, rank=0, shuffle=order["shuffle"], seed=order["seed"])  # type: ignore[arg-type]
    sampler.set_epoch(order["epoch"])
    return list(sampler)


def global_order(sampler: DistributedSampler, iterate: Callable[[Any], Iterator[int]] = iter) -> list[int]:
    """The whole order a live ``DistributedSampler`` (or a subclass, such as Lightning's wrapper)
    deals out this epoch, from its own ``__iter__`` (``iterate``: the class's, where it is
    patched) run as a single rank."""
    whole = copy.copy(sampler)
    whole.num_replicas, whole.rank, whole.drop_last = 1, 0, False
    whole.num_samples = whole.total_size = len(sampler.dataset)  # type: ignore[arg-type]
    return list(iterate(whole))
