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

On another number of processes the rest of the interrupted epoch is dealt over the new ones
(:mod:`diffckpt.dealing`). A ``BatchSamplerShard`` deals whole batches of one global sampler, which
draws the same order on any number of processes (rank 0's generator is broadcast), so the rest is
that sampler's order without the consumed prefix, dealt by the new ``BatchSamplerShard``. A single
process has no ``BatchSamplerShard`` and draws its order otherwise, so 1 → N and N → 1 cannot
continue the epoch that way (a warning says so).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from accelerate import Accelerator
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler

from diffckpt.integration import (
    END,
    LoopCheckpointer,
    Remainder,
    TrackedLoader,
    set_epoch_start_state,
    set_rng_state,
)

__all__ = ["TrackedDataLoader"]


class TrackedDataLoader(TrackedLoader):
    """A prepared training data loader whose position is part of every checkpoint.

    Iterate it once per epoch, like the loader itself. After :meth:`DiffCheckpointer.restore`, the
    first epoch it starts is the interrupted one, minus the batches already consumed. Obtain one
    with :meth:`DiffCheckpointer.dataloader`.
    """

    def __init__(self, owner: LoopCheckpointer, dataloader: Any, index: int, accelerator: Accelerator) -> None:
        super().__init__(owner, dataloader)
        self.index = index  # in accelerator._dataloaders
        # The owner's Accelerator, handed over rather than read off the owner (a DiffCheckpointer,
        # whose module imports this one): it skips the consumed batches of a resumed epoch.
        self._accelerator = accelerator

    def __getattr__(self, name: str) -> Any:  # batch_size, dataset, ... of the wrapped loader
        if name == "dataloader":
            raise AttributeError(name)
        return getattr(self.dataloader, name)

    @property
    def _stateful(self) -> bool:
        return bool(getattr(self.dataloader, "use_stateful_dataloader", False))

    def _counter(self) -> int:
        return int(self.dataloader.iteration)

    def _order_source(self) -> Any:
        return self.dataloader

    def _position_extra(self) -> dict[str, Any]:
        return {"index": self.index}

    def _shards(self) -> BatchSamplerShard | None:
        """The batch sampler dealing one global sampler's batches over the processes, if any."""
        batches = self.dataloader.batch_sampler
        if isinstance(batches, BatchSamplerShard) and type(batches.batch_sampler) is BatchSampler:
            return batches
        return None

    def _dealing(self, epoch: int) -> dict[str, Any] | None:
        shards = self._shards()
        try:
            samples = int(self.dataloader.total_batch_size)
        except (AttributeError, TypeError):  # a batch sampler of the user's, without a batch size
            return None
        return {"world": self._accelerator.num_processes, "samples": samples,
                "order": None if shards is None else {"kind": "global"}}

    def _deal(self, recorded: dict[str, Any], skip: int) -> bool:
        shards = self._shards()
        if shards is None or recorded["order"] != {"kind": "global"}:
            return False
        batches = shards.batch_sampler
        sampler = batches.sampler
        batches.sampler = Remainder(sampler, skip)
        self._undo = lambda: setattr(batches, "sampler", sampler)
        return True

    def _rewind(self, resume: dict[str, Any]) -> int:
        dl, pos = self.dataloader, resume["position"]
        if self._stateful and pos["iteration"] > 0:
            # A stateful loader's first epoch reuses the iterator prepare() created; later
            # epochs create theirs at the epoch start, drawing from the RNG. Drop the prepared
            # one so that this epoch draws like the interrupted one did.
            dl.load_state_dict({})
        dl.iteration = pos["iteration"]
        set_rng_state(resume["rng"])
        set_epoch_start_state(dl, pos["epoch_start"])
        return int(pos["consumed"])

    def _first(self, resume: dict[str, Any] | None, skip: int) -> tuple[Iterator[Any], Any]:
        dl = self.dataloader
        if skip and self._stateful:
            # skip_first_batches builds a plain loader, which draws the order differently from a
            # stateful one: read the consumed batches again and drop them.
            it = iter(dl)
            for _ in range(skip):
                if next(it, END) is END:
                    break
            set_rng_state(resume["rng"])  # type: ignore[index]
            return it, next(it, END)
        if skip:
            # The skipping loader draws the epoch's order at its first batch; the RNG continues
            # from the record only after that.
            it = iter(self._accelerator.skip_first_batches(dl, skip))
            first = next(it, END)
            set_rng_state(resume["rng"])  # type: ignore[index]
            return it, first
        it = iter(dl)
        return it, next(it, END)

    def _closed_epoch(self, skipped: int) -> None:
        if skipped and not self._stateful:  # the skipping loader counted the epoch, not the original one
            self.dataloader.iteration = self._iteration + 1
