"""What Lightning adds to a restorable step, and the Lightning checkpoint dict a restore returns.

Lightning's own checkpoint dict (loops, LR schedulers, callbacks, precision plugin, versions) is
recorded without the model and optimizer states, which replay rebuilds. Lightning saves only rank
0's loader state and never the RNG, so each rank's RNG and loop position are recorded too (inside
``DiffCheckpoint``'s callback state), and every rank gets its own back.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import Strategy

from diffckpt.rng import get_rng_state

if TYPE_CHECKING:
    from .callback import DiffCheckpoint

__all__ = ["StepState", "checkpoint_dict", "framework_dict"]


class StepState:
    """What Lightning adds to a restorable step: its own checkpoint dict, and each rank's RNG and
    loop position (Lightning saves only rank 0's loader state and restores it on every rank)."""

    def __init__(self, callback: DiffCheckpoint, trainer: pl.Trainer, restore_at: str,
                 states_skipped: Callable[[Strategy], AbstractContextManager[None]]) -> None:
        # ``states_skipped``: model_parallel's, which makes the strategy's bound state-dict
        # methods return nothing while Lightning's part of the step is dumped.
        self.callback, self.trainer, self.restore_at = callback, trainer, restore_at
        self.states_skipped = states_skipped

    def rank_state(self) -> dict[str, Any] | None:
        if self.trainer.world_size == 1:  # nothing per rank to keep: state() records it all
            return None
        return {"rng": get_rng_state(), "loops": self.trainer.fit_loop.on_save_checkpoint(),
                "sampler_rng": self.callback._order.captured}

    def state(self, ranks: list[Any]) -> dict[str, Any]:
        # DiffCheckpoint.state_dict, called by dump_checkpoint, adds the RNG, where to restore it
        # and, under DDP, every rank's part.
        cb = self.callback
        cb._capture_at, cb._rank_states = self.restore_at, ranks if len(ranks) > 1 else None
        try:
            with self.states_skipped(self.trainer.strategy):  # no sharded state dicts built to be dropped
                ckpt = self.trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        finally:
            cb._capture_at, cb._rank_states = "batch_start", None
        ckpt.pop("state_dict", None)  # replay rebuilds these two
        ckpt.pop("optimizer_states", None)
        return ckpt


def framework_dict(state: dict[str, Any], callback: DiffCheckpoint) -> dict[str, Any]:
    """The Lightning checkpoint of a replayed step, with this rank's RNG and position, without
    model and optimizer states (replay has put them into the live objects)."""
    ckpt = dict(state)
    ours = ckpt.get("callbacks", {}).get(callback.state_key, {})
    mine = callback.engine.own(ours["ranks"]) if ours.get("ranks") else None
    if mine is not None:
        ckpt["callbacks"][callback.state_key] = dict(ours, rng=mine["rng"])
        fit_loop = ckpt["loops"]["fit_loop"]
        fit_loop["state_dict"] = dict(fit_loop.get("state_dict", {}), **mine["loops"])
        if mine.get("sampler_rng") is not None:
            callback._order.replay = mine["sampler_rng"]
    return ckpt


def checkpoint_dict(state: dict[str, Any], callback: DiffCheckpoint, module: torch.nn.Module,
                    optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """The complete Lightning checkpoint of a replayed step, with this rank's RNG and position."""
    ckpt = framework_dict(state, callback)
    ckpt["state_dict"] = module.state_dict()
    ckpt["optimizer_states"] = [o.state_dict() for o in optimizers]
    return ckpt
