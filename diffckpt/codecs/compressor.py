"""Compressed training whose payloads are the diffs (the LowDiff idea).

A :class:`GradientCompressor` runs a codec on the gradients that training consumes: as the DDP
communication hook under DDP (the reduced payload is identical on every rank), or on the local
gradients after backward in a single process (the same computation for a world of one). Each
gradient is replaced by the decoded payload, so the optimizer consumes exactly what the payload
says; capture stores the payloads instead of dense copies and replay decodes them again.

What training does to the gradients between compression and ``optimizer.step()`` must be
replayable too: gradient clipping, when the adapter declares it (:meth:`set_clipping`), is
recorded and replayed with the same ``torch.nn.utils`` function. Capture checks that the decoded
(and clipped) payloads equal the consumed gradients bit for bit on the first step and every
``check_every`` steps; on a mismatch that step and every later one are checked, and a step that
does not match is recorded dense, so a diff never says something training did not do.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, cast

import torch

from ..pausable import Pausable
from .base import Codec, Payload

__all__ = ["GradientCompressor", "check_codec", "clip_gradients", "clip_tensors"]

log = logging.getLogger("diffckpt")


def clip_gradients(params: list[torch.Tensor], clip: dict[str, Any] | None) -> None:
    """Clip the gradients of ``params`` as recorded (``{"kind": "norm"|"value", ...}``)."""
    if not clip:
        return
    if clip["kind"] == "norm":
        torch.nn.utils.clip_grad_norm_(params, clip["max_norm"], norm_type=clip["norm_type"])
    elif clip["kind"] == "value":
        torch.nn.utils.clip_grad_value_(params, clip_value=clip["clip_value"])
    else:
        raise ValueError(f"unknown gradient clipping {clip['kind']!r} in a record")


class _Holder:
    """What torch's clipping functions read of a parameter: its ``.grad``."""

    __slots__ = ("grad",)

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad


def clip_tensors(grads: list[torch.Tensor], clip: dict[str, Any] | None) -> None:
    """Clip ``grads`` in place as :func:`clip_gradients` clips parameters whose gradients they
    are, in this order: the same function over the same tensors gives the same bits, without
    installing them as ``.grad`` first (replay clips a step's decoded gradients ahead, on a
    prefetch thread)."""
    if clip:
        clip_gradients(cast(list[torch.Tensor], [_Holder(g) for g in grads]), clip)


def check_codec(codec: Any) -> None:
    """Raise ``TypeError`` unless ``codec`` is a diffckpt codec."""
    if not isinstance(codec, Codec):
        raise TypeError(f"codec must be a diffckpt codec (diffckpt.codecs.TopK, PowerSGD or "
                        f"LowPrecision), got {codec!r}")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.is_floating_point():
        view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.view(view), b.view(view)
    return torch.equal(a, b)


