"""Exception tree of diffckpt.

Every error raised on purpose by the library derives from :class:`DiffCkptError`; leaves also
derive from the matching built-in so that generic handlers keep working.
"""

from __future__ import annotations

__all__ = [
    "CheckpointNotFoundError",
    "ConcurrentWriterError",
    "CorruptRecordError",
    "DiffCkptError",
    "GradientMutatedError",
    "IncompatibleCheckpointError",
    "ReplayMismatchError",
    "ReplicaDivergenceError",
    "StorageError",
    "StorageUnavailableError",
    "UnsupportedConfigurationError",
]


class DiffCkptError(Exception):
    """Base class of every error diffckpt raises on purpose."""


class CorruptRecordError(DiffCkptError, ValueError):
    """Bytes on storage do not match their checksum or cannot be decoded."""


class CheckpointNotFoundError(DiffCkptError, FileNotFoundError):
    """The requested run, base or step is not durable on storage."""


class IncompatibleCheckpointError(DiffCkptError, ValueError):
    """The checkpoint was written for a different model or optimizer than the one given."""


class ReplayMismatchError(DiffCkptError, RuntimeError):
    """Replayed parameters do not match the fingerprint recorded during training."""


class UnsupportedConfigurationError(DiffCkptError, ValueError):
    """The training configuration cannot be replayed exactly and is refused."""


class StorageError(DiffCkptError, OSError):
    """Storage refused a read or write (permissions, full disk, unreachable bucket)."""


class StorageUnavailableError(StorageError):
    """Storage kept failing with transient errors (timeouts, 5xx, throttling, resets) for longer
    than the retry budget."""


class ConcurrentWriterError(DiffCkptError, RuntimeError):
    """Another job started writing to the same run root; this writer stopped (was fenced)."""


class GradientMutatedError(DiffCkptError, RuntimeError):
    """A gradient a step record took without a copy was changed in place before training let go
    of it; the record is refused (set ``CheckpointOptions(copy_gradients=True)``)."""


class ReplicaDivergenceError(DiffCkptError, RuntimeError):
    """Ranks that hold the same block of a parameter (HSDP's replicas, a layer outside the
    tensor-parallel plan) hold different values; only one of them records it, so the run would
    not resume as it trained."""
