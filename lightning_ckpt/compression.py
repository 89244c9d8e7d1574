"""Compressed training under Lightning: where the codec runs, and what diffckpt is told about it.

Under DDP the codec is the communication hook, registered on the DDP module (Lightning registers
comm hooks only on CUDA). In a single process it runs on the gradients in
``on_before_optimizer_step``: after backward and unscaling, before clipping, where a hook would
have run. Either way, clipping configured on the Trainer comes after it and is recorded.
"""

from __future__ import annotations

import lightning.pytorch as pl
from torch.nn.parallel import DistributedDataParallel

from diffckpt.codecs import Codec
from diffckpt.compression import GradientCompressor
from diffckpt.errors import UnsupportedConfigurationError

__all__ = ["is_ddp", "make_compressor"]


def is_ddp(trainer: pl.Trainer) -> bool:
    return isinstance(trainer.strategy.model, DistributedDataParallel)


def make_compressor(codec: Codec, trainer: pl.Trainer, module: pl.LightningModule,
                    check_every: int) -> GradientCompressor:
    """A compressor for ``module``, with the Trainer's gradient clipping declared; refuses
    configurations whose compressed gradients cannot be recorded exactly."""
    compressor = GradientCompressor(codec, module, check_every)
    if getattr(trainer.strategy, "_ddp_comm_hook", None) is not None:
        raise UnsupportedConfigurationError(
            "DiffCheckpoint(codec=...) runs the codec as the DDP communication hook, but the strategy "
            "already has ddp_comm_hook set; drop ddp_comm_hook (the codec replaces it) or drop codec=")
    if trainer.world_size > 1 and str(trainer.precision).startswith("16"):
        raise UnsupportedConfigurationError(
            "DiffCheckpoint(codec=...) under DDP with precision='16-mixed': the communication hook "
            "sees gradients still multiplied by the loss scale, so the payloads are not what the "
            "optimizer consumes. Use precision='bf16-mixed' (no loss scaling) or drop codec=")
    algorithm = trainer.gradient_clip_algorithm
    kind = getattr(algorithm, "value", algorithm) or "norm"
    compressor.set_clipping(kind if trainer.gradient_clip_val else None, trainer.gradient_clip_val)
    return compressor
