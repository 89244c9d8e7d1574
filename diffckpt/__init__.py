"""diffckpt: differential checkpointing for PyTorch training.

Record what each optimizer step consumed as a small diff, keep periodic full bases, and rebuild
any step by replaying the optimizer; with compressed training (``diffckpt.codecs`` and
:class:`GradientCompressor`), the compressed payloads are the diffs. This package is the
framework-free core; see
``lightning_ckpt`` and ``accelerate_ckpt`` for the integrations.
"""

from .codecs.compressor import GradientCompressor
from .engine import CheckpointEngine
from .errors import (
    CheckpointNotFoundError,
    ConcurrentWriterError,
    CorruptRecordError,
    DiffCkptError,
    GradientMutatedError,
    IncompatibleCheckpointError,
    ReplayMismatchError,
    StorageError,
    StorageUnavailableError,
    UnsupportedConfigurationError,
)
from .export import export_checkpoint
from .lifecycle.compaction import CompactionResult, compact
from .lifecycle.retention import RetentionPolicy, collect_garbage
from .loading import load_state
from .options import CheckpointOptions
from .replay import ReplayResult
from .storage import FsspecStorage, Storage, open_storage
from .storage.retry import RetryPolicy
from .tuning.model import TuningOptions

__version__ = "0.1.0"

__all__ = [
    "CheckpointEngine",
    "CheckpointNotFoundError",
    "CheckpointOptions",
    "CompactionResult",
    "ConcurrentWriterError",
    "CorruptRecordError",
    "DiffCkptError",
    "FsspecStorage",
    "GradientCompressor",
    "GradientMutatedError",
    "IncompatibleCheckpointError",
    "ReplayMismatchError",
    "ReplayResult",
    "RetentionPolicy",
    "RetryPolicy",
    "Storage",
    "StorageError",
    "StorageUnavailableError",
    "TuningOptions",
    "UnsupportedConfigurationError",
    "collect_garbage",
    "compact",
    "export_checkpoint",
    "load_state",
    "open_storage",
]
