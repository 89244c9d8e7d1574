"""``DiffCheckpoint`` beside the user's ``ModelCheckpoint``: ModelCheckpoint's keywords given to
DiffCheckpoint get an error naming DiffCheckpoint's spelling, and DiffCheckpoint stands behind
the other checkpoint callbacks so that ``"best"`` and ``trainer.checkpoint_callback`` are the
user's whatever the order of ``callbacks=[...]``."""

from __future__ import annotations

import inspect
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

__all__ = ["behind_model_checkpoints", "refuse_model_checkpoint_keywords"]


# ModelCheckpoint's keywords that DiffCheckpoint spells otherwise. Its others have no counterpart:
# DiffCheckpoint records every step, and choosing which steps to keep as files is the job of a
# ModelCheckpoint next to it, whose saves become references to the run.
_RENAMED = {"every_n_train_steps": "every_n_steps"}


def refuse_model_checkpoint_keywords(kwargs: dict[str, Any]) -> None:
    """Name DiffCheckpoint's spelling for ModelCheckpoint's keywords, instead of letting them
    reach CheckpointOptions (whose error would not say that they belong to ModelCheckpoint)."""
    theirs = set(inspect.signature(ModelCheckpoint.__init__).parameters) - {"self", "dirpath"}
    for key in sorted(set(kwargs) & theirs):
        if key in _RENAMED:
            raise TypeError(f"DiffCheckpoint() got ModelCheckpoint's keyword '{key}'; DiffCheckpoint spells it "
                            f"{_RENAMED[key]}=: DiffCheckpoint(dirpath, {_RENAMED[key]}={kwargs[key]!r})")
        raise TypeError(f"DiffCheckpoint() got ModelCheckpoint's keyword '{key}', which has no DiffCheckpoint "
                        f"counterpart: DiffCheckpoint records every step. To keep checkpoint files chosen by "
                        f"{key}=, add ModelCheckpoint({key}=...) next to DiffCheckpoint in Trainer(callbacks=[...]); "
                        "with plugins=[DiffCheckpointIO()] its saves become small references to the run")


def behind_model_checkpoints(trainer: pl.Trainer, ours_type: type) -> None:
    """Move every ``ours_type`` callback (DiffCheckpoint) behind the Trainer's other checkpoint callbacks.

    Lightning takes the first checkpoint callback for ``trainer.checkpoint_callback``,
    ``ckpt_path="best"`` and ``best_model_path``; a DiffCheckpoint there (it has no best model)
    would hide the user's ModelCheckpoint whenever ``callbacks=[...]`` lists it first. Lightning
    already puts checkpoint callbacks last, so this only reorders within that group.
    """
    ours = [c for c in trainer.callbacks if isinstance(c, ours_type)]
    reordered = [c for c in trainer.callbacks if not isinstance(c, ours_type)] + ours
    if reordered != trainer.callbacks:
        # A new list: Lightning may be iterating the old one (this runs inside the setup hooks).
        trainer.callbacks = reordered
