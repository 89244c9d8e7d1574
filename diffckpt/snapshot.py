"""A base's copy of the host tensors only ``optimizer.step()`` changes, made beside training.

A base must hold the state at its step, so it is copied before training changes it. On a GPU
that copy is a device copy queued on the training stream, which the training thread does not
wait for. On the host it is a pass over every parameter and optimizer state byte (106 MB for
GPT-2 4x384 with SGD): on the training thread, it was most of what a base every few steps cost
a loop whose device time is idle for the host.

Parameters and optimizer state change only in ``optimizer.step()`` (diffckpt's premise: replay
rebuilds a step from the steps' records alone). So their host copies are made on a thread of
their own (:class:`DeferredCopy`), and the next ``optimizer.step()`` waits for that copy before
it changes anything (``StepCapture``'s pre-hook); everything else in a base (buffers, which a
forward may change, framework state, a codec's state) is cloned at once, as before. The commit
thread packs the base only once the copy is done, and refuses it if a copied tensor changed
before it was copied (its version counter moved): code that changes parameters outside the
optimizer makes the base wrong, and says so rather than write it.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .capture import clone_tree
from .errors import DiffCkptError
from .sharding import local

__all__ = ["DeferredCopy", "snapshot_tree"]


class DeferredCopy:
    """Copies of ``pairs`` (``(source, destination)`` host tensors) made on a thread of its own."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], step: int) -> None:
        self.step, self.count = step, len(pairs)
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = pairs
        self._versions = [src._version for src, _ in pairs]
        self._error: BaseException | None = None
        self.done = threading.Event()
        threading.Thread(target=self._copy, name="diffckpt-snapshot", daemon=True).start()

    def _copy(self) -> None:
        try:
            pairs = self._pairs
            assert pairs is not None
            torch._foreach_copy_([dst for _, dst in pairs], [src for src, _ in pairs])  # the GIL released
            changed = [tuple(src.shape) for (src, _), v in zip(pairs, self._versions) if src._version != v]
            if changed:
                self._error = DiffCkptError(
                    f"{len(changed)} parameter or optimizer state tensor(s) (shape {changed[0]}, ...) changed after "
                    f"the base at step {self.step} was taken and before it was copied, outside optimizer.step(): "
                    "diffckpt rebuilds every step from the optimizer's steps, so such a change is not in any "
                    "checkpoint. Make it part of the optimizer's step, or make it before the step is committed")
        except BaseException as exc:  # re-raised where the base is packed
            self._error = exc
        finally:
            self._pairs = None  # the sources are training's: not held past the copy
            self.done.set()

    def result(self) -> None:
        """Wait for the copies; raise if they failed or their sources changed first."""
        self.done.wait()
        if self._error is not None:
            raise self._error


def _storage(t: torch.Tensor) -> int | None:
    """Where a plain host tensor's memory starts; ``None`` for any other tensor (a GPU's, a
    tensor subclass's, one with no memory, or whose storage was freed, as FSDP2 frees a
    parameter's unsharded storage): those are cloned at once."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu":
        return None
    try:
        return t.untyped_storage().data_ptr() or None
    except RuntimeError:
        return None


def snapshot_tree(tree: Any, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                  step: int) -> tuple[Any, DeferredCopy | None]:
    """``clone_tree(tree)``, except that the host tensors holding ``module``'s parameters or
    ``optimizers``' state are copied by a :class:`DeferredCopy` (returned, ``None`` when there
    are none): the tree holds their destinations, filled once it is done."""
    owned = {_storage(local(p)) for p in module.parameters()}
    owned |= {_storage(t) for o in optimizers for s in o.state.values() for t in s.values() if isinstance(t, torch.Tensor)}
    owned.discard(None)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def walk(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and _storage(obj) in owned:
            src = obj.detach()
            pairs.append((src, torch.empty_like(src)))
            return pairs[-1][1]
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in obj):
            return type(obj)(walk(v) for v in obj) if type(obj) in (list, tuple) else clone_tree(obj)
        return clone_tree(obj)

    out = walk(tree)
    return out, (DeferredCopy(pairs, step) if pairs else None)
