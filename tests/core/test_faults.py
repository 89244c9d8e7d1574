"""Storage faults seen by the core engine: transient errors are retried, outages buffer then wait
or raise as configured, the final flush is bounded, and a second writer fences the first.

Faults come from a storage wrapper over real local disk (:class:`engine_runs.FaultyStorage`): a
network outage cannot be produced on a local file system. ``tests/storage`` produces the same
faults for real, through an HTTP proxy in front of an S3 server.
"""

from __future__ import annotations

import errno
import logging
import random
import re
import threading
import time
import types
import warnings
from pathlib import Path

import pytest
from engine_runs import (
    OPTIONS,
    FaultyStorage,
    Truth,
    assert_state,
    make,
    restore,
    snapshot,
    train_steps,
)

from diffckpt import (
    CheckpointEngine,
    CheckpointOptions,
    ConcurrentWriterError,
    DiffCkptError,
    FsspecStorage,
    RetryPolicy,
    StorageError,
    StorageUnavailableError,
)
from diffckpt.runstore import RunStore
from diffckpt.storage.retry import RetryingStorage, is_transient, retry_call

FAST = RetryPolicy(budget_s=0.3, initial_backoff_s=0.01, max_backoff_s=0.05)


def _start(storage: FaultyStorage, **options: object) -> tuple[CheckpointEngine, Truth, object, object]:
    m, o = make()
    engine = CheckpointEngine(storage, CheckpointOptions(**{**OPTIONS, "retry": FAST, **options}))  # type: ignore[arg-type]
    engine.start(m, o, 0)
    engine.write_base(0, m.state_dict(), [x.state_dict() for x in o], {"x": 0})
    return engine, {0: snapshot(m, o, 0)}, m, o


def _assert_every_step_restores(root: Path, truth: Truth, upto: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(upto + 1):
            result, m, o = restore(str(root), step)
            assert result.step == step
            assert_state(truth, result, m, o)


def _messages(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "diffckpt")


# ----------------------------------------------------------------------------- classification
class EndpointConnectionError(Exception):
    """Named like botocore's: classified by name, so the core imports no SDK."""


@pytest.mark.parametrize(("exc", "transient"), [
    (ConnectionResetError(errno.ECONNRESET, "reset"), True),
    (TimeoutError("read timed out"), True),
    (OSError(errno.EBUSY, "SlowDown"), True),  # s3fs's translation of 503 SlowDown
    (OSError(errno.EREMOTEIO, "InternalError"), True),  # ... and of 500
    (EndpointConnectionError("Could not connect"), True),
    (PermissionError(errno.EACCES, "AccessDenied"), False),
    (FileNotFoundError(errno.ENOENT, "NoSuchBucket"), False),
    (OSError(errno.ENOSPC, "No space left on device"), False),
    (OSError(errno.EINVAL, "InvalidArgument"), False),
    (ValueError("bad"), False),
])
def test_transient_faults_are_told_from_permanent_ones(exc: BaseException, transient: bool) -> None:
    assert is_transient(exc) is transient
    wrapped = StorageError("cannot write x")  # as FsspecStorage raises it: the cause decides
    wrapped.__cause__ = exc
    assert is_transient(wrapped) is transient


def test_retry_policy_retries_transient_faults_and_gives_up_after_its_budget() -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError(errno.ECONNRESET, "reset")
        return "ok"

    assert retry_call(FAST, flaky, "write x") == "ok" and len(calls) == 3

    def down() -> None:
        calls.append(1)
        raise TimeoutError("timed out")

    calls.clear()
    with pytest.raises(StorageUnavailableError, match=r"cannot write x: storage kept failing for .* attempts.*"
                       r"TimeoutError: timed out.*RetryPolicy.budget_s") as info:
        retry_call(FAST, down, "write x")
    assert len(calls) > 2 and isinstance(info.value.__cause__, TimeoutError)

    def denied() -> None:
        calls.append(1)
        raise PermissionError(errno.EACCES, "AccessDenied")

    calls.clear()
    with pytest.raises(PermissionError):
        retry_call(FAST, denied, "write x")
    assert len(calls) == 1  # permanent: no retry


def test_retry_jitter_leaves_the_training_rng_alone() -> None:
    # the global random state is part of the training state that gets checkpointed
    before = random.getstate()
    assert all(0 <= RetryPolicy().delay(n) <= 10 for n in range(1, 20))
    assert random.getstate() == before


@pytest.mark.parametrize("field", [{"on_storage_error": "drop"}, {"flush_timeout_s": -1}, {"retry": 3}])
def test_storage_error_settings_are_checked(field: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(field))):
        CheckpointOptions(**field)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="budget_s"):
        RetryPolicy(budget_s=-1)


