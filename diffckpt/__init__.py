"""diffckpt: differential checkpointing for PyTorch training.

Record what each optimizer step consumed as a small diff, keep periodic full bases, and rebuild
any step by replaying the optimizer. This package is the framework-free core; see
``lightning_ckpt`` and ``accelerate_ckpt`` for the integrations.
"""

from .engine import CheckpointEngine
from .errors import (
    CheckpointNotFoundError,
    CorruptRecordError,
    DiffCkptError,
    IncompatibleCheckpointError,
    ReplayMismatchError,
    StorageError,
    UnsupportedConfigurationError,
)
from .loading import load_state
from .options import CheckpointOptions
from .replay import ReplayResult
from .storage import FsspecStorage, Storage, open_storage

__version__ = "0.1.0"

__all__ = [
    "CheckpointEngine",
    "CheckpointNotFoundError",
    "CheckpointOptions",
    "CorruptRecordError",
    "DiffCkptError",
    "FsspecStorage",
    "IncompatibleCheckpointError",
    "ReplayMismatchError",
    "ReplayResult",
    "Storage",
    "StorageError",
    "UnsupportedConfigurationError",
    "load_state",
    "open_storage",
]
