"""Compressed training under Lightning: where the codec runs, and what diffckpt is told about it.

Under DDP the codec is the communication hook, registered on the DDP module (Lightning registers
comm hooks only on CUDA). In a single process it runs on the gradients in
``on_before_optimizer_step``: after backward and unscaling, before clipping, where a hook would
have run. Either way, gradient clipping comes after it and is recorded as it is applied: the
precision plugin's ``clip_gradients``, through which both the Trainer's ``gradient_clip_val`` and a
``configure_gradient_clipping`` override that calls ``self.clip_gradients`` go, is wrapped to note
each call's arguments for the step.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.nn.parallel import DistributedDataParallel

from diffckpt.errors import UnsupportedConfigurationError
from diffckpt.integration import Codec, GradientCompressor, check_codec

__all__ = ["GradientCompression"]


class GradientCompression(pl.Callback):
    """Compressed training with ``codec``, without checkpoints.

    ``DiffCheckpoint(codec=...)`` runs exactly this and records the payloads; use this callback
    alone for the same training without diffckpt's checkpoints (a baseline, a comparison). Do not
    combine the two: the gradients would be compressed twice.

    Args:
        codec: a codec of :mod:`diffckpt.codecs`.
        check_every: see :class:`diffckpt.GradientCompressor`.
    """

    def __init__(self, codec: Codec, check_every: int = 50) -> None:
        check_codec(codec)
        self.codec = codec
        self.check_every = check_every
        self.compressor: GradientCompressor | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.compressor is not None:
            return
        if getattr(trainer.strategy, "_ddp_comm_hook", None) is not None:
            raise UnsupportedConfigurationError(
                "codec=... runs the codec as the DDP communication hook, but the strategy already has "
                "ddp_comm_hook set; drop ddp_comm_hook (the codec replaces it) or drop codec=")
        if trainer.world_size > 1 and str(trainer.precision).startswith("16"):
            raise UnsupportedConfigurationError(
                "codec=... under DDP with precision='16-mixed': the communication hook sees gradients "
                "still multiplied by the loss scale, so the payloads are not what the optimizer "
                "consumes. Use precision='bf16-mixed' (no loss scaling) or drop codec=")
        self.compressor = GradientCompressor(self.codec, pl_module, self.check_every)
        self._watch_clipping(trainer.precision_plugin, self.compressor)

    @staticmethod
    def _watch_clipping(plugin: Any, compressor: GradientCompressor) -> None:
        """Record every clipping the precision plugin applies, with the arguments it was given."""
        if getattr(plugin.clip_gradients, "_diffckpt", False):
            return
        clip = plugin.clip_gradients

        def clip_gradients(optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = "norm") -> None:
            clip(optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)
            if clip_val and clip_val > 0:  # Lightning clips nothing for 0 or None
                kind = getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm) or "norm"
                compressor.set_clipping(kind, clip_val)

        clip_gradients._diffckpt = True  # type: ignore[attr-defined]
        plugin.clip_gradients = clip_gradients

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.compressor is not None and self._ddp(trainer):
            self.compressor.register_ddp(trainer.strategy.model)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if self.compressor is None:
            return
        self.compressor.set_clipping(None)  # clipping, if any, comes next and notes itself
        if not self._ddp(trainer):
            self.compressor.compress_(p for group in optimizer.param_groups for p in group["params"])

    @staticmethod
    def _ddp(trainer: pl.Trainer) -> bool:
        return isinstance(trainer.strategy.model, DistributedDataParallel)
