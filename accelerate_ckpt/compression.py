"""Compressed training in an Accelerate loop: where the codec runs, and what diffckpt is told.

Under DDP the codec is the communication hook of the DDP module ``accelerator.prepare`` returned;
``accelerator.clip_grad_norm_`` / ``clip_grad_value_`` run after it, so each call is noted (with its
arguments) for the step's record. In a single process the codec runs in the optimizer's step
pre-hook: after accumulation, unscaling and clipping, so the payload decodes to exactly what the
step consumes and no clipping needs recording.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DDPCommunicationHookType
from torch.nn.parallel import DistributedDataParallel

from diffckpt.errors import UnsupportedConfigurationError
from diffckpt.integration import Codec, GradientCompressor, check_codec

from .support import prepared_model

__all__ = ["GradientCompression"]


class GradientCompression:
    """Compressed training with ``codec`` in an Accelerate loop, without checkpoints.

    ``DiffCheckpointer(codec=...)`` runs exactly this and records the payloads; create this alone
    (after ``accelerator.prepare``) for the same training without diffckpt's checkpoints. Do not
    combine the two: the gradients would be compressed twice.

    Args:
        accelerator: the ``Accelerator`` that prepared the model and optimizers.
        codec: a codec of :mod:`diffckpt.codecs`.
        model: the model ``accelerator.prepare`` returned; required under DDP (the codec is its
            communication hook) or when several models were prepared.
        check_every: see :class:`diffckpt.GradientCompressor`.
    """

    def __init__(self, accelerator: Accelerator, codec: Codec, model: Any = None, check_every: int = 50) -> None:
        check_codec(codec)
        handler = accelerator.ddp_handler
        if handler is not None and handler.comm_hook != DDPCommunicationHookType.NO:
            raise UnsupportedConfigurationError(
                f"codec=... runs the codec as the DDP communication hook, but DistributedDataParallelKwargs "
                f"already sets comm_hook={handler.comm_hook.value!r}; drop comm_hook (the codec replaces "
                "it) or drop codec=")
        if accelerator.scaler is not None and accelerator.num_processes > 1:
            raise UnsupportedConfigurationError(
                "codec=... under DDP with mixed_precision='fp16': the communication hook sees gradients "
                "still multiplied by the loss scale, so the payloads are not what the optimizer "
                "consumes. Use mixed_precision='bf16' (no loss scaling) or drop codec=")
        prepared = prepared_model(accelerator, model)
        self.accelerator = accelerator
        self.compressor = GradientCompressor(
            codec, accelerator.unwrap_model(prepared, keep_torch_compile=False), check_every)
        if isinstance(prepared, DistributedDataParallel):
            self.compressor.register_ddp(prepared)
            self._watch_clipping()
        elif accelerator.num_processes > 1:
            raise UnsupportedConfigurationError(
                "codec=... with several processes needs the DDP module to run the codec as its "
                "communication hook: pass model=<the model accelerator.prepare returned>")
        else:
            for po in accelerator._optimizers:
                po.optimizer.register_step_pre_hook(self._compress)
        for po in accelerator._optimizers:
            self._after_each_step(po)

    def _compress(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # compress_ does nothing while the engine replays (the compressor is paused then).
        self.compressor.compress_(p for group in optimizer.param_groups for p in group["params"])

    def _watch_clipping(self) -> None:
        """Note each clipping Accelerate applies after the communication hook, for replay."""
        acc, compressor = self.accelerator, self.compressor
        clip_norm, clip_value = acc.clip_grad_norm_, acc.clip_grad_value_

        def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
            total = clip_norm(parameters, max_norm, norm_type=norm_type)
            compressor.set_clipping("norm", max_norm, norm_type)
            return total

        def clip_grad_value_(parameters: Any, clip_value_: float) -> None:
            clip_value(parameters, clip_value_)
            compressor.set_clipping("value", clip_value_)

        acc.clip_grad_norm_ = clip_grad_norm_  # type: ignore[method-assign]
        acc.clip_grad_value_ = clip_grad_value_  # type: ignore[method-assign]

    def _after_each_step(self, po: Any) -> None:
        """A clipping noted for one step must not carry over to the next."""
        step = po.step

        def stepped(*args: Any, **kwargs: Any) -> Any:
            try:
                return step(*args, **kwargs)
            finally:
                if self.accelerator.gradient_state.sync_gradients:
                    self.compressor.set_clipping(None)

        po.step = stepped