class GradientCompressor(Pausable):
    """Applies ``codec`` to a model's gradients and keeps each step's payloads for its diff.

    Args:
        codec: a :class:`~diffckpt.codecs.Codec` (``TopK``, ``PowerSGD``, ``LowPrecision``).
        module: the model; payloads and codec state are keyed by its parameter names.
        check_every: compare decoded payloads with the consumed gradients on the first step and
            every this many steps after it.
    """

    def __init__(self, codec: Codec, module: torch.nn.Module, check_every: int = 50) -> None:
        check_codec(codec)
        self.codec = codec
        self.names = {id(p): n for n, p in module.named_parameters()}
        self.group: Any = None
        self.clip: dict[str, Any] | None = None
        self.check_every = check_every
        self._payloads: dict[str, Payload] = {}
        self._steps = 0
        self._warned = False
        self._hooked: Any = None

    # ------------------------------------------------------------- compressing
    def set_clipping(self, kind: str | None, value: float | None = None, norm_type: float = 2.0) -> None:
        """Declare the gradient clipping training applies after compression (``"norm"`` as
        ``clip_grad_norm_``, ``"value"`` as ``clip_grad_value_``, ``None`` for none).

        Replay clips the optimizer's parameters in param-group order. For ``"norm"``, training
        must clip the same list in the same order (``[p for g in opt.param_groups for p in
        g["params"]]``): the total norm is a float sum, and another order changes its last bits.
        The Lightning and Accelerate adapters do this. A plain loop that clips ``model.parameters()``
        in another order replays with different last bits, which the payload checks
        (``check_every``) and fingerprints detect only at the steps where they run.
        """
        if kind is None or value is None:
            self.clip = None
        elif kind == "norm":
            self.clip = {"kind": "norm", "max_norm": float(value), "norm_type": float(norm_type)}
        elif kind == "value":
            self.clip = {"kind": "value", "clip_value": float(value)}
        else:
            raise ValueError(f"gradient clipping must be 'norm' or 'value', got {kind!r}")

    def _key(self, p: torch.Tensor) -> str:
        try:
            return self.names[id(p)]
        except KeyError:
            raise ValueError("a parameter being compressed is not a parameter of the model the "
                             "GradientCompressor was built with") from None

    def compress_(self, params: Iterable[torch.Tensor]) -> None:
        """Single process: replace each gradient of ``params`` by its compressed-and-decoded value.

        Call after backward (and unscaling), before clipping and ``optimizer.step()``. Does
        nothing while :meth:`paused` (replay steps on gradients that were decoded already).
        """
        if self._paused:
            return
        grads = [(p, p.grad) for p in params if p.grad is not None]
        payloads = self.codec.encode({self._key(p): g for p, g in grads}, None)
        for p, g in grads:
            g.copy_(self.codec.decode(payloads[self._key(p)], g.shape, g.dtype))
        self._payloads.update(payloads)

    def ddp_hook(self, state: Any, bucket: Any) -> torch.futures.Future:
        """DDP communication hook: exchange the bucket's gradients through the codec."""
        grads = bucket.gradients()  # views into bucket.buffer()
        keyed = {self._key(p): g for p, g in zip(bucket.parameters(), grads)}
        payloads = self.codec.encode(keyed, self.group)
        for key, g in keyed.items():
            g.copy_(self.codec.decode(payloads[key], g.shape, g.dtype))
        self._payloads.update(payloads)
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    def register_ddp(self, ddp_module: torch.nn.parallel.DistributedDataParallel) -> None:
        """Run the codec as ``ddp_module``'s communication hook (before its first backward);
        calling it again for the same module does nothing."""
        if self._hooked is ddp_module:
            return
        self.group = ddp_module.process_group
        # DDP checks the hook's annotations against its own types: register an unannotated one.
        ddp_module.register_comm_hook(None, lambda state, bucket: self.ddp_hook(state, bucket))
        self._hooked = ddp_module

    # ---------------------------------------------------------------- capture
    def consumed(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """What ``optimizer``'s step just consumed, as payloads: the part of a step record that
        replaces dense gradients, or ``None`` when it must be recorded dense."""
        payloads: list[list[Payload | None]] = []
        missing = None
        for group in optimizer.param_groups:
            row: list[Payload | None] = []
            for p in group["params"]:
                payload = None if p.grad is None else self._payloads.pop(self.names.get(id(p), ""), None)
                if p.grad is not None and payload is None:
                    missing = self.names.get(id(p), "a parameter outside the model")
                row.append(payload)
            payloads.append(row)
        if missing is not None:
            self._warn(f"the gradient of {missing!r} was not compressed")
            return None
        self._steps += 1
        if self.check_every == 1 or self._steps % self.check_every == 1:
            problem = self._check(optimizer, payloads)
            if problem is not None:
                self.check_every = 1
                self._warn(problem)
                return None
        return {"codec": self.codec.config(), "payloads": payloads, "clip": self.clip}

    def _check(self, optimizer: torch.optim.Optimizer, payloads: list[list[Payload | None]]) -> str | None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        flat = [x for row in payloads for x in row]
        consumed = [p.grad for p in params]
        try:
            for p, payload in zip(params, flat):
                if payload is not None:
                    p.grad = self.codec.decode(payload, p.shape, p.grad.dtype)
            clip_gradients(params, self.clip)
            for p, g, name in zip(params, consumed, (self.names.get(id(p), "?") for p in params)):
                if g is not None and not _same_bits(p.grad, g):
                    return (f"the gradient of {name!r} changed between compression and "
                            "optimizer.step() in a way diffckpt does not record (clipping it was not "
                            "told about, a hook that scales gradients...)")
        finally:
            for p, g in zip(params, consumed):
                p.grad = g
        return None

    def _warn(self, problem: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("diffckpt: %s; such steps are recorded with dense gradients (exact, but "
                        "as large as uncompressed diffs), and every step is checked from now on", problem)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's codec state (error-feedback residuals, warm-start factors)."""
        return self.codec.state_dict()

    def restore(self, state: dict[str, torch.Tensor] | None, payloads: dict[str, Payload]) -> None:
        """Set the codec state after a restore: ``state`` (this rank's, saved with the base) when
        the restored step is the base's, else what the last replayed ``payloads`` carry."""
        self._payloads.clear()
        if state is not None:
            self.codec.load_state_dict(state)
            return
        self.codec.load_state_dict({})
        self.codec.resume(payloads)
        if self.codec.error_feedback:
            log.info("diffckpt: resumed between bases with %s: parameters and optimizer state are "
                     "exact; error-feedback residuals restart from zero", self.codec.name)
