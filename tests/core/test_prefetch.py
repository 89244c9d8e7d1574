"""Segments read and decoded ahead of replay: the same states, the same damage reports and the same
errors as a sequential read, a bounded window, and no thread left reading after the reader closes.

The run is one base at step 0 and ten segments of two steps each, so that there is something to
read ahead of every segment.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_runs import FaultyStorage, Truth, assert_state, flip, record_span, restore, seg, train
from helpers import ROOT, subprocess_env

from diffckpt import CorruptRecordError, StorageError, load_state, open_storage, recordreads
from diffckpt.planning import plan
from diffckpt.recordreads import ReadStats
from diffckpt.runstore import RunStore
from diffckpt.segment import decode_segment
from diffckpt.tree import pack_tree, unpack_tree

STEPS = 20
SEGMENTS = [(a, a + 2) for a in range(0, STEPS, 2)]
PREFIX = "diffckpt-prefetch"


@pytest.fixture(scope="module")
def _run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Truth]:
    root = tmp_path_factory.mktemp("prefetch") / "run"
    truth, durable = train(str(root), steps=STEPS, write_batch=2, base_every_n_steps=None)
    assert durable == STEPS
    inv = RunStore(open_storage(str(root))).inventory()
    assert [(s.after, s.last) for s in inv.segments] == SEGMENTS
    return root, truth


@pytest.fixture
def run(_run: tuple[Path, Truth], tmp_path: Path) -> tuple[Path, Truth]:
    """A private copy of the run, free to damage."""
    src, truth = _run
    shutil.copytree(src, tmp_path / "run")
    return tmp_path / "run", truth


class ReadLog(FaultyStorage):
    """Local storage that notes every segment read (path, thread), may sleep ``latency`` s per
    read and fail the read of ``fail`` with a permission error."""

    def __init__(self, root: str, latency: float = 0.0, fail: str | None = None) -> None:
        super().__init__(root)
        self.read_latency = latency
        self.fail = fail
        self.reads: list[tuple[str, str]] = []
        self.busy = self.most_busy = 0
        self.lock = threading.Lock()

    def read(self, path: str) -> bytes:
        if not path.startswith("diffs/"):
            return super().read(path)
        with self.lock:
            self.reads.append((path, threading.current_thread().name))
            self.busy += 1
            self.most_busy = max(self.most_busy, self.busy)
        try:
            time.sleep(self.read_latency)
            if path == self.fail:
                raise PermissionError(errno.EACCES, "Access denied", path)
            return super().read(path)
        finally:
            with self.lock:
                self.busy -= 1


def _name(after: int, last: int) -> str:
    return f"diffs/{after:012d}-{last:012d}.g000001.seg"


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(PREFIX)]


def _no_prefetch_threads_within(seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not _prefetch_threads()


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def _states(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    return list(_tensors([module.state_dict(), [o.state_dict() for o in optimizers]]))


# ----------------------------------------------------------------------------- same results
@pytest.mark.parametrize("depth", [1, 2, 4, 16])
def test_prefetch_restores_the_same_tensors_as_a_sequential_read(
        run: tuple[Path, Truth], depth: int, monkeypatch: pytest.MonkeyPatch) -> None:
    root, truth = run
    sizes = RunStore(open_storage(str(root))).inventory().sizes
    for step in (None, 0, 1, 2, 7, 13, STEPS):
        monkeypatch.setattr(recordreads, "PREFETCH_SEGMENTS", 0)
        before = _prefetch_threads()
        sequential, m0, o0 = restore(str(root), step)
        assert set(_prefetch_threads()) <= set(before)  # 0: no thread started
        monkeypatch.setattr(recordreads, "PREFETCH_SEGMENTS", depth)
        ahead, m1, o1 = restore(str(root), step)
        assert_state(truth, ahead, m1, o1)
        assert (ahead.step, ahead.replayed, ahead.state) == (sequential.step, sequential.replayed,
                                                             sequential.state)
        a, b = _states(m0, o0), _states(m1, o1)
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
        # the figures: every segment up to the target, read whole, whatever the depth
        read = [_name(x, y) for x, y in SEGMENTS if x < ahead.step]
        assert ahead.read_bytes == sequential.read_bytes == sum(sizes[p] for p in read)
        assert ahead.replay_s > 0 and 0 <= ahead.read_wait_s <= ahead.replay_s
        assert ahead.steps_per_s == pytest.approx(ahead.replayed / ahead.replay_s if ahead.replayed else 0)


def test_restore_logs_its_throughput(run: tuple[Path, Truth], caplog: pytest.LogCaptureFixture) -> None:
    root, _ = run
    with caplog.at_level(logging.INFO, logger="diffckpt"):
        result, _, _ = restore(str(root), 13)
    line = next(r.getMessage() for r in caplog.records if "restored step" in r.getMessage())
    assert line.startswith("diffckpt: restored step 13 from base 0 (read in ")
    assert f"replayed 13 steps in {result.replay_s:.2f} s (" in line and "steps/s" in line
    assert "MiB/s" in line


def test_nothing_past_the_target_segment_is_read(run: tuple[Path, Truth]) -> None:
    root, truth = run
    for step, last in ((1, 2), (8, 8), (9, 10)):
        storage = ReadLog(str(root), latency=0.01)
        result, m, o = restore(storage, step)
        assert_state(truth, result, m, o)
        assert sorted(p for p, _ in storage.reads) == [_name(a, b) for a, b in SEGMENTS if b <= last]
    # a plan cut back to an earlier target (as replay redoes one) still lists later segments
    storage = ReadLog(str(root), latency=0.01)
    store, plan = _plan(root, storage)
    records = [r["step"] for r, _ in store.read_records(dataclasses.replace(plan, target=5)) if r]
    assert records == [1, 2, 3, 4, 5]
    assert sorted(p for p, _ in storage.reads) == [_name(a, b) for a, b in SEGMENTS if b <= 6]


def test_the_window_is_bounded_in_bytes(run: tuple[Path, Truth], monkeypatch: pytest.MonkeyPatch) -> None:
    root, truth = run
    monkeypatch.setattr(recordreads, "PREFETCH_WORKERS", 4)
    storage = ReadLog(str(root), latency=0.05)
    restore(storage, STEPS)
    assert storage.most_busy >= 3  # reads overlap: 4 ahead by default, and the one taken
    monkeypatch.setattr(recordreads, "PREFETCH_BYTES", 1)  # less than any segment: one ahead
    storage = ReadLog(str(root), latency=0.05)
    result, m, o = restore(storage, STEPS)
    assert_state(truth, result, m, o)
    assert storage.most_busy <= 2 and len(storage.reads) == len(SEGMENTS)
    assert all(thread.startswith(PREFIX) for _, thread in storage.reads)  # still ahead of replay


@pytest.mark.parametrize("how", ["restore", "load_state"])
def test_the_records_are_read_while_the_base_loads(run: tuple[Path, Truth], how: str) -> None:
    """Replay's first records are fetched while the base is read, not after: here the read of the
    base waits (10 s at most) until a segment's read has begun. Onto a live model and as plain
    tensors alike."""
    root, truth = run

    class BaseAfterRecords(ReadLog):
        def __init__(self, root: str) -> None:
            super().__init__(root)
            self.began, self.waited = threading.Event(), list[bool]()

        def read(self, path: str) -> bytes:
            if path.endswith("state.safetensors"):
                self.waited.append(self.began.wait(10))
            elif path.startswith("diffs/"):
                self.began.set()
            return super().read(path)

    storage = BaseAfterRecords(str(root))
    if how == "restore":
        result, m, o = restore(storage, STEPS)
        assert_state(truth, result, m, o)
    else:
        loaded = load_state(storage, STEPS)
        assert loaded["step"] == STEPS
        assert all(torch.equal(t, truth[STEPS]["model"][k]) for k, t in loaded["model"].items())
    assert storage.waited == [True]
    assert all(thread.startswith(PREFIX) for _, thread in storage.reads)


def test_decoded_tensors_own_their_memory(run: tuple[Path, Truth]) -> None:
    """Records decode from views of the segment: the tensors are copies of their own, so
    keeping one (a restored step's state) keeps neither the segment nor the other tensors."""
    root, _ = run
    data = (root / _name(0, 2)).read_bytes()
    _, records, problem = decode_segment(data, "seg")
    assert problem is None and [r["step"] for r in records] == [1, 2]
    blob = pack_tree(records[0])
    viewed, copied = list(_tensors(unpack_tree(memoryview(blob)))), list(_tensors(unpack_tree(blob)))
    assert len(viewed) == len(copied) > 0 and all(map(torch.equal, viewed, copied))
    for t in _tensors(records):
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        t.add_(0)  # writable, without a warning about a read-only buffer


# ------------------------------------------------------------------------------------ damage
def _outcome(root: Path, step: int | None) -> tuple[int | None, list[str], str | None]:
    """``(step restored, warnings, error)`` of a restore."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result, _, _ = restore(str(root), step)
        except CorruptRecordError as exc:
            return None, [str(w.message) for w in caught], str(exc)
    return result.step, [str(w.message) for w in caught], None


@pytest.mark.parametrize("damage", ["record", "magic"])
def test_damage_mid_chain_is_reported_as_without_prefetch(
        run: tuple[Path, Truth], damage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    root, truth = run
    path = seg(root, 8, 10)
    offset, length = record_span(path.read_bytes(), 10)
    flip(path, offset + length // 2 if damage == "record" else 0)
    newest = 9 if damage == "record" else 8
    outcomes = {}
    for depth in (0, 4):
        monkeypatch.setattr(recordreads, "PREFETCH_SEGMENTS", depth)
        outcomes[depth] = {step: _outcome(root, step) for step in (None, newest, 11, STEPS)}
        restored, caught, error = outcomes[depth][None]
        assert restored == newest and error is None
        assert len(caught) == 1 and _name(8, 10) in caught[0] and f"restoring step {newest}" in caught[0]
        assert outcomes[depth][newest] == (newest, [], None)  # before the damage: no warning
        for step in (11, STEPS):
            restored, caught, error = outcomes[depth][step]
            assert restored is None and error is not None
            assert error.startswith(f"cannot rebuild step {step}: {_name(8, 10)}")
            assert f"newest intact: {newest}" in error
        with pytest.warns(UserWarning, match=f"restoring step {newest}"):
            result, m, o = restore(str(root))
        assert_state(truth, result, m, o)
    assert outcomes[0] == outcomes[4]


@pytest.mark.parametrize("damage", ["record", "truncated"])
def test_damage_in_a_segment_read_by_ranges(run: tuple[Path, Truth], damage: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Records read by range into recycled blocks (large segments): a corrupt record, or a segment
    cut inside one (its index gone), is found and handled as in a whole read."""
    root, truth = run
    monkeypatch.setattr(recordreads, "RANGED_ABOVE", 0)
    path = seg(root, 8, 10)
    data = path.read_bytes()
    offset, length = record_span(data, 10)
    if damage == "record":
        flip(path, offset + length // 2)
    else:
        path.write_bytes(data[: offset + length // 2])
    newest = 9 if damage == "record" else 8
    restored, caught, error = _outcome(root, None)
    assert restored == newest and error is None
    assert len(caught) == 1 and _name(8, 10) in caught[0] and f"restoring step {newest}" in caught[0]
    restored, caught, error = _outcome(root, STEPS)
    assert restored is None and error is not None and _name(8, 10) in error
    with pytest.warns(UserWarning, match=f"restoring step {newest}"):
        result, m, o = restore(str(root))
    assert_state(truth, result, m, o)


def test_damage_before_a_failing_read_hides_it_as_in_a_sequential_read(
        run: tuple[Path, Truth], monkeypatch: pytest.MonkeyPatch) -> None:
    root, truth = run
    path = seg(root, 4, 6)
    offset, length = record_span(path.read_bytes(), 5)
    flip(path, offset + length // 2)
    for depth in (0, 4):
        monkeypatch.setattr(recordreads, "PREFETCH_SEGMENTS", depth)
        storage = ReadLog(str(root), fail=_name(6, 8))  # read ahead, but never taken
        with pytest.warns(UserWarning, match="restoring step 4"):
            result, m, o = restore(storage)
        assert_state(truth, result, m, o)


# --------------------------------------------------------------------------- storage errors
@pytest.mark.parametrize("depth", [0, 4])
def test_a_storage_error_while_prefetching_reaches_the_caller(
        run: tuple[Path, Truth], depth: int, monkeypatch: pytest.MonkeyPatch) -> None:
    root, _ = run
    monkeypatch.setattr(recordreads, "PREFETCH_SEGMENTS", depth)
    storage = ReadLog(str(root), fail=_name(6, 8))
    with pytest.raises(StorageError, match=r"000000000006-000000000008.g000001.seg") as info:
        restore(storage, STEPS)
    assert isinstance(info.value.__cause__, PermissionError)
    thread = dict(storage.reads)[_name(6, 8)]
    assert thread.startswith(PREFIX) if depth else thread == threading.current_thread().name
    assert _no_prefetch_threads_within(5.0)
    # a target before the failing segment never reads it
    storage = ReadLog(str(root), fail=_name(6, 8))
    result, _, _ = restore(storage, 6)
    assert result.step == 6 and _name(6, 8) not in dict(storage.reads)


# ------------------------------------------------------------------------------ early close
def _plan(root: Path, storage: ReadLog) -> tuple[RunStore, Any]:
    store = RunStore(open_storage(storage))
    return store, plan(store, STEPS)


def test_closing_the_reader_early_stops_every_prefetch_thread(
        run: tuple[Path, Truth], monkeypatch: pytest.MonkeyPatch) -> None:
    root, _ = run
    monkeypatch.setattr(recordreads, "PREFETCH_WORKERS", 1)  # the window waits in the queue
    storage = ReadLog(str(root), latency=0.1)
    store, plan = _plan(root, storage)
    stats = ReadStats()
    records = store.read_records(plan, prefetch=8, stats=stats)
    record, problem = next(records)
    assert problem is None and record is not None and record["step"] == 1
    assert _prefetch_threads()
    records.close()
    assert _no_prefetch_threads_within(5.0)
    assert len(storage.reads) <= 2  # the first segment and the one being read; the rest cancelled
    assert stats.segments == 1 and stats.bytes > 0


def test_an_error_in_the_consumer_stops_every_prefetch_thread(run: tuple[Path, Truth]) -> None:
    root, _ = run
    storage = ReadLog(str(root), latency=0.1)
    store, plan = _plan(root, storage)

    def consume() -> None:
        for record, _ in store.read_records(plan):
            if record is not None and record["step"] == 3:
                raise RuntimeError("replay failed")

    with pytest.raises(RuntimeError, match="replay failed"):
        consume()
    assert _no_prefetch_threads_within(5.0)
    assert len(storage.reads) < len(SEGMENTS)


def test_an_unstarted_reader_starts_no_thread(run: tuple[Path, Truth]) -> None:
    root, _ = run
    storage = ReadLog(str(root))
    store, plan = _plan(root, storage)
    before = _prefetch_threads()
    records = store.read_records(plan)
    assert _prefetch_threads() == before and storage.reads == []
    records.close()


# --------------------------------------------------------------------------------- benchmark
@pytest.mark.slow  # a benchmark's smoke run: its restores are the tests above, and make gpu-check's dry run times one
def test_restore_benchmark_smoke_run(tmp_path: Path) -> None:
    """``bench/restore.py --quick`` trains, restores every chain (checked bitwise) and reports."""
    out = tmp_path / "restore.md"
    proc = subprocess.run([sys.executable, f"{ROOT}/bench/restore.py", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = out.read_text()
    for row in ("| 0 |", "| 10 |", "| 30 |", "| 30, TopK(0.01) |", "| warm | none |", "| cold | 4 segments",
                "| 10 | dense |", "| 30 | TopK(0.01) |"):
        assert row in report


def test_a_large_record_is_read_while_the_one_before_is_replayed() -> None:
    """A segment of one record larger than the window, read by range: its index (no bytes) and
    then the record. Replay of record k must overlap the read of record k+1: the index ahead
    does not stop it (it did, and at GPT-2 350M replay waited 17 s of 44 for reads)."""
    from diffckpt.prefetch import Prefetcher

    started: list[str] = []
    lock = threading.Lock()

    def fetch(key: str) -> str:
        with lock:
            started.append(key)
        return key

    items = [(key, size, size == 0) for k in range(3) for key, size in ((f"index{k}", 0), (f"record{k}", 1000))]
    ahead = Prefetcher(fetch, items, depth=4, max_bytes=10, workers=2)
    try:
        assert next(ahead)[0] == "index0" and next(ahead)[0] == "record0"
        # while the caller replays record0, record1 is already asked for
        deadline = time.monotonic() + 5
        while "record1" not in started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "record1" in started and "record2" not in started  # one large record ahead, not two
        assert [next(ahead)[0] for _ in range(4)] == ["index1", "record1", "index2", "record2"]
    finally:
        ahead.close()
