"""The public API is each package's ``__all__``; changes to it must be deliberate."""

import diffckpt
import lightning_ckpt


def test_core_public_api():
    assert sorted(diffckpt.__all__) == [
        "CheckpointEngine", "CheckpointNotFoundError", "CheckpointOptions", "CompactionResult",
        "ConcurrentWriterError",
        "CorruptRecordError", "DiffCkptError", "FsspecStorage", "GradientCompressor", "GradientMutatedError",
        "IncompatibleCheckpointError",
        "ReplayMismatchError", "ReplayResult", "ReplicaDivergenceError", "RetentionPolicy", "RetryPolicy", "Storage", "StorageError",
        "StorageUnavailableError", "TuningOptions", "UnsupportedConfigurationError", "collect_garbage", "compact",
        "export_checkpoint",
        "load_state", "open_storage",
    ]
    assert all(hasattr(diffckpt, name) for name in diffckpt.__all__)


def test_codecs_public_api():
    import diffckpt.codecs

    assert sorted(diffckpt.codecs.__all__) == [
        "Codec", "LowPrecision", "Payload", "PowerSGD", "TopK", "codec_from_config"]


def test_lightning_public_api():
    assert sorted(lightning_ckpt.__all__) == ["DiffCheckpoint", "DiffCheckpointIO", "FabricCheckpointer"]
    assert all(hasattr(lightning_ckpt, name) for name in lightning_ckpt.__all__)


def test_accelerate_public_api():
    import accelerate_ckpt

    assert sorted(accelerate_ckpt.__all__) == ["DiffCheckpointer", "GradientCompression", "TrackedDataLoader"]
    assert all(hasattr(accelerate_ckpt, name) for name in accelerate_ckpt.__all__)


def test_transformers_public_api():
    import transformers_ckpt

    assert sorted(transformers_ckpt.__all__) == ["DiffCheckpointCallback"]
    assert all(hasattr(transformers_ckpt, name) for name in transformers_ckpt.__all__)


def test_error_tree_inherits_builtins():
    assert issubclass(diffckpt.CorruptRecordError, ValueError)
    assert issubclass(diffckpt.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(diffckpt.StorageError, OSError)
    assert issubclass(diffckpt.StorageUnavailableError, diffckpt.StorageError)
    assert issubclass(diffckpt.ConcurrentWriterError, RuntimeError)
    for name in ("CorruptRecordError", "CheckpointNotFoundError", "IncompatibleCheckpointError",
                 "ReplayMismatchError", "UnsupportedConfigurationError", "StorageError",
                 "StorageUnavailableError", "ConcurrentWriterError"):
        assert issubclass(getattr(diffckpt, name), diffckpt.DiffCkptError)


def test_core_imports_no_framework():
    import subprocess
    import sys

    code = ("import sys, diffckpt, diffckpt.cli; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'accelerate', 'transformers')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
