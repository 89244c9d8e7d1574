"""The ``checkpoint-N`` folders that let the Trainer's own ``resume_from_checkpoint`` find a step.

``Trainer.train(resume_from_checkpoint=True)`` takes the ``checkpoint-N`` folder with the largest
N in ``output_dir`` and loads its files. A *resume point* is such a folder for a durable step of a
diffckpt run. It holds only what makes the Trainer skip the data already seen:

- ``trainer_state.json`` with the step's number and this run's logging/eval/save intervals (the
  callback replaces the whole ``TrainerState`` with the recorded one in ``on_train_begin``), and
  a marker, under ``stateful_callbacks``, naming the run and the step;
- ``model.safetensors`` without tensors (the Trainer requires a weights file; the model is
  replayed in ``on_train_begin``);
- ``diffckpt.json``, which tells our folders from the Trainer's own.

There is no ``optimizer.pt``, ``scheduler.pt`` or ``rng_state*.pth``: the Trainer skips what is
absent and the callback restores it. Folders are written under a temporary name that does not
start with ``checkpoint-`` (the Trainer's rotation globs ``checkpoint-*``), then renamed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from typing import Any

import safetensors.torch

log = logging.getLogger("diffckpt")

__all__ = ["MARKER", "is_resume_point", "read_marker", "remove_resume_points", "set_aside_incomplete_saves",
           "write_resume_point"]

MARKER = "diffckpt.json"
STATE_KEY = "diffckpt"  # the marker's key in TrainerState.stateful_callbacks (no callback has this name)
_NAME = re.compile(r"^checkpoint-(\d+)$")


def is_resume_point(path: str) -> bool:
    """Whether ``path`` is a folder this module wrote (not one of the Trainer's own saves)."""
    return os.path.isfile(os.path.join(path, MARKER)) and not os.path.exists(os.path.join(path, "optimizer.pt"))


def write_resume_point(parent: str, url: str, step: int, args: Any) -> str:
    """Write the resume point of ``step`` of the run at ``url`` as ``parent/checkpoint-<step>``
    and return its path. A folder of that name that the Trainer saved itself is left as it is
    (it holds the same step in full) and returned."""
    path = os.path.join(parent, f"checkpoint-{step}")
    if os.path.isdir(path) and not is_resume_point(path):
        return path
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".diffckpt-resume-", dir=parent)
    try:
        state = {"global_step": step, "logging_steps": args.logging_steps, "eval_steps": args.eval_steps,
                 "save_steps": args.save_steps, "train_batch_size": args.per_device_train_batch_size,
                 "stateful_callbacks": {STATE_KEY: {"args": {}, "attributes": {"run": url, "step": step}}}}
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(state, f)
        safetensors.torch.save_file({}, os.path.join(tmp, "model.safetensors"))
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump({"run": url, "step": step}, f)
        if os.path.isdir(path):  # our own older folder of the same step: replace it
            shutil.rmtree(path)
        os.rename(tmp, path)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isdir(path):  # not another job that wrote the same folder first
            raise
    return path


def remove_resume_points(parent: str, keep: str | None = None) -> None:
    """Remove the resume points in ``parent`` (all but ``keep``); the Trainer's own saves stay."""
    if not os.path.isdir(parent):
        return
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if _NAME.match(name) and path != keep and is_resume_point(path):
            shutil.rmtree(path, ignore_errors=True)


def set_aside_incomplete_saves(parent: str, newest: int) -> list[str]:
    """Rename the Trainer's own ``checkpoint-N`` folders newer than ``newest`` that a kill left
    half-written (the Trainer writes ``trainer_state.json`` last), which its resume would pick
    and then fail on; return the new names. Nothing is deleted."""
    moved = []
    for name in sorted(os.listdir(parent)) if os.path.isdir(parent) else []:
        path = os.path.join(parent, name)
        m = _NAME.match(name)
        if m and int(m.group(1)) > newest and os.path.isdir(path) and not is_resume_point(path) \
                and not os.path.isfile(os.path.join(path, "trainer_state.json")):
            target = os.path.join(parent, f"incomplete-{name}-{int(time.time())}")
            os.rename(path, target)
            log.warning("diffckpt: %s has no trainer_state.json (the Trainer's save of it was interrupted) "
                        "and would be picked by resume_from_checkpoint=True; renamed it to %s. The newest "
                        "durable step of the diffckpt run is %d", path, os.path.basename(target), newest)
            moved.append(target)
    return moved


def read_marker(state: Any) -> dict[str, Any] | None:
    """Take the marker out of a ``TrainerState`` loaded from a resume point (``None`` when the
    Trainer resumed from one of its own saves, or started fresh)."""
    entry = state.stateful_callbacks.pop(STATE_KEY, None)
    return None if entry is None else dict(entry["attributes"])
