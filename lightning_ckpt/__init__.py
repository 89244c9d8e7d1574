"""PyTorch Lightning integration of diffckpt."""

from diffckpt.extras import require_extra

require_extra("lightning_ckpt", "lightning", "lightning")  # before the imports that need them

from .callback import DiffCheckpoint
from .checkpoint_io import DiffCheckpointIO
from .fabric import FabricCheckpointer

__all__ = ["DiffCheckpoint", "DiffCheckpointIO", "FabricCheckpointer"]
