"""Capture on the training thread: what each optimizer step consumed, copied and nothing more.

The optimizer step post-hook sees the gradients exactly as the step used them (after clipping
and unscaling); they are cloned there, so later mutation by training cannot reach the record.
Encoding, compression and I/O happen in the background writer.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

import torch

from .codecs.compressor import GradientCompressor
from .errors import GradientMutatedError, UnsupportedConfigurationError
from .leases import GradientLeases, Lease
from .pausable import Pausable
from .sharding import local

__all__ = ["PendingCopy", "StepCapture", "clone_tree", "group_hyperparams", "tree_nbytes"]


class PendingCopy(Protocol):
    """A base's host copies still under way (``snapshot.DeferredCopy``), as the next step waits
    for them: a protocol, as snapshot.py imports this module and this one does not import it back."""

    done: threading.Event  # set once the copies are made (or failed)


_SCALARS = frozenset({int, float, bool, str, type(None)})


def _scalars(seq: list[Any] | tuple[Any, ...]) -> bool:
    """Whether a plain list or tuple holds only Python scalars, checked in C: the python RNG state
    recorded at every restorable step is a tuple of 625 ints, which would otherwise cost 625
    recursive calls per walk."""
    return set(map(type, seq)) <= _SCALARS


def clone_tree(obj: Any) -> Any:
    """Deep-copy containers and clone tensors, so the copy is immune to later in-place updates."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return list(obj) if type(obj) is list and _scalars(obj) else [clone_tree(v) for v in obj]
    if isinstance(obj, tuple):
        return obj if type(obj) is tuple and _scalars(obj) else tuple(clone_tree(v) for v in obj)
    if hasattr(obj, "copy") and type(obj).__module__ == "numpy":
        return obj.copy()
    return obj


def tree_nbytes(obj: Any) -> int:
    """Bytes held here by the tensors of a tree (used to bound the writer queue): a sharded
    tensor counts this rank's piece."""
    if isinstance(obj, torch.Tensor):
        return local(obj).numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tree_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return 0 if _scalars(obj) else sum(tree_nbytes(v) for v in obj)
    return 0


