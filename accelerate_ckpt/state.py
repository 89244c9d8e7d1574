"""What Accelerate adds to a restorable step, and how a restored step gives it back.

Besides the model and optimizers, which replay rebuilds, a resume needs the LR schedulers, the
AMP scaler, Accelerate's step counter and checkpoint numbering, and every rank's RNG and data
position (each rank draws its own dropout masks and reads its own shard of batches).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accelerate import Accelerator

from diffckpt.errors import IncompatibleCheckpointError
from diffckpt.integration import ReplayResult, get_rng_state

if TYPE_CHECKING:
    from .dataloader import TrackedDataLoader

__all__ = ["StepState", "load_accelerate_state"]


class StepState:
    """The engine's view of a checkpointer's state at a step (see ``diffckpt.engine.FrameworkState``).

    Args:
        accelerator: the checkpointer's ``Accelerator``.
        loaders: the tracked training loaders, in the order they were wrapped.
        saving: the step is recorded inside ``accelerator.save_state()``, which counts its save
            only after its pre-hook, where this runs.
    """

    def __init__(self, accelerator: Accelerator, loaders: list[TrackedDataLoader], saving: bool = False) -> None:
        self.accelerator, self.loaders, self.saving = accelerator, loaders, saving

    def rank_state(self) -> dict[str, Any]:
        return {"rng": get_rng_state(), "loaders": [t.position() for t in self.loaders]}

    def state(self, ranks: list[Any]) -> dict[str, Any]:
        acc = self.accelerator
        iteration = acc.project_configuration.iteration + self.saving
        return {"accelerate": {"step": acc.step, "schedulers": [s.state_dict() for s in acc._schedulers],
                               "scaler": None if acc.scaler is None else acc.scaler.state_dict(),
                               "project_iteration": iteration},
                "ranks": ranks, "world_size": acc.num_processes}


def load_accelerate_state(acc: Accelerator, result: ReplayResult, url: str) -> list[Any]:
    """Load schedulers, scaler and counters of a replayed step; return every rank's part.

    Raises:
        IncompatibleCheckpointError: the step was not written by accelerate_ckpt, or with another
            number of LR schedulers.
    """
    state = result.state
    ours = state.get("accelerate") if isinstance(state, dict) else None
    if ours is None:
        raise IncompatibleCheckpointError(
            f"step {result.step} under {url} was not written by accelerate_ckpt "
            "(no Accelerate state); restore it with the integration that wrote it (the model and "
            "optimizers were already replayed and must be restored again)")
    if len(ours["schedulers"]) != len(acc._schedulers):
        raise IncompatibleCheckpointError(
            f"the checkpoint has {len(ours['schedulers'])} LR schedulers, this run prepared "
            f"{len(acc._schedulers)}; prepare the same schedulers as the checkpointed run (the "
            "model and optimizers were already restored and must be restored again)")
    for sched, sd in zip(acc._schedulers, ours["schedulers"]):
        sched.load_state_dict(sd)
    if acc.scaler is not None and ours["scaler"]:
        acc.scaler.load_state_dict(ours["scaler"])
    acc.step = ours["step"]
    if acc.project_configuration.automatic_checkpoint_naming:
        acc.project_configuration.iteration = ours["project_iteration"]
    return state["ranks"]
