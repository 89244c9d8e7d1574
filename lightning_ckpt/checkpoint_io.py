"""``DiffCheckpointIO``: Lightning's checkpoint IO plugin backed by diffckpt runs.

Loading a run root, ``run.json``, ``step=<N>`` or a reference file replays the run to that step
and returns a complete Lightning checkpoint dict. Saving (``ModelCheckpoint``,
``trainer.save_checkpoint``) writes a small reference to the step, which ``DiffCheckpoint`` makes
durable; any other path falls back to plain ``torch`` checkpoint files.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from diffckpt.errors import DiffCkptError
from diffckpt.integration import open_storage

from .references import _split, is_reference, resolve_target

__all__ = ["DiffCheckpointIO"]


class DiffCheckpointIO(CheckpointIO):
    """Checkpoint IO for ``Trainer(plugins=[DiffCheckpointIO()])``; pairs with ``DiffCheckpoint``."""

    def __init__(self, fallback: CheckpointIO | None = None) -> None:
        self._callback: Any = None
        self._fallback = fallback or TorchCheckpointIO()

    def attach(self, callback: Any) -> None:
        """Called by ``DiffCheckpoint.setup``: the callback replays and owns the writer."""
        self._callback = callback

    def _require(self, what: str) -> Any:
        if self._callback is None:
            raise DiffCkptError(
                f"DiffCheckpointIO cannot {what} without a DiffCheckpoint callback: in a Trainer, add "
                "DiffCheckpoint(dirpath=...) to Trainer(callbacks=[...]); Fabric runs no callbacks, so "
                "with Fabric remove DiffCheckpointIO from Fabric(plugins=...) and use "
                "lightning_ckpt.FabricCheckpointer (docs/fabric.md); or export a plain checkpoint with "
                "`diffckpt export`")
        return self._callback

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self._require("save a checkpoint").save_reference(int(checkpoint["global_step"]), os.fspath(path))

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        opts = self._callback.storage_options if self._callback else {}
        target = resolve_target(os.fspath(path), opts)
        if target is None:
            return self._fallback.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        url, step = target
        return self._require("restore a run").restore_checkpoint(url, step)

    def remove_checkpoint(self, path: Any) -> None:
        path = os.fspath(path)
        opts = self._callback.storage_options if self._callback else {}
        directory, name = _split(path)

        def remove() -> None:
            # Decided when it runs: a reference queued before this removal exists by then.
            if is_reference(path, opts):
                open_storage(directory, **opts).delete(name)
            else:
                self._fallback.remove_checkpoint(path)

        if self._callback is not None:
            self._callback.remove_reference(path, remove)
        else:
            remove()