def group_hyperparams(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The hyperparameters of every param group (everything but the params), copied."""
    return [{k: clone_tree(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def check_replayable(optimizer: torch.optim.Optimizer) -> None:
    """Refuse optimizers whose step cannot be replayed from recorded gradients.

    A fused optimizer (``fused=True``, the transformers ``Trainer``'s default AdamW) is replayed
    exactly: replay runs the same fused kernel on the same gradients. Only a fused step that a
    ``GradScaler`` drives cannot be, because the gradients it consumes are still scaled; that is
    refused when it happens (:func:`check_step_arguments`), before the step changes anything.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise UnsupportedConfigurationError(
            "LBFGS re-evaluates the loss inside step() through a closure, so its steps cannot be "
            "replayed from recorded gradients; use a first-order optimizer (SGD, Adam, AdamW, ...) "
            "or checkpoint this run with full checkpoints")


def check_step_arguments(optimizer: torch.optim.Optimizer, kwargs: dict[str, Any]) -> None:
    """Refuse a step given a ``GradScaler``'s scale (a fused optimizer under fp16 autocast).

    ``GradScaler.step`` hands such an optimizer its scale as the ``grad_scale``/``found_inf``
    attributes (or a ``grad_scaler`` argument) and leaves the gradients scaled, so the recorded
    gradients are not the ones the update used.
    """
    if "grad_scaler" in kwargs or any(getattr(optimizer, a, None) is not None for a in ("grad_scale", "found_inf")):
        raise UnsupportedConfigurationError(
            f"{type(optimizer).__name__}(fused=True) was stepped by a GradScaler, which leaves the "
            "gradients scaled and unscales them inside the fused kernel; diffckpt records the "
            "gradients a step consumed, so it cannot replay this. Use fused=False (foreach, the "
            "default) with the scaler, or bf16 without a scaler")


class StepCapture(Pausable):
    """Records, per optimizer step, the hyperparameters in force and a copy of every gradient,
    or, with a ``compressor``, the payloads the gradients were decoded from."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], compressor: GradientCompressor | None = None,
                 copy_gradients: bool = False, skip: frozenset[int] = frozenset()) -> None:
        for opt in optimizers:
            check_replayable(opt)
        self.optimizers = list(optimizers)
        self.compressor = compressor
        # Gradients are taken without a copy when training lets them go after the step.
        # ``skip``: parameters whose gradients are recorded by another rank (``replicas.not_owned``).
        self.leases = GradientLeases(self.optimizers, always_copy=copy_gradients or compressor is not None, skip=skip)
        self._events: list[dict[str, Any]] = []
        self._taken: list[Lease] = []
        self._paused = False
        self._depth = [0] * len(self.optimizers)
        self._update_start = 0.0
        self._copying: list[PendingCopy] = []  # a base's host copies the next step must wait for
        self.copy_s = 0.0  # time spent copying gradients since the last take()
        self.update_s = 0.0  # time the optimizer updates took since the last take()
        self._handles = []
        for i, opt in enumerate(self.optimizers):
            self._handles.append(opt.register_step_pre_hook(self._make_pre_hook(i)))
            self._handles.append(opt.register_step_post_hook(self._make_hook(i)))

    def _make_pre_hook(self, index: int):
        def pre_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if not self._paused:
                check_step_arguments(optimizer, kwargs)
                if not self._depth[index]:
                    self.leases.before_step()  # the step may change gradients a record still holds
                    self.end_copies()  # ... and the parameters a base is still copying
            self._depth[index] += 1
            if self._depth[index] == 1:
                self._update_start = time.perf_counter()
        return pre_hook

    def mark_update_start(self) -> None:
        """Say that the optimizer's update begins now: a step given a closure (Lightning) runs
        forward and backward inside ``step()`` after the pre-hooks, and replay repeats only the
        update."""
        self._update_start = time.perf_counter()

    def _make_hook(self, index: int):
        def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            # A subclass whose step() calls super().step() fires the hooks once per level;
            # only the outermost step is the one training took.
            self._depth[index] = max(0, self._depth[index] - 1)
            if self._paused or self._depth[index]:
                return
            start = time.perf_counter()
            self.update_s += start - self._update_start
            event: dict[str, Any] = {"optimizer": index, "groups": group_hyperparams(optimizer)}
            coded = self.compressor.consumed(optimizer) if self.compressor is not None else None
            if coded is not None:  # the payloads are fresh tensors: no copy needed
                event.update(coded)
            else:
                # Under FSDP2 the gradient is a DTensor: this rank's compact piece is what it
                # consumed (the padding lives only in the reduce-scatter buffer); it is copied.
                event["grads"], lease = self.leases.take(index, optimizer, local)
                if lease is not None:
                    self._taken.append(lease)
            self._events.append(event)
            self.copy_s += time.perf_counter() - start
        return hook

    def take(self) -> list[dict[str, Any]]:
        """Return the steps captured since the last call (and reset the timings)."""
        events, self._events = self._events, []
        self.copy_s = self.update_s = 0.0
        return events

    def take_leases(self) -> list[Lease]:
        """The leases on gradients the steps since the last call took without a copy (the
        writer waits for them before it reads those gradients)."""
        self.leases.settle(before_change=False)  # what training let go of already
        taken, self._taken = self._taken, []
        for lease in taken:
            if lease.failure is not None:  # refused here, before the record is queued
                raise GradientMutatedError(lease.failure)
        return [lease for lease in taken if not lease.ended]

    def wait_before_step(self, copying: PendingCopy | None) -> None:
        """Make the next ``optimizer.step()`` wait for ``copying`` (a base's host copies)."""
        if copying is not None:
            self._copying.append(copying)

    def end_copies(self) -> None:
        """Wait for the bases' host copies (before anything may change what they copy)."""
        for copying in self._copying:
            copying.done.wait()
        self._copying.clear()

    def end_leases(self, spare: list[Lease]) -> None:
        """End every lease but ``spare`` now, copying what training still holds (before training
        waits for the writer, which may be waiting for a lease of a record handed over before;
        ``spare``: the leases of the record being handed over)."""
        self.leases.settle(before_change=False, resolve=True, spare=spare)

    def remove(self) -> None:
        self.leases.remove()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
