"""``accelerator.save_state()`` / ``load_state()`` next to a :class:`DiffCheckpointer`.

The checkpointer is registered for checkpointing through a small object whose state is a
*reference* (run root and step) that Accelerate pickles into its own ``custom_checkpoint_<i>.pkl``.
On ``save_state`` the current step becomes a durable base and the model's weights are left out; on
``load_state`` the referenced step is replayed and the model is taken off Accelerate's list, which
then loads optimizers, schedulers and RNG as usual. Nothing of ours goes under
``project_dir/checkpoints/``.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Protocol

import torch
from accelerate import Accelerator

from diffckpt.errors import IncompatibleCheckpointError
from diffckpt.integration import CheckpointEngine

__all__ = ["SaveStateHooks", "SaveStateOwner"]

log = logging.getLogger("diffckpt")

_REFERENCE = "diffckpt-reference"
NOTE = "DIFFCKPT.txt"
_WHY = re.compile(r"save_state\((.+)\)", re.DOTALL)  # why a save_state folder's step is kept


def _why(output_dir: str) -> str:
    return f"save_state({output_dir})"


class SaveStateOwner(Protocol):
    """What the hooks use of their checkpointer (a ``DiffCheckpointer``): a protocol, as the
    checkpointer's module imports this one and this one does not import it back."""

    accelerator: Accelerator
    module: torch.nn.Module  # the unwrapped model, whose weights a reference stands for
    engine: CheckpointEngine
    url: str  # the run root
    step: int  # optimizer steps taken

    def base_now(self) -> int | None: ...

    def restore_reference(self, url: str, step: int) -> int: ...


class SaveStateHooks:
    """Accelerate's save/load pre-hooks and the registered reference of one checkpointer."""

    def __init__(self, owner: SaveStateOwner) -> None:
        self.owner = owner
        self.referenced: int | None = None  # the step the last save_state made durable
        acc = owner.accelerator
        self._handles = [acc.register_save_state_pre_hook(self._on_save),
                         acc.register_load_state_pre_hook(self._on_load)]
        acc.register_for_checkpointing(self)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # what Accelerate stores in custom_checkpoint_<i>.pkl
    def state_dict(self) -> dict[str, Any]:
        # Only a durable step is referenced; otherwise Accelerate's own files hold the weights.
        return {"format": _REFERENCE, "url": self.owner.url, "step": self.referenced}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Called by load_state last; the restore itself happened in the pre-hook.
        if not isinstance(state, dict) or state.get("format") != _REFERENCE:
            raise IncompatibleCheckpointError(
                "the checkpoint directory holds another object where the DiffCheckpointer's reference "
                "belongs; register objects for checkpointing in the same order as when it was saved")

    def _on_save(self, models: list[Any], weights: list[dict[str, Any]], output_dir: str) -> None:
        owner = self.owner
        durable = owner.base_now()
        self.referenced = None
        if durable is None or durable < owner.step:
            return
        index = self._model_index(models)
        if index is None or index >= len(weights):
            return
        weights.pop(index)  # the base just made durable holds them
        self.referenced = owner.step
        owner.engine.keep(owner.step, _why(output_dir))  # retention must not delete it, in later sessions too
        self._release_removed(output_dir)
        with open(os.path.join(output_dir, NOTE), "w") as f:
            f.write(f"The model weights of this checkpoint are step {owner.step} of the diffckpt run "
                    f"{owner.url}.\nLoad it with accelerator.load_state() after creating a "
                    "DiffCheckpointer for that run, or get the weights alone with\n"
                    f"  diffckpt export {owner.url} --step {owner.step} -o model.safetensors\n")
        log.info("diffckpt: save_state at step %d references %s instead of writing the weights",
                 owner.step, owner.url)

    def _release_removed(self, output_dir: str) -> None:
        """Accelerate's ``total_limit`` deleted the oldest ``save_state`` folders before this save:
        their steps are kept no more. Only folders beside this one are judged (this process sees
        that directory; a folder elsewhere may be on another machine's disk)."""
        engine = self.owner.engine
        if not engine.is_main_process:
            return
        here = os.path.dirname(os.path.abspath(output_dir))
        for kept in engine.recorder.kept.saved():
            m = _WHY.fullmatch(kept.why)
            if m and os.path.dirname(os.path.abspath(m[1])) == here and not os.path.exists(m[1]):
                engine.release(kept.why)

    def _on_load(self, models: list[Any], input_dir: str) -> None:
        ref = self._read_reference(input_dir)
        if ref is None or ref.get("step") is None:  # saved with the weights: Accelerate loads them
            return
        self.owner.restore_reference(ref["url"], int(ref["step"]))
        index = self._model_index(models)
        if index is not None:
            models.pop(index)  # restored by replay; Accelerate must not look for its weights

    def _read_reference(self, input_dir: str) -> dict[str, Any] | None:
        objects = self.owner.accelerator._custom_objects
        index = next(i for i, obj in enumerate(objects) if obj is self)
        path = os.path.join(input_dir, f"custom_checkpoint_{index}.pkl")
        if not os.path.exists(path):
            return None
        ref = torch.load(path, weights_only=True)
        return ref if isinstance(ref, dict) and ref.get("format") == _REFERENCE else None

    def _model_index(self, models: list[Any]) -> int | None:
        unwrap, module = self.owner.accelerator.unwrap_model, self.owner.module
        return next((i for i, m in enumerate(models) if unwrap(m, keep_torch_compile=False) is module), None)
