"""The storage contract: :class:`Storage`, the optional :class:`InspectableStorage` and how the
wrappers of ``open_storage`` expose it exactly when what they wrap has it; ``RetryPolicy``'s
budget setting; reference files sized without reading them. Local disk and memory only."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import threading
from pathlib import Path
from typing import Any

import pytest

from diffckpt import CheckpointNotFoundError, StorageUnavailableError, UnsupportedConfigurationError
from diffckpt.format import BaseName
from diffckpt.lifecycle.retention import RetentionPolicy, plan_gc
from diffckpt.runstore import RunStore
from diffckpt.storage import (
    FsspecStorage,
    InspectableStorage,
    RetryingInspectableStorage,
    RetryingStorage,
    RetryPolicy,
    Storage,
    open_storage,
    unwrap,
)
from diffckpt.storage.retry import retry_call


class Plain:
    """A caller's storage with the six methods only (over a dict)."""

    def __init__(self) -> None:
        self.url = "memory://plain"
        self.objects: dict[str, bytes] = {}

    def write(self, path: str, data: Any) -> None:
        self.objects[path] = data if isinstance(data, bytes) else b"".join(data)

    def create(self, path: str, data: bytes) -> bool:
        if path in self.objects:
            return False
        self.objects[path] = data
        return True

    def read(self, path: str) -> bytes:
        if path not in self.objects:
            raise FileNotFoundError(path)
        return self.objects[path]

    def list(self, prefix: str) -> dict[str, int]:
        return {p: len(d) for p, d in self.objects.items() if p.startswith(prefix)}

    def delete(self, path: str) -> None:
        self.objects.pop(path, None)

    def exists(self, path: str) -> bool:
        return path in self.objects


class Inspectable(Plain):
    """A caller's storage that also says when each object was written, and has one upload."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted: list[tuple[str, str]] = []

    def details(self, prefix: str, hidden: bool = False) -> dict[str, tuple[int, float | None]]:
        return {p: (n, 0.0) for p, n in self.list(prefix).items()}  # everything is ancient

    def stat(self, path: str) -> tuple[int, float | None]:
        if path not in self.objects:
            raise OSError(5, "flaky disk", path)  # a bare OSError: explained by the wrapper
        return len(self.objects[path]), 0.0

    def incomplete_uploads(self) -> list[tuple[str, str, float | None]]:
        return [("diffs/big.seg", "upload-1", 0.0)]

    def abort_upload(self, path: str, upload_id: str) -> None:
        self.aborted.append((path, upload_id))


def test_fsspec_storage_and_its_wrappers_are_inspectable(tmp_path: Path) -> None:
    inner = FsspecStorage(str(tmp_path / "run"))
    assert isinstance(inner, Storage) and isinstance(inner, InspectableStorage)
    storage = open_storage(tmp_path / "run")
    assert isinstance(storage, RetryingInspectableStorage) and isinstance(storage, InspectableStorage)
    assert isinstance(storage, RetryingStorage)  # what the writer checks to add its cancel event
    cancellable = storage.with_cancel(threading.Event())  # type: ignore[attr-defined]
    assert isinstance(cancellable, InspectableStorage)
    assert isinstance(RetryingStorage(inner), InspectableStorage)  # built directly, too
    for clone in (copy.copy(storage), pickle.loads(pickle.dumps(RetryingStorage(inner)))):
        assert type(clone) is RetryingInspectableStorage

    storage.write("a/b.bin", b"12345")
    storage.write("a/.c.tmp", b"x")
    size, mtime = storage.stat("a/b.bin")  # type: ignore[attr-defined]
    assert size == 5 and mtime is not None
    details = storage.details("", hidden=True)  # type: ignore[attr-defined]
    assert set(details) == {"a/b.bin", "a/.c.tmp"} and details["a/b.bin"][0] == 5
    assert set(storage.details("")) == {"a/b.bin"}  # type: ignore[attr-defined]
    assert storage.incomplete_uploads() == []  # type: ignore[attr-defined]  # local disk has none
    for missing in ("nothing.bin", "a"):  # absent, and a directory (no object)
        with pytest.raises(CheckpointNotFoundError):
            storage.stat(missing)  # type: ignore[attr-defined]


def test_memory_filesystem_stat(tmp_path: Path) -> None:
    storage = open_storage(f"memory://diffckpt-tests/{tmp_path.name}")
    storage.write("x.json", b"{}")
    assert storage.stat("x.json")[0] == 2  # type: ignore[attr-defined]
    with pytest.raises(CheckpointNotFoundError):
        storage.stat("y.json")  # type: ignore[attr-defined]


def test_a_plain_storage_is_not_made_inspectable() -> None:
    storage = open_storage(Plain())
    assert isinstance(storage, Storage) and not isinstance(storage, InspectableStorage)
    assert type(storage) is RetryingStorage and not isinstance(unwrap(storage), InspectableStorage)
    assert not hasattr(storage, "details") and not hasattr(unwrap(storage), "details")


class Forwarding:
    """A caller's wrapper that forwards every method to another storage through ``__getattr__``
    (as the test suite's fault wrappers do): Python 3.12's ``isinstance`` does not see those
    methods, so ``open_storage`` must not take it for a path."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.url = inner.url

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["inner"], name)


def test_a_wrapper_forwarding_through_getattr_is_a_storage_and_anything_else_a_clear_error() -> None:
    storage = open_storage(Forwarding(Plain()))
    assert type(unwrap(storage)).__name__ == "_Explained"  # wrapped as a caller's storage, not a path
    storage.write("a.bin", b"xy")
    assert storage.read("a.bin") == b"xy" and storage.list("") == {"a.bin": 2}
    with pytest.raises(TypeError, match="cannot open a dict as storage: give a path, a URL or a Storage"):
        open_storage({"url": "memory://x"})  # type: ignore[arg-type]


