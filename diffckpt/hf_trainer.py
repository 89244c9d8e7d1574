"""A step of a transformers ``Trainer`` run as a ``checkpoint-N`` folder the stock Trainer resumes.

``trainer.train(resume_from_checkpoint=FOLDER)`` then continues as the recorded run did, without
diffckpt installed. The folder holds what the Trainer's own save holds and its resume reads:

- ``model.safetensors``: the model's tensors (the Trainer loads them with ``strict=False``);
- ``optimizer.pt``, ``scheduler.pt`` and, only when the run had one, ``scaler.pt`` (the Trainer
  refuses a ``scaler.pt`` when it has no scaler);
- ``rng_state.pth`` (one process) or ``rng_state_<rank>.pth`` per rank: the RNG where the
  Trainer restores it (the callback took it at that point of the loop);
- ``trainer_state.json``: the recorded ``TrainerState``, which tells the Trainer how many
  batches to skip.

Only the layout is known here: the recorded state is what ``transformers_ckpt`` writes under
``"transformers"``, and nothing imports transformers (the core imports no framework).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import uuid
from typing import Any

import numpy as np
import safetensors.torch
import torch

from .errors import StorageError, UnsupportedConfigurationError
from .tree import portable

__all__ = ["check_output", "write_folder"]

KEY = "transformers"  # transformers_ckpt records its state under this key


def check_output(output: str) -> str:
    """The absolute folder to write, refused before any replay if it cannot be written.

    Raises:
        UnsupportedConfigurationError: a URL, an existing file, or a folder that is not empty.
    """
    if "://" in output:
        raise UnsupportedConfigurationError(
            f"export format hf-trainer writes a local folder, not {output!r}: the Trainer's "
            "resume_from_checkpoint reads only local folders. Export to a local path and copy it")
    path = os.path.abspath(output.rstrip("/" + os.sep) or output)
    if (os.path.isdir(path) and os.listdir(path)) or (os.path.lexists(path) and not os.path.isdir(path)):
        raise UnsupportedConfigurationError(
            f"export output {path} already exists; hf-trainer writes a new folder: name one that "
            "does not exist (or an empty one)")
    return path


def write_folder(result: dict[str, Any], output: str) -> dict[str, Any]:
    """Write ``result`` (what :func:`diffckpt.load_state` returns) as the folder ``output``.

    The files go to a temporary sibling folder that is renamed into place: an interrupted export
    leaves no partial ``checkpoint-N`` for the Trainer to resume from.

    Returns:
        ``{"path", "bytes", "files"}``: the folder, the bytes of all files, their names.

    Raises:
        UnsupportedConfigurationError: the step was not recorded by transformers_ckpt, or
            ``output`` cannot be written (see :func:`check_output`).
    """
    path = check_output(output)
    files = _files(result)
    parent = os.path.dirname(path)
    try:
        os.makedirs(parent, exist_ok=True)
        # The Trainer's rotation deletes folders matching checkpoint-*: the temporary one must not.
        # os.mkdir, not mkdtemp: the folder gets the umask's permissions (mkdtemp's are 0700).
        tmp = os.path.join(parent, f".diffckpt-export-{uuid.uuid4().hex}")
        os.mkdir(tmp)
    except OSError as exc:
        raise StorageError(f"cannot write the export folder {path}: {exc}") from exc
    try:
        for name, data in files.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        check_output(path)  # another process may have made it during the replay
        os.replace(tmp, path)  # replaces an empty folder; a non-empty one fails
    except UnsupportedConfigurationError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise StorageError(f"cannot write the export folder {path}: {exc}") from exc
    return {"path": path, "bytes": sum(map(len, files.values())), "files": sorted(files)}


def _files(result: dict[str, Any]) -> dict[str, bytes]:
    """File name -> bytes of the folder for a :func:`load_state` result."""
    state, step = result["state"], result["step"]
    ours = state.get(KEY) if isinstance(state, dict) else None
    if ours is None:
        raise UnsupportedConfigurationError(
            f"step {step} was not recorded by transformers_ckpt (it holds no Trainer state: "
            "TrainerState, scheduler, RNG), so it cannot be exported as a Trainer checkpoint folder. "
            "Export it as --format torch, lightning or safetensors, or record the Trainer run with "
            "transformers_ckpt.DiffCheckpointCallback")
    optimizers = result["optimizers"]
    if len(optimizers) != 1:
        raise UnsupportedConfigurationError(
            f"step {step} holds {len(optimizers)} optimizers; a Trainer checkpoint holds one")
    files = {"model.safetensors": safetensors.torch.save(_unshared(result["model"]), metadata={"format": "pt"}),
             "optimizer.pt": _saved(portable(optimizers[0])), "scheduler.pt": _saved(portable(ours["scheduler"])),
             "trainer_state.json": _trainer_state(ours["trainer_state"], state["ranks"])}
    if ours["scaler"] is not None:
        files["scaler.pt"] = _saved(portable(ours["scaler"]))
    ranks, world_size = state["ranks"], int(ours["world_size"])
    if world_size == 1:
        files["rng_state.pth"] = _saved(_rng(ranks[0]["rng"], distributed=False))
    else:
        for r, mine in enumerate(ranks):
            files[f"rng_state_{r}.pth"] = _saved(_rng(mine["rng"], distributed=True))
    return files


def _trainer_state(recorded: str, ranks: list[dict[str, Any]]) -> bytes:
    """``trainer_state.json`` as the Trainer's own save at this step writes it.

    The recorded ``total_flos`` lacks the FLOs counted since the last log (each rank's
    ``current_flos``, which the callback restores itself); the Trainer adds them when it saves,
    and a resumed stock Trainer starts counting from zero.
    """
    state = json.loads(recorded)
    state["total_flos"] += sum(mine.get("window", {}).get("current_flos", 0) for mine in ranks)
    return (json.dumps(state, indent=2, sort_keys=True) + "\n").encode()  # as TrainerState.save_to_json


def _rng(rng: dict[str, Any], distributed: bool) -> dict[str, Any]:
    """A rank's recorded RNG (:func:`diffckpt.rng.get_rng_state`) as the Trainer saves it.

    The Trainer loads it with ``torch.load(weights_only=True)``, allowing numpy arrays only, so
    every value has exactly the type ``random.getstate()`` and ``np.random.get_state()`` give
    (a state tree may hand back lists for tuples, tensors for arrays, numpy scalars).
    """
    version, internal, gauss = rng["python"]
    name, keys, pos, has_gauss, cached = rng["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys
    out: dict[str, Any] = {
        "python": (int(version), tuple(int(x) for x in internal), None if gauss is None else float(gauss)),
        "numpy": (str(name), np.array(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)),
        "cpu": rng["torch"].cpu(),
    }
    if "cuda" in rng:
        # One process: the Trainer restores its current device's state (set_rng_state, one
        # tensor); several: every device's (set_rng_state_all), as the callback recorded it.
        cuda = [t.cpu() for t in rng["cuda"]]
        out["cuda"] = cuda if distributed else cuda[0]
    return out


def _unshared(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's tensors on the CPU, each with storage of its own: safetensors refuses tensors
    that share memory (tied weights), and the Trainer's ``strict=False`` load takes either copy."""
    seen: set[int] = set()
    out = {}
    for name, t in model.items():
        t = t.detach().cpu().contiguous()
        storage = t.untyped_storage().data_ptr()
        out[name] = t.clone() if storage in seen else t
        seen.add(storage)
    return out


def _saved(obj: Any) -> bytes:
    """``torch.save`` of ``obj``, which holds only CPU tensors and the types the Trainer's
    ``weights_only`` load accepts."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
