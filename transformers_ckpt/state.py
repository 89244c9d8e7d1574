"""What the transformers ``Trainer`` adds to a restorable step, and how a restored step gives it back.

Besides the model and optimizer, which replay rebuilds, a resume needs the LR scheduler, the AMP
scaler, the ``TrainerState`` (global step, epoch, log history, best metric, stateful callbacks,
FLOs), and per rank: its RNG where the loop takes it (see ``DiffCheckpointCallback``) and the
Trainer's running loss window, so that the log after a resume reads as in an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Protocol

from diffckpt.errors import IncompatibleCheckpointError
from diffckpt.integration import (  # the recorded state's key, which the hf-trainer export reads
    HF_TRAINER_KEY,
    ReplayResult,
    get_rng_state,
)

__all__ = ["StepOwner", "StepState", "load_callback_states", "load_trainer_state", "load_window",
           "trainer_state_json"]


# The Trainer's running loss window and FLO counter (attributes set in _inner_training_loop, not
# part of TrainerState): restoring them makes the loss logged after a resume equal to the
# uninterrupted run's. Missing ones (another transformers version) are skipped.
_WINDOW = ("_total_loss_scalar", "_globalstep_last_logged", "_initial_global_step",
           "_initial_num_input_tokens_seen", "current_flos")


def trainer_state_json(trainer: Any, log_cache: list[str]) -> str:
    """The ``TrainerState`` as ``trainer_state.json`` holds it, with the stateful callbacks
    (early stopping, the control flags) refreshed as the Trainer's own save refreshes them.

    This runs on the training thread at every restorable step, and ``log_history`` grows all run
    long (10,000 entries took 120 ms through ``dataclasses.asdict``): the entries, which the
    Trainer only appends, are encoded once each into ``log_cache`` and joined.
    """
    from transformers.trainer_callback import ExportableState

    state = trainer.state
    stateful = dict(state.stateful_callbacks)
    for cb in [*trainer.callback_handler.callbacks, trainer.control]:
        if isinstance(cb, ExportableState):
            name = type(cb).__name__
            if isinstance(stateful.get(name), list):
                stateful[name] = [*stateful[name], cb.state()]
            else:
                stateful[name] = cb.state()
    log = state.log_history
    if len(log_cache) > len(log):  # a history replaced by a shorter one (a restore)
        log_cache.clear()
    log_cache.extend(json.dumps(entry, sort_keys=True) for entry in log[len(log_cache):])
    rest = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "log_history"}
    rest["stateful_callbacks"] = stateful
    return '{"log_history": [' + ", ".join(log_cache) + "], " + json.dumps(rest, sort_keys=True)[1:]


class StepOwner(Protocol):
    """What a step's state reads of its callback (a ``DiffCheckpointCallback``), when the step is
    recorded: a protocol, as the callback's module imports this one and this one does not import
    it back."""

    trainer: Any  # the Trainer the callback runs in
    epoch_rng: dict[str, Any] | None  # this rank's RNG at the current epoch's start
    epoch_generator: Any  # and its loader's shuffling generator's state, if it has one
    log_cache: list[str]  # log_history entries encoded as JSON (see trainer_state_json)


class StepState:
    """The engine's view of the Trainer's state at a step (see ``diffckpt.engine.FrameworkState``)."""

    def __init__(self, owner: StepOwner, point: str) -> None:
        self.owner = owner
        self.point = point  # "epoch" or "step": the loop event this rank's RNG is taken at

    def rank_state(self) -> dict[str, Any]:
        trainer = self.owner.trainer
        window = {k: getattr(trainer, k) for k in _WINDOW if hasattr(trainer, k)}
        loss = getattr(trainer, "_tr_loss", None)
        return {"rng": get_rng_state(), "at": self.point, "epoch_rng": self.owner.epoch_rng,
                "epoch_generator": self.owner.epoch_generator,
                "window": window, "tr_loss": None if loss is None else loss.detach().cpu().clone()}

    def state(self, ranks: list[Any]) -> dict[str, Any]:
        trainer = self.owner.trainer
        scaler = trainer.accelerator.scaler
        return {HF_TRAINER_KEY: {"trainer_state": trainer_state_json(trainer, self.owner.log_cache),
                      "scheduler": trainer.lr_scheduler.state_dict(),
                      "scaler": None if scaler is None else scaler.state_dict(),
                      "world_size": trainer.args.world_size},
                "ranks": ranks}


def load_trainer_state(trainer: Any, result: ReplayResult, url: str) -> list[Any]:
    """Load the scheduler, scaler and ``TrainerState`` of a replayed step; return every rank's part.

    Raises:
        IncompatibleCheckpointError: the step was not written by transformers_ckpt, or on another
            number of processes.
    """
    from transformers.trainer_callback import TrainerState

    state = result.state
    ours = state.get(HF_TRAINER_KEY) if isinstance(state, dict) else None
    if ours is None:
        raise IncompatibleCheckpointError(
            f"step {result.step} under {url} was not written by transformers_ckpt (no Trainer state); "
            "resume it with the integration that wrote it, or point DiffCheckpointCallback at this "
            "Trainer's own run root")
    if ours["world_size"] != trainer.args.world_size:
        # The Trainer's data skip and each rank's shard of every batch depend on the process count.
        raise IncompatibleCheckpointError(
            f"step {result.step} under {url} was trained on {ours['world_size']} processes, this run has "
            f"{trainer.args.world_size}: the Trainer's data position and each rank's RNG cannot be "
            "carried over exactly. Resume on the same number of processes, or export the step "
            "(`diffckpt export --format hf-trainer`) to start from its weights and optimizer")
    trainer.lr_scheduler.load_state_dict(ours["scheduler"])
    if trainer.accelerator.scaler is not None and ours["scaler"]:
        trainer.accelerator.scaler.load_state_dict(ours["scaler"])
    recorded = TrainerState(**json.loads(ours["trainer_state"]))
    live = trainer.state
    for f in dataclasses.fields(TrainerState):
        # The live run's own limits and process roles stay (set by init_training_references).
        if f.name not in ("max_steps", "num_train_epochs", "is_local_process_zero", "is_world_process_zero",
                          "is_hyper_param_search", "trial_name", "trial_params"):
            setattr(live, f.name, getattr(recorded, f.name))
    return state["ranks"]


def load_callback_states(trainer: Any) -> None:
    """Set the restored ``stateful_callbacks`` on the live callbacks, as
    ``restore_callback_states_from_checkpoint`` asks. The Trainer itself re-creates each callback
    from its ``args``; the live objects are kept here (this runs inside one of their events) and
    given the recorded attributes."""
    from transformers.trainer_callback import ExportableState

    stored = trainer.state.stateful_callbacks
    seen: dict[str, int] = {}
    for cb in [*trainer.callback_handler.callbacks, trainer.control]:
        name = type(cb).__name__
        if not isinstance(cb, ExportableState) or name not in stored:
            continue
        entries = stored[name] if isinstance(stored[name], list) else [stored[name]]
        index = seen[name] = seen.get(name, -1) + 1
        if index < len(entries):
            for k, v in entries[index].get("attributes", {}).items():
                setattr(cb, k, v)


def load_window(trainer: Any, mine: dict[str, Any]) -> None:
    """Give the Trainer back this rank's loss window and FLO counter of the restored step."""
    for k, v in mine["window"].items():
        if hasattr(trainer, k):
            setattr(trainer, k, v)
    if mine["tr_loss"] is not None and hasattr(trainer, "_tr_loss"):
        trainer._tr_loss = mine["tr_loss"].to(trainer._tr_loss.device)


