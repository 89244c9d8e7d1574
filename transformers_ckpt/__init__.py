"""Hugging Face transformers ``Trainer`` integration of diffckpt."""

from diffckpt.extras import require_extra

require_extra("transformers_ckpt", "transformers", "transformers", "accelerate")  # before the imports that need them

from .callback import DiffCheckpointCallback

__all__ = ["DiffCheckpointCallback"]
