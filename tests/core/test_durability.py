"""``durability``: with ``"paced"`` (the default) training never waits for the durable tier; a run
root that falls behind takes bases instead of the segments waiting before them, which stay in the
node-local tier until the base after them is durable. With ``"every_step"`` every segment is
made durable and training waits for storage.

The run root is a real :class:`FsspecStorage` behind a wrapper that holds every segment write
until the test lets it go, as a run root far slower than training would: the first segment's
commit holds the commit thread, and what training records meanwhile waits behind it.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
from engine_runs import (
    OPTIONS,
    FaultyStorage,
    Truth,
    assert_state,
    make,
    restore,
    snapshot,
    train_in_thread,
    train_steps,
)

from diffckpt import CheckpointEngine, CheckpointOptions, FsspecStorage
from diffckpt.committer import Committer
from diffckpt.journal import place_for
from diffckpt.journalfile import journals
from diffckpt.storage.nodelocal import memory_backed

STEPS = 12  # OPTIONS: write_batch 3, a base every 5 steps: bases at 5 and 10 while segments are held


class HeldSegments(FaultyStorage):
    """Holds every segment write until ``go`` is set (``held``: one is waiting)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.held, self.go = threading.Event(), threading.Event()

    def write(self, path: str, data: Any) -> None:
        if path.startswith("diffs/"):
            self.held.set()
            assert self.go.wait(60), "the test never let the segments go"
        super().write(path, data)


