"""Write a durable step as a plain checkpoint file that loads without diffckpt.

Formats: ``lightning`` (a ``.ckpt`` that ``LightningModule.load_from_checkpoint`` accepts),
``torch`` (``{"model", "optimizer", "step"}`` for plain PyTorch), ``safetensors`` (the model's
tensors only) and ``hf-trainer`` (a ``checkpoint-N`` folder that a stock transformers ``Trainer``
resumes from, for runs recorded by transformers_ckpt; :mod:`diffckpt.hf_trainer`). Each loads
with ``torch.load(weights_only=True)`` or ``safetensors.torch.load_file``, and on a machine
without the device the run was replayed on.
"""

from __future__ import annotations

import importlib.metadata
import io
import os
from typing import Any

import safetensors.torch
import torch

from . import hf_trainer
from .deprecation import renamed_kwargs
from .errors import UnsupportedConfigurationError
from .loading import load_state
from .storage import FsspecStorage, Storage
from .tree import portable

__all__ = ["FORMATS", "export_checkpoint", "output_target", "write_checkpoint"]

FORMATS = ("lightning", "torch", "safetensors", "hf-trainer")
_FOLDER = "hf-trainer"  # the one format written as a folder (never implied by an extension)
_BY_EXTENSION = {".ckpt": "lightning", ".safetensors": "safetensors"}


@renamed_kwargs(url="dirpath")
def export_checkpoint(dirpath: str | os.PathLike[str] | Storage, output: str | os.PathLike[str],
                      step: int | None = None, *, format: str | None = None, device: str | None = None,
                      storage_options: dict[str, Any] | None = None, verify: bool = True,
                      allow_modules: tuple[str, ...] = ("torch.",)) -> dict[str, Any]:
    """Rebuild ``step`` (newest durable if ``None``) of the run at ``dirpath`` and write it to ``output``.

    The file (or folder) is written whole or not at all (through :meth:`FsspecStorage.write`, or
    renamed into place), so an interrupted export never leaves a truncated checkpoint behind.

    Args:
        dirpath: run root (local path, fsspec URL or :class:`Storage`); ``url=`` is a deprecated
            spelling.
        output: file to write, a local path or an fsspec URL; for ``"hf-trainer"`` a local
            folder that does not exist yet (or is empty).
        format: ``"lightning"``, ``"torch"``, ``"safetensors"`` or ``"hf-trainer"``; by default
            from ``output``'s extension: ``.ckpt`` lightning, ``.safetensors`` safetensors,
            anything else torch.
        device, storage_options, verify, allow_modules: as in :func:`load_state`;
            ``storage_options`` apply to the run, not to ``output``.

    Returns:
        ``{"step", "format", "bytes", "base_step", "replayed", "replay_s", "path"}``; for
        ``"hf-trainer"`` also ``"files"`` (the folder's file names) and ``bytes`` is their total.

    Raises:
        CheckpointNotFoundError: ``step`` is not durable (nothing is written).
        UnsupportedConfigurationError: an unknown ``format``, or ``output`` names a directory;
            for ``"hf-trainer"``: a URL, an existing non-empty folder, or a step not recorded by
            transformers_ckpt.
        StorageError: ``output`` cannot be written.
    """
    fmt, output = output_target(output, format)  # usage errors before a replay that may take minutes
    result = load_state(dirpath, step, device=device, storage_options=storage_options, verify=verify,
                        allow_modules=allow_modules)
    return write_checkpoint(result, output, format=fmt)


def output_target(output: str | os.PathLike[str], format: str | None = None) -> tuple[str, str]:
    """``(format, output)`` that :func:`write_checkpoint` would write, checked before any replay.

    Raises:
        UnsupportedConfigurationError: an unknown ``format``, or ``output`` names a directory
            (for ``"hf-trainer"``: see :func:`diffckpt.hf_trainer.check_output`).
    """
    output = os.fspath(output)
    fmt = _format_for(output, format)
    if fmt == _FOLDER:
        return fmt, hf_trainer.check_output(output)
    _split_output(output)
    return fmt, output


def write_checkpoint(result: dict[str, Any], output: str | os.PathLike[str], *,
                     format: str | None = None) -> dict[str, Any]:
    """Write ``result`` (what :func:`load_state` returns: full tensors, for a sharded run too) to
    ``output`` as :func:`export_checkpoint` does, whole or not at all.

    Returns:
        as :func:`export_checkpoint`.
    """
    fmt, output = output_target(output, format)
    if fmt == _FOLDER:
        folder = hf_trainer.write_folder(result, output)
        return {"step": result["step"], "format": fmt, "bytes": folder["bytes"], "base_step": result["base_step"],
                "replayed": result["replayed"], "replay_s": round(result["result"].replay_s, 4),
                "path": folder["path"], "files": folder["files"]}
    directory, name = _split_output(output)
    data = _serialize(result, fmt)
    FsspecStorage(directory).write(name, data)
    return {"step": result["step"], "format": fmt, "bytes": len(data), "base_step": result["base_step"],
            "replayed": result["replayed"], "replay_s": round(result["result"].replay_s, 4),
            "path": os.path.join(directory, name) if "://" not in output else output}


def _format_for(output: str, fmt: str | None) -> str:
    """The format asked for, else the one ``output``'s extension implies."""
    if fmt is None:
        return _BY_EXTENSION.get(os.path.splitext(output)[1].lower(), "torch")
    if fmt not in FORMATS:
        raise UnsupportedConfigurationError(f"export format {fmt!r} is not one of {', '.join(FORMATS)}")
    return fmt


def _split_output(output: str) -> tuple[str, str]:
    """``(directory, file name)`` of ``output``; a local directory is made absolute."""
    if output.endswith(("/", os.sep)):
        raise UnsupportedConfigurationError(
            f"export output {output!r} names a directory; pass a file name, e.g. {output}step.ckpt")
    if "://" in output:
        directory, _, name = output.rpartition("/")
        return directory, name
    return os.path.split(os.path.abspath(output))


def _serialize(result: dict[str, Any], fmt: str) -> bytes:
    """The bytes of the file in format ``fmt`` for a :func:`load_state` result."""
    model, step = result["model"], result["step"]
    if fmt == "safetensors":
        return safetensors.torch.save(portable(model), metadata={"format": "pt", "diffckpt.step": str(step)})
    optimizers = result["optimizers"]
    if fmt == "lightning":
        state = result["state"]
        obj: dict[str, Any] = dict(state) if isinstance(state, dict) else {"state": state}
        obj.setdefault("global_step", step)
        obj.setdefault("pytorch-lightning_version", _lightning_version())
        obj.update(state_dict=model, optimizer_states=optimizers)
    else:  # what plain PyTorch code loads: one optimizer's state as is, several as a list
        obj = {"model": model, "optimizer": optimizers[0] if len(optimizers) == 1 else optimizers,
               "step": step}
    buf = io.BytesIO()
    torch.save(portable(obj), buf)
    return buf.getvalue()


def _lightning_version() -> str:
    # Lightning's loader requires this key and runs recorded without Lightning lack it. Read it
    # from package metadata: the core never imports a framework.
    try:
        return importlib.metadata.version("lightning")
    except importlib.metadata.PackageNotFoundError:
        return "2.0.0"