def test_a_url_whose_file_system_package_is_missing_names_the_package(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib

    registry = importlib.import_module("fsspec.registry")  # the module: ``fsspec.registry`` is a mapping
    # what fsspec raises for s3:// without s3fs (the GPU machine has none): a clear configuration
    # error naming the URL and the extra to install, not a bare ImportError from deep in fsspec
    monkeypatch.setitem(registry.known_implementations, "s3",
                        {"class": "s3fs_is_not_installed.S3FileSystem", "err": "Install s3fs to access S3"})
    monkeypatch.delitem(registry._registry, "s3", raising=False)
    with pytest.raises(UnsupportedConfigurationError,
                       match=r"cannot open s3://bucket/run: Install s3fs to access S3 \(pip install 'diffckpt\[s3\]'\)"):
        open_storage("s3://bucket/run")
    from diffckpt.cli import main

    assert main(["ls", "s3://bucket/run"]) == 2  # the CLI: one line, no traceback
    err = capsys.readouterr().err
    assert err.startswith("error: cannot open s3://bucket/run: Install s3fs") and "Traceback" not in err


def test_an_inspectable_caller_storage_stays_inspectable_through_both_wrappers() -> None:
    mine = Inspectable()
    storage = open_storage(mine)
    assert isinstance(storage, InspectableStorage) and isinstance(unwrap(storage), InspectableStorage)
    storage.write("run.json", b"{}")
    assert storage.stat("run.json") == (2, 0.0)  # type: ignore[attr-defined]
    with pytest.raises(OSError, match="flaky disk"):  # explained, as the six methods' errors are
        storage.stat("absent")  # type: ignore[attr-defined]
    storage.write(BaseName(0, 1).commit_path, b"{}")
    storage.write("bases/000000000005.g000001/state.safetensors", b"never committed")
    plan = plan_gc(RunStore(storage), RetentionPolicy(min_age_s=60))
    kinds = {x.path: x.kind for x in plan.leftovers}
    assert kinds == {"bases/000000000005.g000001/state.safetensors": "file of a base that was never committed",
                     "diffs/big.seg": "incomplete multipart upload"}
    from diffckpt.lifecycle.retention import apply_gc

    apply_gc(RunStore(storage), plan)
    assert mine.aborted == [("diffs/big.seg", "upload-1")]


def test_without_the_capability_leftovers_are_never_old() -> None:
    storage = open_storage(Plain())
    storage.write("bases/000000000005.g000001/state.safetensors", b"never committed")
    assert plan_gc(RunStore(storage), RetentionPolicy(min_age_s=0)).leftovers == []


# ------------------------------------------------------------------------ retry policy
def test_retry_budget_setting_names_the_setting_in_the_error() -> None:
    def down() -> None:
        raise TimeoutError("timed out")

    quick = {"budget_s": 0.0, "initial_backoff_s": 0.0, "max_backoff_s": 0.0}
    with pytest.raises(StorageUnavailableError, match="RetryPolicy.budget_s sets how long to retry"):
        retry_call(RetryPolicy(**quick), down, "read x")
    cli = RetryPolicy(**quick, budget_setting="--retry-budget")
    with pytest.raises(StorageUnavailableError, match="; --retry-budget sets how long to retry"):
        retry_call(cli, down, "read x")
    # It only names the budget: sessions record the same options, and policies compare as before.
    assert dataclasses.asdict(cli) == quick
    assert json.dumps(dataclasses.asdict(cli)) == json.dumps(quick)
    assert cli == RetryPolicy(**quick) and hash(cli) == hash(RetryPolicy(**quick))
    assert "budget_setting" not in repr(cli)
    for clone in (pickle.loads(pickle.dumps(cli)), copy.deepcopy(cli)):
        assert clone.budget_setting == "--retry-budget" and clone == cli
    assert RetryPolicy().budget_setting == "RetryPolicy.budget_s"
    with pytest.raises(ValueError, match="budget_setting"):
        RetryPolicy(budget_setting="")


def test_session_files_record_the_retry_policy_as_before(tmp_path: Path) -> None:
    from diffckpt import CheckpointOptions

    options = dataclasses.asdict(CheckpointOptions(retry=RetryPolicy(budget_s=5, budget_setting="--x")))
    assert options["retry"] == {"budget_s": 5, "initial_backoff_s": 0.2, "max_backoff_s": 10.0}


# ------------------------------------------------------------------------ references
def test_a_reference_is_sized_before_it_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_ckpt.references import is_reference, resolve_target, write_reference

    write_reference(str(tmp_path / "last.ckpt"), str(tmp_path / "run"), 7, {})
    write_reference(str(tmp_path / "step.ckpt"), str(tmp_path / "run"), 7, {})
    (tmp_path / "plain.ckpt").write_bytes(b"{" + b" " * 10_000)  # a large file: not ours
    (tmp_path / "dir.ckpt").mkdir()
    reads: list[str] = []
    real_read = FsspecStorage.read
    monkeypatch.setattr(FsspecStorage, "read", lambda self, path: reads.append(path) or real_read(self, path))
    assert is_reference(str(tmp_path / "step.ckpt"))
    assert resolve_target(str(tmp_path / "step.ckpt")) == (str(tmp_path / "run"), 7)
    assert resolve_target(str(tmp_path / "last.ckpt")) == (str(tmp_path / "run"), None)
    reads.clear()
    for other in ("plain.ckpt", "dir.ckpt", "absent.ckpt"):
        assert not is_reference(str(tmp_path / other))
    assert reads == []  # none of them was read
