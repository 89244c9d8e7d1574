"""PyTorch Lightning integration of diffckpt."""

from .callback import DiffCheckpoint
from .checkpoint_io import DiffCheckpointIO

__all__ = ["DiffCheckpoint", "DiffCheckpointIO"]
