"""Hugging Face Accelerate integration of diffckpt."""

from .checkpointer import DiffCheckpointer
from .compression import GradientCompression
from .dataloader import TrackedDataLoader

__all__ = ["DiffCheckpointer", "GradientCompression", "TrackedDataLoader"]
