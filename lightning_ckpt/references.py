"""Reference files: what ``DiffCheckpointIO`` writes where Lightning asks for a checkpoint file.

A reference is a small JSON object naming a run root and a step; the state itself is the run's
base plus diffs. Resolving a ``ckpt_path`` into ``(run url, step)`` also lives here.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import posixpath
import re
import shlex
import shutil
import tempfile
from typing import Any

from diffckpt.integration import RUN_FILE, FsspecStorage, open_storage

__all__ = ["drop_last_candidate", "is_reference", "last_candidate", "read_reference", "resolve_target",
           "write_reference"]

REF_FORMAT = "diffckpt-ref"
_STEP_RE = re.compile(r"^step=(\d+)$")
_MAX_REF = 4096

# A reference sits where tools expect a torch checkpoint (LightningModule.load_from_checkpoint,
# torch.load). A pure JSON body made them fail with an UnpicklingError advising
# weights_only=False, wrong for a file from elsewhere. torch.load reads a file that is not a zip
# archive in its legacy layout: a pickled magic number, then a pickled protocol version, printed
# when it is not torch's own ("Invalid protocol version: ..."), before anything else is unpickled.
# A reference therefore starts with the magic number and a sentence saying what the file is and
# the command that makes a checkpoint of it; the JSON body follows. Version 1 (JSON only) is read.
_TORCH_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_PREAMBLE = pickle.dumps(_TORCH_LEGACY_MAGIC, protocol=2)


class _PlainUnpickler(pickle.Unpickler):
    """Reads the preamble's int and str; refuses anything that would import or build objects."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"not a diffckpt reference: it pickles {module}.{name}")


def _explanation(name: str, url: str, step: int | None) -> str:
    what = "the newest durable step" if step is None else f"step {step}"
    command = ["diffckpt", "export", url, *([] if step is None else ["--step", str(step)]),
               "-o", f"exported-{name}"]
    return (f"{name} is a diffckpt reference to {what} of the run {url}, not a checkpoint file. A Trainer "
            "with plugins=[DiffCheckpointIO()] reads it; for load_from_checkpoint or torch.load, write "
            f"a checkpoint of it with `{shlex.join(command)}`")


def _split(path: str) -> tuple[str, str]:
    path = path.rstrip("/")
    if "://" in path:
        head, _, name = path.rpartition("/")
        return head, name
    return os.path.dirname(path) or ".", os.path.basename(path)


def write_reference(path: str, url: str, step: int | None, storage_options: dict[str, Any]) -> None:
    """Write a reference to ``step`` of the run at ``url`` (``None``: its newest durable step)."""
    directory, name = _split(os.fspath(path))
    body = {"format": REF_FORMAT, "version": 2, "run": url, "step": step}
    data = _PREAMBLE + pickle.dumps(_explanation(name, url, step), protocol=2) + json.dumps(body, indent=1).encode()
    open_storage(directory, **storage_options).write(name, data)  # retried


def _body(data: bytes) -> bytes | None:
    """The JSON part of a reference's bytes (after the preamble in version 2), or None."""
    if data.startswith(_PREAMBLE):
        stream = io.BytesIO(data)
        try:
            unpickler = _PlainUnpickler(stream)
            if unpickler.load() != _TORCH_LEGACY_MAGIC or not isinstance(unpickler.load(), str):
                return None
        except Exception:
            return None
        data = data[stream.tell():]
    return data if data.lstrip().startswith(b"{") else None


def _read_reference(path: str, storage_options: dict[str, Any]) -> dict[str, Any] | None:
    directory, name = _split(path)
    storage = FsspecStorage(directory, **storage_options)
    try:
        # The size first: a plain checkpoint (gigabytes) is not ours and is not read. ``stat``
        # raises for a path with no object (absent, or a directory), which is not ours either.
        size, _ = storage.stat(name)
        if size > _MAX_REF:
            return None
        data = storage.read(name)
    except Exception:
        return None
    if len(data) > _MAX_REF or (text := _body(data)) is None:
        return None
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return body if isinstance(body, dict) and body.get("format") == REF_FORMAT else None


def is_reference(path: str, storage_options: dict[str, Any] | None = None) -> bool:
    return read_reference(path, storage_options) is not None


def read_reference(path: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The body of the reference at ``path`` (``format``, ``version``, ``run``, ``step``), or
    ``None`` if the file is not one."""
    return _read_reference(os.fspath(path), storage_options or {})


def resolve_target(path: str, storage_options: dict[str, Any] | None = None) -> tuple[str, int | None] | None:
    """Map a ``ckpt_path`` to ``(run url, step or None for newest)``, or ``None`` if it is not ours.

    Accepted: a run root, ``<root>/run.json`` (what ``ckpt_path="last"`` resolves to),
    ``<root>/step=<N>`` (as listed by ``diffckpt ls``) and reference files written by
    ``DiffCheckpointIO``; a ``last*.ckpt`` reference resolves to the newest durable step.
    """
    opts = storage_options or {}
    path = os.fspath(path).rstrip("/")
    directory, name = _split(path)
    if name == RUN_FILE:
        return directory, None
    if (m := _STEP_RE.match(name)) is not None:
        return directory, int(m[1])
    try:
        if FsspecStorage(path, **opts).exists(RUN_FILE):
            return path, None
    except Exception:
        pass
    ref = _read_reference(path, opts)
    if ref is None:
        return None
    newest = posixpath.basename(path).startswith("last") or ref.get("step") is None
    return str(ref["run"]), None if newest else int(ref["step"])


def last_candidate(engine: Any, url: str, previous: str | None) -> tuple[str | None, str]:
    """What ``DiffCheckpoint`` offers Lightning for ``ckpt_path="last"``: ``(temporary file to
    drop later or None, candidate)``. A local run offers its ``run.json``, rewritten at every
    session start; a remote one a local reference file, since Lightning stats the candidate with
    a file system built from the path alone, which knows neither storage_options nor endpoint."""
    if engine.storage_is_local:
        return previous, url.rstrip("/") + "/" + RUN_FILE
    path = previous or os.path.join(tempfile.mkdtemp(prefix="diffckpt-last-"), "last.ckpt")
    write_reference(path, url, None, {})
    return path, path


def drop_last_candidate(path: str | None) -> None:
    """Remove the temporary reference :func:`last_candidate` made, if any."""
    if path is not None:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
