"""Exact data order after a DDP resume.

In DDP Lightning wraps the loader's sampler in ``DistributedSamplerWrapper``, whose epoch order is
drawn from the global RNG each time an iterator is created. On resume Lightning creates that
iterator before any callback runs, so the order is drawn from an unrelated RNG state, and the
loader's saved position (a sample count) then points into a different permutation. This tracker
records the RNG state and sampler epoch each rank drew its current order from and, after a
restore, draws the order from them again (without touching the global RNG). After a resume from
an epoch end Lightning also passes every later epoch one too high (it counts the finished epoch
twice); the tracker measures that at the first new epoch and corrects the epoch it draws with.

On another number of processes (or in an epoch already dealt so) the restored order is not dealt
as the wrapper deals it: the rest of the epoch's global order, after the samples every rank had
consumed, is dealt over the new processes (:mod:`diffckpt.dealing`); :meth:`realign` then moves
the epoch loop's batch counters to where that share ends the epoch.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

from diffckpt.integration import deal, get_rng_state, global_order, set_rng_state

__all__ = ["SamplerOrderTracker"]

log = logging.getLogger("diffckpt")


class SamplerOrderTracker:
    """Patches ``DistributedSamplerWrapper.__iter__`` while installed (one tracker at a time)."""

    _active: SamplerOrderTracker | None = None

    def __init__(self) -> None:
        self.captured: dict[str, Any] | None = None
        self.replay: dict[str, Any] | None = None
        self.offset = 0
        self.dealt: int | None = None  # the samples of this rank's share of a dealt epoch, until realigned
        self._original: Any = None

    def install(self) -> None:
        self.captured = self.replay = self.dealt = None
        self.offset = 0
        if SamplerOrderTracker._active is not None:
            SamplerOrderTracker._active.uninstall()
        original = DistributedSamplerWrapper.__iter__
        tracker = self

        def draw(sampler: DistributedSamplerWrapper) -> Any:
            # The order comes from the wrapped sampler's own generator (torchdata's RandomSampler
            # keeps one), or from the global RNG if it has none, and from the epoch.
            generator = getattr(sampler.dataset._sampler, "generator", None)
            if not isinstance(generator, torch.Generator):
                generator = None
            if tracker.replay is not None and sampler.epoch > tracker.replay["epoch"]:
                # The first order of a later epoch. It must be the next epoch's; after resuming
                # from an epoch end Lightning counts that epoch twice and passes one more, for
                # every epoch after it, so that difference is subtracted from here on.
                tracker.offset = sampler.epoch - (tracker.replay["epoch"] + 1)
                tracker.replay = None
            lightning_epoch = sampler.epoch
            outside = get_rng_state()
            replay = tracker.replay
            tracker.dealt = None
            if replay is None:
                sampler.set_epoch(lightning_epoch - tracker.offset)
                tracker.captured = {"rng": outside, "epoch": sampler.epoch, "world": sampler.num_replicas,
                                    "skip": 0, "generator": None if generator is None else generator.get_state()}
            else:
                set_rng_state(replay["rng"])
                sampler.set_epoch(replay["epoch"])
                if generator is not None and replay.get("generator") is not None:
                    generator.set_state(replay["generator"])
            try:
                if replay is None or replay.get("deal") is None:
                    return original(sampler)
                # The epoch's whole order, drawn as the wrapper draws it, and this rank's share of
                # its rest (the wrapper's own __iter__ on a single-rank copy: not this patch).
                share = deal(global_order(sampler, original)[replay["deal"]:], sampler.num_replicas,
                             sampler.rank, sampler.drop_last)
                tracker.dealt = len(share)
                return iter(share)
            finally:
                sampler.set_epoch(lightning_epoch)
                if replay is not None:
                    set_rng_state(outside)
                    tracker.captured = {**replay, "world": sampler.num_replicas, "skip": replay.get("deal") or 0}
                    tracker.captured.pop("deal", None)

        self._original = original
        DistributedSamplerWrapper.__iter__ = draw  # type: ignore[method-assign]
        SamplerOrderTracker._active = self

    def deal_rest(self, fit_state: dict[str, Any], recorded: dict[str, Any] | None, other_count: bool,
                  data_world: int) -> None:
        """For a resume mid-epoch (the fit loop's checkpointed ``fit_state``; ``recorded``: the
        step's order state; ``other_count``: recorded on another number of processes): where the
        epoch was dealt over another number of ranks than ``data_world`` (or was dealt anew
        already), arm :attr:`replay` to deal the rest of its order, and drop the loader's own
        position (the share starts at its beginning). Elsewhere nothing changes."""
        loaders = fit_state.get("combined_loader") or []
        yielded = _samples_yielded(loaders)
        if recorded is None or "world" not in recorded:  # an older record, or no wrapper drew the order
            if other_count and yielded:
                log.warning("diffckpt: this epoch's order was not drawn by a DistributedSamplerWrapper, so it "
                            "is not continued sample for sample over %d ranks (see docs/lightning.md)", data_world)
            return
        if recorded["world"] == data_world and not recorded["skip"]:
            return  # the same dealing: the loader's own position continues it exactly
        if yielded is None or data_world == 1:
            if yielded is None or yielded or recorded["skip"]:
                log.warning("diffckpt: the interrupted epoch was dealt over %d ranks and resumes over %d; %s, "
                            "so it is not continued sample for sample (see docs/lightning.md)", recorded["world"],
                            data_world, "Lightning deals no order in one process" if yielded is not None else
                            "its loader's state does not say how many samples it yielded (one StatefulDataLoader "
                            "does)")
            return
        skip = int(recorded["skip"]) + yielded * int(recorded["world"])
        if skip:
            self.replay = {**recorded, "deal": skip}
            fit_state["combined_loader"] = []

    def realign(self, trainer: Any) -> None:
        """At the start of training, when it resumes in a dealt epoch (the loader has drawn its
        order, the epoch loop has not restored its counters yet; Lightning calls no epoch-start
        hook in an epoch resumed mid-way): move the epoch loop's batch counters so that the epoch
        ends with this rank's share. Lightning ends an epoch at its loader's length, counting from
        the batches already done, which were counted on the interrupted run's number of
        processes; the data fetcher starts its own count from the same counters. Under gradient
        accumulation the epoch's one short window thus comes first rather than last."""
        if self.dealt is None:
            return
        share, self.dealt = self.dealt, None
        total = trainer.num_training_batches
        loaders = trainer.fit_loop._combined_loader.flattened
        # Lightning rebuilds a loader with a batch sampler not torch's own (a StatefulDataLoader's)
        # around that batch sampler: its batch size is there.
        batches_of = getattr(loaders[0], "batch_sampler", None) if len(loaders) == 1 else None
        size = getattr(batches_of, "batch_size", None)
        if total == float("inf") or not size or not share:
            return
        batches = share // size if batches_of.drop_last else math.ceil(share / size)
        if not batches:  # less than one batch, dropped: the loader ends the epoch at once
            return
        loop = trainer.fit_loop.epoch_loop
        progress = loop.batch_progress.current
        # The epoch loop's reset adds the batch a step ended on (when recorded at its end), then
        # starts every counter at ``completed``.
        restored = progress.completed + (1 if loop.restarted_on_train_batch_end else 0)
        shift = max(total - batches, 0) - restored  # a limit_train_batches below the share ends it early
        for counter in ("ready", "started", "processed", "completed"):
            setattr(progress, counter, getattr(progress, counter) + shift)

    def uninstall(self) -> None:
        if self._original is not None:
            DistributedSamplerWrapper.__iter__ = self._original  # type: ignore[method-assign]
            self._original = None
        if SamplerOrderTracker._active is self:
            SamplerOrderTracker._active = None


def _samples_yielded(loaders: list[dict[str, Any]]) -> int | None:
    """The samples one ``StatefulDataLoader`` state says its sampler yielded this epoch (with
    worker processes: its main snapshot, taken at every batch by default), or ``None``."""
    if len(loaders) != 1:
        return None
    state = loaders[0]
    if "_snapshot" in state:
        if state.get("_steps_since_snapshot"):  # batches since the snapshot: not counted in samples
            return None
        state = state["_snapshot"].get("_main_snapshot", {})
    yielded = (state.get("_sampler_iter_state") or {}).get("samples_yielded")
    return None if yielded is None else int(yielded)
