"""Reference files: what ``DiffCheckpointIO`` writes where Lightning asks for a checkpoint file.

A reference is a small JSON object naming a run root and a step; the state itself is the run's
base plus diffs. Resolving a ``ckpt_path`` into ``(run url, step)`` also lives here.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shutil
import tempfile
from typing import Any

from diffckpt.runstore import RUN_FILE
from diffckpt.storage import FsspecStorage, open_storage

__all__ = ["drop_last_candidate", "is_reference", "last_candidate", "resolve_target", "write_reference"]

REF_FORMAT = "diffckpt-ref"
_STEP_RE = re.compile(r"^step=(\d+)$")
_MAX_REF = 4096


def _split(path: str) -> tuple[str, str]:
    path = path.rstrip("/")
    if "://" in path:
        head, _, name = path.rpartition("/")
        return head, name
    return os.path.dirname(path) or ".", os.path.basename(path)


def write_reference(path: str, url: str, step: int | None, storage_options: dict[str, Any]) -> None:
    """Write a reference to ``step`` of the run at ``url`` (``None``: its newest durable step)."""
    directory, name = _split(os.fspath(path))
    body = {"format": REF_FORMAT, "version": 1, "run": url, "step": step}
    open_storage(directory, **storage_options).write(name, json.dumps(body, indent=1).encode())  # retried


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
    if len(data) > _MAX_REF or not data.lstrip().startswith(b"{"):
        return None
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return body if isinstance(body, dict) and body.get("format") == REF_FORMAT else None


def is_reference(path: str, storage_options: dict[str, Any] | None = None) -> bool:
    return _read_reference(os.fspath(path), storage_options or {}) is not None


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
