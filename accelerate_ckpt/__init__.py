"""Hugging Face Accelerate integration of diffckpt."""

from diffckpt.extras import require_extra

require_extra("accelerate_ckpt", "accelerate", "accelerate")  # before the imports that need them

from .checkpointer import DiffCheckpointer
from .compression import GradientCompression
from .dataloader import TrackedDataLoader

__all__ = ["DiffCheckpointer", "GradientCompression", "TrackedDataLoader"]