# ------------------------------------------------------------------------------- outages
def test_short_fault_is_retried_without_an_outage(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "run"
    storage = FaultyStorage(str(root))
    engine, truth, m, o = _start(storage, retry=RetryPolicy(budget_s=30, initial_backoff_s=0.01, max_backoff_s=0.05))
    with caplog.at_level(logging.INFO, logger="diffckpt"):
        storage.down.set()

        def clear_after_a_refusal() -> None:
            # storage comes back 0.1 s after its first refused call: a timer started here could
            # run out before a loaded machine's writer makes any call (nothing would be tested)
            while not storage.refused:
                time.sleep(0.005)
            time.sleep(0.1)
            storage.down.clear()

        threading.Thread(target=clear_after_a_refusal, daemon=True).start()
        train_steps(engine, m, o, 1, 13, truth)
        assert engine.close() == 13
    assert storage.refused > 0
    log = _messages(caplog)
    assert "transient, retry 1" in log and "Connection reset by peer" in log
    assert "storage outage" not in log
    _assert_every_step_restores(root, truth, 13)


def test_outage_buffers_then_blocks_training_then_drains(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "run"
    storage = FaultyStorage(str(root))
    engine, truth, m, o = _start(storage, max_pending_bytes=1)
    train_steps(engine, m, o, 1, 3, truth)
    assert engine.flush() == 3
    with caplog.at_level(logging.WARNING, logger="diffckpt"):
        storage.down.set()
        threading.Timer(1.0, storage.down.clear).start()  # longer than the 0.3 s retry budget
        train_steps(engine, m, o, 4, 13, truth)  # waits while storage is down, nothing raised
        assert engine.close() == 13
    log = _messages(caplog)
    assert "storage outage" in log and "Durable up to step 3" in log and "Connection reset by peer" in log
    assert "training waits for storage and nothing is dropped" in log
    assert "is back after" in log
    assert engine.recorder.writer is None and storage.refused > 0
    _assert_every_step_restores(root, truth, 13)


def test_outage_with_raise_stops_training_when_the_buffer_is_full(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "run"
    storage = FaultyStorage(str(root))
    engine, truth, m, o = _start(storage, max_pending_bytes=1, on_storage_error="raise")
    train_steps(engine, m, o, 1, 3, truth)
    assert engine.flush() == 3
    storage.down.set()
    with pytest.raises(StorageUnavailableError, match=r"failing for .*Connection reset by peer.* the checkpoint "
                       r"buffer is full .* durable up to step 3, steps after it are in memory only.*'block'"):
        train_steps(engine, m, o, 4, 100, truth)
    with caplog.at_level(logging.WARNING, logger="diffckpt"):
        assert engine.close(timeout=0.5) == 3  # bounded: gives up and says what is lost
    assert "gave up the final flush" in _messages(caplog) and "durable up to step 3" in _messages(caplog)
    # ... and what the node-local tier keeps of it: the steps journaled before training stopped
    kept = re.search(r"of those, steps 4\.\.(\d+) are kept in the local tier on this host", _messages(caplog))
    assert kept, _messages(caplog)
    storage.down.clear()
    assert RunStore(FsspecStorage(str(root))).inventory().newest_step(1) == 3  # the run root alone
    assert restore(str(root), options=CheckpointOptions(local_dir=None))[0].step == 3  # another node: no journal
    _assert_every_step_restores(root, truth, int(kept[1]))  # this node: the journal's steps too
    assert restore(str(root))[0].step == int(kept[1])


def test_final_flush_is_bounded_during_an_outage(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "run"
    storage = FaultyStorage(str(root))
    engine, truth, m, o = _start(storage)
    train_steps(engine, m, o, 1, 4, truth)
    assert engine.flush() == 4
    storage.down.set()  # never comes back
    train_steps(engine, m, o, 5, 9, truth)
    with caplog.at_level(logging.ERROR, logger="diffckpt"):
        assert engine.close(timeout=0.5) == 4
    assert "durable up to step 4" in _messages(caplog) and "steps 5..9 were not written" in _messages(caplog)
    storage.down.clear()
    _assert_every_step_restores(root, truth, 4)


def test_flush_with_a_timeout_raises_and_writing_goes_on(tmp_path: Path) -> None:
    root = tmp_path / "run"
    engine, truth, m, o = _start(FaultyStorage(str(root), latency=0.2))
    train_steps(engine, m, o, 1, 3, truth)
    with pytest.raises(TimeoutError, match="flush not done within 0.01s"):
        engine.flush(timeout=0.01)
    assert engine.close() == 3
    _assert_every_step_restores(root, truth, 3)


def test_unreachable_storage_at_start_is_a_clear_error(tmp_path: Path) -> None:
    storage = FaultyStorage(str(tmp_path / "run"))
    storage.down.set()
    m, o = make()
    engine = CheckpointEngine(storage, CheckpointOptions(retry=FAST))
    with pytest.raises(StorageUnavailableError, match=r"cannot write .*run.json: storage kept failing"):
        engine.start(m, o, 0)
    assert not engine.started


# ------------------------------------------------------------------------- two writers
def test_a_second_writer_fences_the_first(tmp_path: Path) -> None:
    root = tmp_path / "run"
    old, truth, m, o = _start(FaultyStorage(str(root)))
    train_steps(old, m, o, 1, 6, truth)
    assert old.flush() == 6
    # A restarted job resumes from the newest durable step while the old one still runs.
    result, m2, o2 = restore(str(root))
    new = CheckpointEngine(str(root), CheckpointOptions(**OPTIONS))
    assert new.start(m2, o2, result.step) == 2
    new.write_base(6, m2.state_dict(), [x.state_dict() for x in o2], {"x": 6})
    new_truth: Truth = {}
    train_steps(new, m2, o2, 7, 13, new_truth)
    assert new.close() == 13
    fenced = r"another job started writing to .* \(session g2, host .*resumed from step 6\); this job \(session g1\) stopped"
    with pytest.raises(DiffCkptError, match=fenced) as info:
        train_steps(old, m, o, 7, 13, truth)
        old.flush()
    assert isinstance(info.value.__cause__, ConcurrentWriterError)
    with pytest.raises(DiffCkptError, match=fenced):
        old.close()
    inv = RunStore(FsspecStorage(str(root))).inventory()
    assert inv.newest_step(1) == 6, "the fenced writer committed nothing after the new session started"
    result, m3, o3 = restore(str(root))
    assert (result.step, result.base_step) == (13, 11)  # the new session based at 6 and 11
    assert_state({**truth, **new_truth}, result, m3, o3)


def test_sessions_started_at_once_get_distinct_generations(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    barrier = threading.Barrier(8)
    gens: list[int] = []

    def start() -> None:
        store = RunStore(RetryingStorage(FsspecStorage(root)))
        barrier.wait()
        gens.append(store.start_session({}))

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(gens) == list(range(1, 9))
    assert not list((tmp_path / "run" / "sessions").glob(".*")), "no temporary file left behind"


def test_create_is_exclusive_and_streaming_writes_whole_objects(tmp_path: Path) -> None:
    for url in (str(tmp_path / "s"), f"memory://diffckpt-tests/{tmp_path.name}"):
        storage = FsspecStorage(url, part_size=4, multipart_threshold=10)
        assert storage.create("a/x", b"first") is True
        assert storage.create("a/x", b"second") is False
        assert storage.read("a/x") == b"first"
        parts = [b"0123456789", memoryview(b"abcdefghijklmnop"), b"Z"]
        storage.write("big", parts)
        assert storage.read("big") == b"".join(bytes(p) for p in parts)


def test_close_without_timeout_in_raise_mode_does_not_hang_in_an_outage(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "run"
    storage = FaultyStorage(str(root))
    engine, truth, m, o = _start(storage, on_storage_error="raise")
    train_steps(engine, m, o, 1, 3, truth)
    assert engine.flush() == 3
    storage.down.set()
    train_steps(engine, m, o, 4, 6, truth)  # buffered
    with caplog.at_level(logging.ERROR, logger="diffckpt"), pytest.raises(StorageUnavailableError):
        engine.close()
    assert not engine.started and engine.durable_step == 3
    assert "steps 4..6 were not written" in _messages(caplog)


def test_a_flush_where_no_thread_can_start_commits_on_the_writer_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.12 and later start no thread at interpreter shutdown: an ``atexit`` flush (the
    transformers adapter's, after an exception) must still commit every segment, in order."""
    from diffckpt import committer

    class NoThreadAtShutdown(threading.Thread):
        def start(self) -> None:
            raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(committer, "threading", types.SimpleNamespace(**{**vars(threading),
                                                                        "Thread": NoThreadAtShutdown}))
    root = tmp_path / "run"
    engine, truth, m, o = _start(FaultyStorage(str(root)), write_batch=3)
    train_steps(engine, m, o, 1, 10, truth)
    assert engine.close() == 10
    assert engine.recorder.writer is None and committer.threading.Thread is NoThreadAtShutdown
    _assert_every_step_restores(root, truth, 10)
