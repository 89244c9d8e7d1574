"""What Lightning adds to a restorable step, and the Lightning checkpoint dict a restore returns.

Lightning's own checkpoint dict (loops, LR schedulers, callbacks, precision plugin, versions) is
recorded without the model and optimizer states, which replay rebuilds. Lightning saves only rank
0's loader state and never the RNG, so each rank's RNG and loop position are recorded too (inside
``DiffCheckpoint``'s callback state), and every rank gets its own back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import Strategy

from diffckpt.integration import get_rng_state, set_rng_state

if TYPE_CHECKING:
    from diffckpt.integration import CheckpointEngine

    from .samplers import SamplerOrderTracker

__all__ = ["CallbackState", "StepState", "checkpoint_dict", "framework_dict"]


class CallbackState:
    """``DiffCheckpoint``'s own part of Lightning's checkpoint dict (its ``state_dict``): the RNG
    at the step, where to restore it, and under DDP every rank's part; after a restore, the RNG
    waiting for its point in the loop."""

    def __init__(self) -> None:
        self.pending_rng: dict[str, Any] | None = None
        self.pending_at = "batch_start"
        self.capture_at = "batch_start"
        self.ranks: list[Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        if self.pending_rng is not None:
            state = {"rng": self.pending_rng, "restore_at": self.pending_at}
        else:
            state = {"rng": get_rng_state(), "restore_at": self.capture_at}
        if self.ranks is not None:
            state["ranks"] = self.ranks
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pending_rng = state_dict.get("rng")
        self.pending_at = state_dict.get("restore_at", "batch_start")

    def apply_pending(self, where: str) -> None:
        """The loop reached ``where``: restore the RNG waiting for it. RNG is restored where it was
        captured relative to the data: before the next batch mid-epoch, before the next epoch's
        iterator (which draws from it) at an epoch end."""
        if self.pending_rng is not None and (where == self.pending_at or where == "batch_start"):
            set_rng_state(self.pending_rng)
            self.pending_rng = None

    @contextlib.contextmanager
    def dumping(self, restore_at: str, ranks: list[Any] | None) -> Iterator[None]:
        """Within: :meth:`state_dict` (which Lightning's dump of a step calls) says to restore the
        RNG at ``restore_at`` and holds every rank's part."""
        self.capture_at, self.ranks = restore_at, ranks
        try:
            yield
        finally:
            self.capture_at, self.ranks = "batch_start", None


class StepState:
    """What Lightning adds to a restorable step: its own checkpoint dict, and each rank's RNG and
    loop position (Lightning saves only rank 0's loader state and restores it on every rank).

    Args:
        trainer: the running Trainer.
        order: the callback's sampler order tracker (each rank's shuffling generator).
        dumping: the callback's context manager under which ``DiffCheckpoint.state_dict`` (which
            Lightning's dump calls) adds where to restore the RNG and every rank's part.
        states_skipped: model_parallel's, under which the strategy's bound state-dict methods
            return nothing (no sharded state dicts are built to be dropped).
    """

    def __init__(self, trainer: pl.Trainer, order: SamplerOrderTracker,
                 dumping: Callable[[list[Any] | None], AbstractContextManager[None]],
                 states_skipped: Callable[[Strategy], AbstractContextManager[None]]) -> None:
        self.trainer, self.order, self.dumping, self.states_skipped = trainer, order, dumping, states_skipped

    def rank_state(self) -> dict[str, Any] | None:
        if self.trainer.world_size == 1:  # nothing per rank to keep: state() records it all
            return None
        return {"rng": get_rng_state(), "loops": self.trainer.fit_loop.on_save_checkpoint(),
                "sampler_rng": self.order.captured}

    def state(self, ranks: list[Any]) -> dict[str, Any]:
        with self.dumping(ranks if len(ranks) > 1 else None), self.states_skipped(self.trainer.strategy):
            ckpt = self.trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        ckpt.pop("state_dict", None)  # replay rebuilds these two
        ckpt.pop("optimizer_states", None)
        return ckpt


def framework_dict(state: dict[str, Any], state_key: str, engine: CheckpointEngine,
                   order: SamplerOrderTracker, data_world: int) -> dict[str, Any]:
    """The Lightning checkpoint of a replayed step, with this rank's RNG and position, without
    model and optimizer states (replay has put them into the live objects). ``state_key``: the
    callback's key in the checkpoint's ``callbacks``; ``order``: its sampler order tracker;
    ``data_world``: the live number of data-parallel ranks."""
    ckpt = dict(state)
    ours = ckpt.get("callbacks", {}).get(state_key, {})
    ranks = ours.get("ranks")
    mine = engine.own(ranks) if ranks else None
    if mine is not None:
        ckpt["callbacks"][state_key] = dict(ours, rng=mine["rng"])
        fit_loop = ckpt["loops"]["fit_loop"]
        fit_loop["state_dict"] = dict(fit_loop.get("state_dict", {}), **mine["loops"])
        if mine.get("sampler_rng") is not None:
            order.replay = mine["sampler_rng"]
    if ranks and ours.get("restore_at") != "epoch_start":  # mid-epoch: on another number of ranks, deal its rest
        # rank 0's order where the process count changed (every rank's epoch order is the same)
        order.deal_rest(ckpt["loops"]["fit_loop"].setdefault("state_dict", {}),
                        (mine or ranks[0]).get("sampler_rng"), mine is None, data_world)
    return ckpt


def checkpoint_dict(ckpt: dict[str, Any], module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
                    ) -> dict[str, Any]:
    """The complete Lightning checkpoint of a replayed step: :func:`framework_dict`'s ``ckpt``
    with the live model and optimizer states."""
    ckpt["state_dict"] = module.state_dict()
    ckpt["optimizer_states"] = [o.state_dict() for o in optimizers]
    return ckpt