@pytest.fixture(autouse=True)
def _behind_at_once(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """The held run root is behind from the first held segment on; a run of this size records its
    steps in milliseconds, well before the second that tells a backlog from a burst."""
    monkeypatch.setattr(Committer, "BEHIND_S", 3600.0 if "burst" in request.node.name else 0.0)


def _local(tmp_path: Path) -> str:
    return str(tmp_path / "local")


def _journaled(tmp_path: Path) -> list[int]:
    place = place_for(_local(tmp_path), FsspecStorage(str(tmp_path / "run")).url)
    assert place is not None
    return sorted(e["step"] for j in journals(place.folder, place.url) for e in j.entries)


def _train_held(tmp_path: Path, durability: str) -> tuple[HeldSegments, CheckpointEngine, Truth, bool,
                                                          threading.Thread]:
    """Train ``1..STEPS`` on another thread while segment writes are held; return whether training
    got through them before the test let the segments go."""
    storage = HeldSegments(str(tmp_path / "run"))
    m, o = make()
    options = CheckpointOptions(**{**OPTIONS, "write_batch": 1, "local_dir": _local(tmp_path),  # type: ignore[arg-type]
                                   "durability": durability})
    engine = CheckpointEngine(storage, options)  # type: ignore[arg-type]
    engine.start(m, o, 0)
    truth = {0: snapshot(m, o, 0)}
    engine.write_base(0, m.state_dict(), [x.state_dict() for x in o], {"x": 0})
    thread, trained, errors = train_in_thread(engine, m, o, 1, STEPS, truth)
    # every_step: training is held for good (until the test lets go), so a short wait tells
    went_through = trained.wait(30 if durability == "paced" else 1.5)
    assert not errors, errors
    return storage, engine, truth, went_through, thread


def test_paced_training_never_waits_and_the_run_root_takes_bases_instead(tmp_path: Path) -> None:
    storage, engine, truth, went_through, thread = _train_held(tmp_path, "paced")
    assert went_through, "training waited for the durable tier"
    assert storage.held.is_set() and not storage.go.is_set()
    # Every step is in the node-local tier meanwhile: a process crash loses none of them.
    assert set(range(2, STEPS)) <= set(_journaled(tmp_path))
    writer = engine.recorder.writer
    assert writer is not None
    storage.go.set()
    assert engine.close() == STEPS
    stats, committer = writer.stats, writer._committer
    assert committer.skipped_segments > 0 and committer.superseded_bases == 1  # base 5: superseded by 10
    written = [p for p in storage.written if p.startswith(("diffs/", "bases/")) and p.endswith((".seg", "COMMIT"))]
    assert written == ["bases/000000000000.g000001/COMMIT", "diffs/000000000000-000000000001.g000001.seg",
                       "bases/000000000010.g000001/COMMIT", "diffs/000000000010-000000000011.g000001.seg",
                       "diffs/000000000011-000000000012.g000001.seg"]
    assert stats.bases == 2 and stats.records == 3 and stats.appended == STEPS  # every record went to a spool
    assert _journaled(tmp_path) == []  # the parked segments went once base 10 was durable
    thread.join(10)
    for step in (0, 1, 10, 11, 12):
        result, mod, opts = restore(str(tmp_path / "run"), step)
        assert result.step == step
        assert_state(truth, result, mod, opts)


def test_a_burst_younger_than_behind_s_is_not_a_backlog_and_every_segment_lands(tmp_path: Path) -> None:
    """Paced, with segments waiting for less than ``BEHIND_S``: the bases wait behind them, and the
    run root gets every step, as with ``every_step``; training still did not wait."""
    storage, engine, truth, went_through, thread = _train_held(tmp_path, "paced")
    assert went_through
    storage.go.set()
    assert engine.close() == STEPS
    assert [p for p in storage.written if p.startswith("diffs/")] == [
        f"diffs/{s - 1:012d}-{s:012d}.g000001.seg" for s in range(1, STEPS + 1)]
    thread.join(10)
    for step in range(STEPS + 1):
        result, mod, opts = restore(str(tmp_path / "run"), step)
        assert_state(truth, result, mod, opts)


def test_every_step_durable_makes_training_wait_for_storage(tmp_path: Path) -> None:
    storage, engine, truth, went_through, thread = _train_held(tmp_path, "every_step")
    assert not went_through, "training went on while every step was to be durable"
    storage.go.set()
    thread.join(60)
    assert not thread.is_alive()
    assert engine.close() == STEPS
    assert [p for p in storage.written if p.startswith("diffs/")] == [
        f"diffs/{s - 1:012d}-{s:012d}.g000001.seg" for s in range(1, STEPS + 1)]
    for step in range(STEPS + 1):
        result, mod, opts = restore(str(tmp_path / "run"), step)
        assert_state(truth, result, mod, opts)


def _given_up(tmp_path: Path) -> tuple[Truth, HeldSegments]:
    """A paced run whose close gives up while its segments are held: what a crash leaves."""
    storage, engine, truth, went_through, thread = _train_held(tmp_path, "paced")
    assert went_through
    release = threading.Timer(1.0, storage.go.set)  # the held write ends after close gave up
    release.start()
    try:
        assert engine.close(timeout=0.3) == 1  # the held segment 0..1 lands after it gave up
    finally:
        release.join()
    thread.join(10)
    return truth, storage


def test_a_crash_while_segments_are_parked_loses_no_step_on_the_node(tmp_path: Path) -> None:
    truth, _ = _given_up(tmp_path)
    # The parked segments (1..5, 5..10), the waiting ones and base 10's absence: the local tier
    # holds every step after the durable ones, and the resume takes them back bitwise.
    assert _journaled(tmp_path) == list(range(2, STEPS + 1))  # step 1 landed in the run root
    mod, opts = make()
    result = CheckpointEngine(tmp_path / "run", CheckpointOptions(local_dir=_local(tmp_path))).restore(mod, opts)
    assert result.step == STEPS
    assert_state(truth, result, mod, opts)


def test_a_node_lost_while_segments_are_parked_resumes_from_the_run_root(tmp_path: Path) -> None:
    truth, storage = _given_up(tmp_path)
    shutil.rmtree(_local(tmp_path))  # another node: nothing of this one's tier
    durable = [p for p in storage.written if p.endswith((".seg", "COMMIT"))]
    result, mod, opts = restore(str(tmp_path / "run"), options=CheckpointOptions(local_dir=_local(tmp_path)))
    assert durable and result.step <= STEPS
    assert_state(truth, result, mod, opts)


@pytest.mark.skipif(not memory_backed("/dev/shm"), reason="no shared memory held in memory here")
def test_a_local_tier_in_memory_holds_the_spools_of_a_local_run_root(tmp_path: Path) -> None:
    """Records go to the tier at memory speed; the run root gets each segment by a copy, and
    nothing of a spool is left beside the segments."""
    local = Path("/dev/shm") / f"diffckpt-test-{tmp_path.name}"
    try:
        m, o = make()
        engine = CheckpointEngine(tmp_path / "run", CheckpointOptions(**{**OPTIONS, "local_dir": str(local)}))
        engine.start(m, o, 0)
        truth = {0: snapshot(m, o, 0)}
        engine.write_base(0, m.state_dict(), [x.state_dict() for x in o], {"x": 0})
        writer = engine.recorder.writer
        assert writer is not None and writer.journal is not None and writer.journal.memory
        train_steps(engine, m, o, 1, 7, truth)
        assert writer._open is not None and writer._open.spool.path.startswith(str(local))
        assert engine.close() == 7
        assert not list((tmp_path / "run").rglob("*.tmp"))
        for step in range(8):
            result, mod, opts = restore(str(tmp_path / "run"), step)
            assert_state(truth, result, mod, opts)
    finally:
        shutil.rmtree(local, ignore_errors=True)


@pytest.mark.skipif(not memory_backed("/dev/shm"), reason="no shared memory held in memory here")
def test_a_run_root_in_memory_takes_its_spools_itself(tmp_path: Path) -> None:
    """With the run root in memory too, a spool in the tier's folder would be written twice (there,
    then by the commit's copy): the root's own spools are at memory speed and commit by a rename."""
    shm = Path("/dev/shm") / f"diffckpt-test-{tmp_path.name}"
    local, root = shm / "local", shm / "run"
    try:
        m, o = make()
        engine = CheckpointEngine(root, CheckpointOptions(**{**OPTIONS, "local_dir": str(local)}))
        engine.start(m, o, 0)
        truth = {0: snapshot(m, o, 0)}
        engine.write_base(0, m.state_dict(), [x.state_dict() for x in o], {"x": 0})
        writer = engine.recorder.writer
        assert writer is not None and writer.journal is not None and not writer.journal.memory
        train_steps(engine, m, o, 1, 7, truth)
        assert writer._open is not None and writer._open.spool.path.startswith(str(root / "diffs"))
        assert sorted(e["step"] for j in journals(writer.journal.folder, writer.journal.url) for e in j.entries)
        assert engine.close() == 7
        assert not list(root.rglob("*.tmp"))
        for step in range(8):
            result, mod, opts = restore(str(root), step)
            assert_state(truth, result, mod, opts)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
