"""Rebuild any durable step without the training code: for the CLI, exports and plain PyTorch."""

from __future__ import annotations

import os
from typing import Any

from .deprecation import renamed_kwargs
from .locate import locate
from .restoring import load_located
from .storage import Storage, open_storage

__all__ = ["load_state"]


@renamed_kwargs(url="dirpath")
def load_state(dirpath: str | os.PathLike[str] | Storage, step: int | None = None, *, device: str | None = None,
               storage_options: dict[str, Any] | None = None, verify: bool = True,
               allow_modules: tuple[str, ...] = ("torch.",)) -> dict[str, Any]:
    """Return the state at ``step`` (newest durable if ``None``) of the run at ``dirpath`` (path,
    fsspec URL or :class:`Storage`; ``url=`` is a deprecated spelling) as plain tensors.

    Damage is handled as in :meth:`CheckpointEngine.restore`: for ``None``, the newest step that
    can be rebuilt, with a warning; for an explicit step, an error.

    A run trained sharded (FSDP2) is rebuilt from every rank's stream and returned as full
    tensors, at the newest step durable on every rank (``docs/sharded.md``).

    ``device``: where replay runs; ``None`` (the default), the device type training ran on, the
    only one on which replay is bit-exact (:class:`UnsupportedConfigurationError`, naming
    ``device="cpu"``, where there is none here).

    Returns:
        ``{"step", "model": {name: tensor}, "optimizers": [optimizer state_dict, ...],
        "state": framework state recorded at that step (rank 0's, for a sharded run),
        "base_step", "replayed", "result": the :class:`ReplayResult` (fingerprints checked,
        codec payloads, replay time), "parameters": [[name, shape], ...], "optimizer_classes",
        "optimizer_params": the parameter names of each param group}``.
    """
    storage = open_storage(dirpath, **(storage_options or {}))
    return load_located(locate(storage, step), device=device, verify=verify, allow_modules=allow_modules)
