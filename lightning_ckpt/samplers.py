"""Exact data order after a DDP resume.

In DDP Lightning wraps the loader's sampler in ``DistributedSamplerWrapper``, whose epoch order is
drawn from the global RNG each time an iterator is created. On resume Lightning creates that
iterator before any callback runs, so the order is drawn from an unrelated RNG state, and the
loader's saved position (a sample count) then points into a different permutation. This tracker
records the RNG state and sampler epoch each rank drew its current order from and, after a
restore, draws the order from them again (without touching the global RNG). After a resume from
an epoch end Lightning also passes every later epoch one too high (it counts the finished epoch
twice); the tracker measures that at the first new epoch and corrects the epoch it draws with.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

from diffckpt.integration import get_rng_state, set_rng_state

__all__ = ["SamplerOrderTracker"]


class SamplerOrderTracker:
    """Patches ``DistributedSamplerWrapper.__iter__`` while installed (one tracker at a time)."""

    _active: SamplerOrderTracker | None = None

    def __init__(self) -> None:
        self.captured: dict[str, Any] | None = None
        self.replay: dict[str, Any] | None = None
        self.offset = 0
        self._original: Any = None

    def install(self) -> None:
        self.captured = self.replay = None
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
            if tracker.replay is None:
                sampler.set_epoch(lightning_epoch - tracker.offset)
                tracker.captured = {"rng": outside, "epoch": sampler.epoch,
                                    "generator": None if generator is None else generator.get_state()}
            else:
                set_rng_state(tracker.replay["rng"])
                sampler.set_epoch(tracker.replay["epoch"])
                if generator is not None and tracker.replay.get("generator") is not None:
                    generator.set_state(tracker.replay["generator"])
            try:
                return original(sampler)
            finally:
                sampler.set_epoch(lightning_epoch)
                if tracker.replay is not None:
                    set_rng_state(outside)
                    tracker.captured = tracker.replay

        self._original = original
        DistributedSamplerWrapper.__iter__ = draw  # type: ignore[method-assign]
        SamplerOrderTracker._active = self

    def uninstall(self) -> None:
        if self._original is not None:
            DistributedSamplerWrapper.__iter__ = self._original  # type: ignore[method-assign]
            self._original = None
        if SamplerOrderTracker._active is self:
            SamplerOrderTracker._active = None
