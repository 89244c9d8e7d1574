"""Data order across a resume: the epoch, the batches consumed, the RNG the epoch began with.

A prepared ``DataLoaderShard`` draws its order when an epoch's iterator takes its first batch:
``synchronize_rng_states`` (rank 0's sampler generator is broadcast), the loader's base seed and
the sampler's permutation, all from generators that training keeps advancing. So a mid-epoch
resume restores the generators *as they were at the start of that epoch*, lets
``accelerator.skip_first_batches`` draw the same order and drop the consumed batches without
loading them, and only then restores each generator to where the record left it. A loader
prepared with ``use_stateful_dataloader=True`` draws its order differently from the plain loader
``skip_first_batches`` builds, so it is fast-forwarded instead: the consumed batches are read
again and dropped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from diffckpt.rng import set_rng_state

if TYPE_CHECKING:
    from .checkpointer import DiffCheckpointer

__all__ = ["TrackedDataLoader"]


def _generators(dataloader: Any) -> list[torch.Generator]:
    """Every generator an epoch's order may draw from besides the global one, in a fixed order."""
    found: list[torch.Generator] = []
    candidates = [getattr(dataloader, "synchronized_generator", None), getattr(dataloader, "generator", None)]
    sampler = getattr(dataloader, "batch_sampler", None)
    for _ in range(4):  # BatchSamplerShard -> BatchSampler -> sampler
        if sampler is None:
            break
        candidates.append(getattr(sampler, "generator", None))
        sampler = getattr(sampler, "batch_sampler", None) or getattr(sampler, "sampler", None)
    for gen in candidates:
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
            found.append(gen)
    return found


def _epoch_start(dataloader: Any) -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "generators": [g.get_state() for g in _generators(dataloader)]}


def _set_epoch_start(dataloader: Any, state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    gens = _generators(dataloader)
    if len(gens) != len(state["generators"]):
        raise ValueError(f"the data loader draws from {len(gens)} generators, the checkpoint recorded "
                         f"{len(state['generators'])}; build it as in the checkpointed run")
    for gen, gen_state in zip(gens, state["generators"]):
        gen.set_state(gen_state)


class TrackedDataLoader:
    """A prepared training data loader whose position is part of every checkpoint.

    Iterate it once per epoch, like the loader itself. After :meth:`DiffCheckpointer.restore`, the
    first epoch it starts is the interrupted one, minus the batches already consumed. Obtain one
    with :meth:`DiffCheckpointer.dataloader`.
    """

    def __init__(self, owner: DiffCheckpointer, dataloader: Any, index: int) -> None:
        self.owner = owner
        self.dataloader = dataloader
        self.index = index  # in accelerator._dataloaders
        self.resume: dict[str, Any] | None = None  # (position, rank RNG) to continue from
        self._active = False
        self._iteration = 0
        self._consumed = 0
        self._epoch: dict[str, Any] | None = None

    def __len__(self) -> int:
        return len(self.dataloader)

    def __getattr__(self, name: str) -> Any:  # batch_size, dataset, ... of the wrapped loader
        if name == "dataloader":
            raise AttributeError(name)
        return getattr(self.dataloader, name)

    @property
    def epoch(self) -> int:
        """The epoch this loader is in, or starts next."""
        if self.resume is not None:
            return int(self.resume["position"]["iteration"])
        return self._iteration if self._active else int(self.dataloader.iteration)

    def position(self) -> dict[str, Any]:
        """Where the next batch comes from: inside an epoch, or at the start of the next one."""
        if self._active:
            return {"index": self.index, "iteration": self._iteration, "consumed": self._consumed,
                    "epoch_start": self._epoch}
        return {"index": self.index, "iteration": int(self.dataloader.iteration), "consumed": 0,
                "epoch_start": _epoch_start(self.dataloader)}

    def __iter__(self) -> Iterator[Any]:
        self._active = False  # an abandoned epoch (break) is over once another one starts
        self.owner._boundary()
        dl, resume, self.resume = self.dataloader, self.resume, None
        skip = 0
        stateful = bool(getattr(dl, "use_stateful_dataloader", False))
        if resume is not None:
            pos = resume["position"]
            if stateful and pos["iteration"] > 0:
                # A stateful loader's first epoch reuses the iterator prepare() created; later
                # epochs create theirs at the epoch start, drawing from the RNG. Drop the prepared
                # one so that this epoch draws like the interrupted one did.
                dl.load_state_dict({})
            dl.iteration = pos["iteration"]
            set_rng_state(resume["rng"])
            _set_epoch_start(dl, pos["epoch_start"])
            skip = int(pos["consumed"])
        self._iteration, self._consumed, self._epoch = int(dl.iteration), skip, _epoch_start(dl)
        self._active = True
        forwarded = skip and stateful
        if forwarded:
            # skip_first_batches builds a plain loader, which draws the order differently from a
            # stateful one: read the consumed batches again and drop them.
            it = iter(dl)
            for _ in range(skip):
                if next(it, _END) is _END:
                    break
            set_rng_state(resume["rng"])  # type: ignore[index]
            first = next(it, _END)
        elif skip:
            # The skipping loader draws the epoch's order at its first batch; the RNG continues
            # from the record only after that.
            it = iter(self.owner.accelerator.skip_first_batches(dl, skip))
            first = next(it, _END)
            set_rng_state(resume["rng"])  # type: ignore[index]
        else:
            it = iter(dl)
            first = next(it, _END)
        batch = first
        while batch is not _END:
            self._consumed += 1
            yield batch
            self.owner._boundary()
            batch = next(it, _END)
        if skip and not forwarded:  # the skipping loader counted the epoch, not the original one
            dl.iteration = self._iteration + 1
        self._active = False


_END = object()
