"""The training loader of a Fabric loop: its position in every checkpoint, and where a resume continues.

``fabric.setup_dataloaders`` returns a ``_FabricDataLoader`` that counts the epochs it started
(``_num_iter_calls``, which also sets a ``DistributedSampler``'s epoch) and draws an epoch's order
when the epoch's first batch is requested. Fabric has no way to skip batches without reading
them, so a mid-epoch resume sets the epoch counter and the generators back to the start of the
interrupted epoch (:mod:`diffckpt.dataorder`), reads the consumed batches again and drops them,
and then restores the RNG as the record left it. On another number of processes the rest of the
interrupted epoch's order is dealt over the new ones instead (:mod:`diffckpt.dealing`): Fabric
puts a ``DistributedSampler`` under every loader of a multi-process run, whose order the record
names.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DistributedSampler

from diffckpt.integration import (
    END,
    IndexSampler,
    TrackedLoader,
    deal,
    distributed_dealing,
    drawn_order,
    set_epoch_start_state,
    set_rng_state,
)

__all__ = ["TrackedFabricLoader"]


class TrackedFabricLoader(TrackedLoader):
    """A loader ``fabric.setup_dataloaders`` returned, whose position is part of every checkpoint.

    Iterate it once per epoch, like the loader itself; obtain it with
    :meth:`FabricCheckpointer.dataloader`. Requesting a batch is the step boundary: the step the
    previous batch trained is committed then, once the scheduler and anything else between the
    batches (evaluation, logging) has run.
    """

    @property
    def _inner(self) -> Any:
        """The ``torch.utils.data.DataLoader`` that draws the order (Fabric's wrapper holds it)."""
        return self.dataloader._dataloader

    def _counter(self) -> int:
        return int(self.dataloader._num_iter_calls)

    def _order_source(self) -> Any:
        return self._inner

    def _dealing(self, epoch: int) -> dict[str, Any] | None:
        dl = self._inner
        if dl.batch_size is None:  # a batch sampler of the user's: its batches are not counted in samples
            return None
        world = dl.sampler.num_replicas if isinstance(dl.sampler, DistributedSampler) else 1
        return {"world": world, "samples": dl.batch_size * world, "order": distributed_dealing(dl.sampler, epoch)}

    def _deal(self, recorded: dict[str, Any], skip: int) -> bool:
        dl = self._inner
        if recorded["order"] is None or dl.batch_size is None:
            return False
        sampler = dl.sampler
        world, rank, drop_last = ((sampler.num_replicas, sampler.rank, sampler.drop_last)
                                  if isinstance(sampler, DistributedSampler) else (1, 0, False))
        share = deal(drawn_order(recorded["order"])[skip:], world, rank, drop_last)
        batches = dl.batch_sampler
        batches.sampler = IndexSampler(share)
        self._undo = lambda: setattr(batches, "sampler", sampler)
        return True

    def _rewind(self, resume: dict[str, Any]) -> int:
        pos = resume["position"]
        self.dataloader._num_iter_calls = int(pos["iteration"])
        set_epoch_start_state(self._inner, pos["epoch_start"])
        return int(pos["consumed"])

    def _first(self, resume: dict[str, Any] | None, skip: int) -> tuple[Iterator[Any], Any]:
        it = iter(self.dataloader)
        for _ in range(skip):  # the order is drawn at the first of these, as in the interrupted epoch
            if next(it, END) is END:
                break
        if resume is not None:
            set_rng_state(resume["rng"])
        return it, next(it, END)
