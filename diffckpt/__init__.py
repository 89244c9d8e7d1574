"""diffckpt: differential checkpointing for PyTorch training.

Record what each optimizer step consumed as a small diff, keep periodic full bases, and rebuild
any step by replaying the optimizer; with compressed training (``diffckpt.codecs`` and
:class:`GradientCompressor`), the compressed payloads are the diffs. This package is the
framework-free core; see
``lightning_ckpt`` and ``accelerate_ckpt`` for the integrations.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what mypy and IDEs see; at run time the names load on first use (below)
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
        ReplicaDivergenceError,
        StorageError,
        StorageUnavailableError,
        UnsupportedConfigurationError,
    )
    from .export import export_checkpoint
    from .lifecycle.compaction import CompactionResult, compact
    from .lifecycle.retention import collect_garbage
    from .loading import load_state
    from .options import CheckpointOptions
    from .policyoptions import RetentionPolicy, RetryPolicy, TuningOptions
    from .replay import ReplayResult
    from .storage import FsspecStorage, Storage, open_storage

__version__ = "0.1.0"

# PEP 562: the public names are imported on first access, so that the command line's ``--help``,
# ``ls`` and ``gc`` start without importing torch (about 2.7 s of a 3 s start). Each name maps to
# the module that defines it.
_LAZY = {
    "CheckpointEngine": ".engine",
    "CheckpointNotFoundError": ".errors",
    "CheckpointOptions": ".options",
    "CompactionResult": ".lifecycle.compaction",
    "ConcurrentWriterError": ".errors",
    "CorruptRecordError": ".errors",
    "DiffCkptError": ".errors",
    "FsspecStorage": ".storage",
    "GradientCompressor": ".codecs.compressor",
    "GradientMutatedError": ".errors",
    "IncompatibleCheckpointError": ".errors",
    "ReplayMismatchError": ".errors",
    "ReplicaDivergenceError": ".errors",
    "ReplayResult": ".replay",
    "RetentionPolicy": ".policyoptions",
    "RetryPolicy": ".policyoptions",
    "Storage": ".storage",
    "StorageError": ".errors",
    "StorageUnavailableError": ".errors",
    "TuningOptions": ".policyoptions",
    "UnsupportedConfigurationError": ".errors",
    "collect_garbage": ".lifecycle.retention",
    "compact": ".lifecycle.compaction",
    "export_checkpoint": ".export",
    "load_state": ".loading",
    "open_storage": ".storage",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later accesses skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

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
    "ReplicaDivergenceError",
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
