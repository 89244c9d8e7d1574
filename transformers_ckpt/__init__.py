"""Hugging Face transformers ``Trainer`` integration of diffckpt."""

from .callback import DiffCheckpointCallback

__all__ = ["DiffCheckpointCallback"]
