"""A resumed session goes on training at once: it continues the step restored and writes no base
there. Its steps are rebuilt through the session it continues until its own first base, which is
due when the run's next base is, counted from the base the restored step rests on.

Session 1 trains to ``FIRST`` (base 0, segments up to it). Session 2 resumes and trains on to
``LAST`` with no base of its own: every step of it restores bitwise through session 1's base and
segments, retention keeps what they need, and compaction or the base policy gives it its own
base. A process killed while its segments are still on the way (``kill -9`` of a real process,
the storage holding them) loses none of the steps the node-local tier journaled.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_runs import (
    OPTIONS,
    Truth,
    assert_state,
    make,
    one_thread,  # noqa: F401  (autouse: one torch thread, as the training processes)
    optimizer_step,
    plain_truth,
    restore,
    train,
)
from helpers import subprocess_env

from diffckpt import (
    CheckpointEngine,
    CheckpointNotFoundError,
    CheckpointOptions,
    FsspecStorage,
    RetentionPolicy,
    compact,
)
from diffckpt.cli.ls import describe
from diffckpt.journal import place_for
from diffckpt.journalfile import journals
from diffckpt.lifecycle.retention import apply_gc, plan_gc
from diffckpt.runstore import RunStore

TESTS = str(Path(__file__).resolve().parent.parent)
FIRST, LAST = 7, 11  # session 1 ends at FIRST (a segment end); session 2 trains to LAST
# one base per session (its starting one), so session 2's steps have only session 1's to go through
SETTINGS = {**OPTIONS, "base_every_n_steps": 1000}


class Step:
    """The framework state of the plain loop here: the step it is at."""

    def __init__(self, step: int) -> None:
        self.step = step

    def rank_state(self) -> None:
        return None

    def state(self, ranks: list[Any]) -> dict[str, int]:
        return {"x": self.step}


@pytest.fixture(scope="module")
def truth() -> Truth:
    """The uninterrupted run's state at every step, trained without diffckpt."""
    return plain_truth(LAST)


def first_session(root: Path) -> None:
    assert train(str(root), FIRST, **SETTINGS)[1] == FIRST


def train_on(engine: CheckpointEngine, m: torch.nn.Module, o: list[torch.optim.Optimizer]) -> None:
    """Session 2's steps after the resume, through the engine as a plain loop records them."""
    source = Step(FIRST)
    for step in range(FIRST + 1, LAST + 1):
        optimizer_step(m, o, step)
        source.step = step
        engine.commit(step, source)
    for x in o:  # as the next step begins: the last record's gradients are let go
        x.zero_grad()


def journaled(local: Path, root: Path) -> list[int]:
    place = place_for(str(local), FsspecStorage(str(root)).url)
    assert place is not None
    return sorted(e["step"] for j in journals(place.folder, place.url) for e in j.entries)


def bases(root: Path) -> list[tuple[int, int]]:
    return [(b.gen, b.step) for b in RunStore(FsspecStorage(str(root))).inventory().bases]


def test_a_resumed_session_writes_no_base_and_its_steps_restore_through_the_one_it_continues(
        tmp_path: Path, truth: Truth) -> None:
    root = tmp_path / "run"
    first_session(root)
    engine = CheckpointEngine(str(root), CheckpointOptions(**SETTINGS))  # type: ignore[arg-type]
    m, o = make()
    result = engine.resume(m, o)
    assert result is not None and result.step == FIRST and result.continues == (1, FIRST, 0)
    engine.begin(m, o, FIRST, Step(FIRST))
    assert engine.durable_step == FIRST  # durable already, in session 1
    train_on(engine, m, o)
    assert engine.close() == LAST
    assert json.loads((root / "sessions" / "g000002.json").read_text())["continues"] == {"gen": 1, "step": FIRST}
    assert bases(root) == [(1, 0)]  # no base at the resume: session 2's steps rest on session 1's

    # While session 2 has no base, retention keeps every step (its steps need session 1's).
    store = RunStore(FsspecStorage(str(root)))
    gc = plan_gc(store, RetentionPolicy(keep_last_bases=1, min_age_s=0))
    assert not gc.segments and not gc.bases
    assert any("session g2 continues step 7 of session g1" in r for k in gc.kept for r in k.reasons)

    for step in (LAST, FIRST + 2, FIRST, 3):  # explicit steps on either side of the resume too
        res, mod, opts = restore(str(root), step if step != LAST else None)
        assert (res.step, res.base_step) == (step, 0)
        assert_state(truth, res, mod, opts)
    with pytest.raises(CheckpointNotFoundError, match=r"durable steps: g1: 0\.\.7; g2: 7\.\.11\."):
        restore(str(root), LAST + 5)  # the error names the steps rebuilt through the link too
    listed = describe(store, store.inventory())  # `diffckpt ls` says what a resume gets
    assert (listed["newest"]["gen"], listed["newest"]["step"]) == (2, LAST)
    assert [(s["gen"], s["durable"]) for s in listed["sessions"]] == [(1, [(0, FIRST)]), (2, [(FIRST, LAST)])]

    # Compaction writes session 2's own base at its newest step, replayed through session 1's.
    done = compact(str(root))
    assert (done.gen, done.step, done.from_base, done.written) == (2, LAST, 0, True)
    res, mod, opts = restore(str(root))
    assert (res.step, res.base_step) == (LAST, LAST)
    assert_state(truth, res, mod, opts)
    assert describe(store, store.inventory())["sessions"][1]["durable"] == [(FIRST, LAST)]  # the link's too

    # A framework's save of a step only the link reaches (session 2's before its base) keeps what
    # rebuilds it: session 1's base and segments up to the step continued, and session 2's after.
    newest_only = RetentionPolicy(keep_last_bases=1, min_age_s=0)
    saved = FIRST + 2
    apply_gc(store, plan_gc(store, newest_only, also=[(2, saved, "a save")]))
    res, mod, opts = restore(str(root), saved)
    assert (res.step, res.base_step) == (saved, 0)
    assert_state(truth, res, mod, opts)
    apply_gc(store, plan_gc(store, newest_only))  # without the save, only session 2's base stays
    assert bases(root) == [(2, LAST)] and not store.inventory().segments
    with pytest.raises(CheckpointNotFoundError):
        restore(str(root), saved)


def test_the_first_base_after_a_resume_is_due_as_the_run_s_next(tmp_path: Path,
                                                               truth: Truth) -> None:
    """A base every 4 steps: session 1 writes 0 and 4 and ends at 7. Session 2 writes its first at
    8, as the run would have without the restart, not at 7. Session 3 resumes session 2's step 9
    and writes none (12 is next). Every step restores bitwise through the sessions before it."""
    root, every = tmp_path / "run", {**SETTINGS, "base_every_n_steps": 4}
    assert train(str(root), FIRST, **every)[1] == FIRST
    assert bases(root) == [(1, 0), (1, 4)]
    for session, upto in ((2, FIRST + 2), (3, LAST)):  # two restarts in a row, the second at 9
        engine = CheckpointEngine(str(root), CheckpointOptions(**every))  # type: ignore[arg-type]
        m, o = make()
        result = engine.resume(m, o)
        assert result is not None and result.continues is not None and result.continues[0] == session - 1
        source = Step(result.step)
        engine.begin(m, o, result.step, source)
        for step in range(result.step + 1, upto + 1):
            optimizer_step(m, o, step)
            source.step = step
            engine.commit(step, source)
        assert engine.end() == upto
    assert bases(root) == [(1, 0), (1, 4), (2, 8)]  # session 3 (from 9) is not due before 12
    for step in (LAST, FIRST + 2, FIRST + 1, FIRST):
        res, mod, opts = restore(str(root), step if step != LAST else None)
        assert (res.step, res.base_step) == (step, 8 if step >= 8 else 4)
        assert_state(truth, res, mod, opts)


KILLED = """
import sys, time
sys.path[:0] = [{tests!r}]
from engine_runs import FaultyStorage, make
from test_continued_session import SETTINGS, FIRST, Step, train_on
from diffckpt import CheckpointEngine, CheckpointOptions


class Stuck(FaultyStorage):  # the disk takes forever with session 2's segments
    def write(self, path, data):
        if path.startswith("diffs/") and ".g000002." in path:
            time.sleep(600)
        super().write(path, data)


m, o = make()
engine = CheckpointEngine(Stuck({root!r}), CheckpointOptions(**{{**SETTINGS, "local_dir": {local!r}}}))
assert engine.resume(m, o).step == FIRST
engine.begin(m, o, FIRST, Step(FIRST))
train_on(engine, m, o)
print("RECORDED", flush=True)
time.sleep(600)
"""


def test_a_process_killed_with_its_segments_on_the_way_resumes_at_its_last_journaled_step(tmp_path: Path, truth: Truth) -> None:
    root, local = tmp_path / "run", tmp_path / "local"
    first_session(root)
    script = KILLED.format(tests=os.path.join(TESTS, "core"), root=str(root), local=str(local))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=subprocess_env(), start_new_session=True)
    try:
        assert proc.stdout is not None
        assert select.select([proc.stdout], [], [], 60)[0], "training waited for its storage after the resume"
        assert proc.stdout.readline().strip() == "RECORDED", proc.stdout.read()
        deadline = time.monotonic() + 60
        while journaled(local, root) != list(range(FIRST + 1, LAST + 1)):
            assert time.monotonic() < deadline, journaled(local, root)
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the process and every descendant
        proc.wait(timeout=60)
        if proc.stdout is not None:
            proc.stdout.close()
    assert bases(root) == [(1, 0)] and not list((root / "diffs").glob("*.g000002.seg"))
    m, o = make()
    engine = CheckpointEngine(root, CheckpointOptions(**{**SETTINGS, "local_dir": str(local)}))  # type: ignore[arg-type]
    result = engine.resume(m, o)
    assert result is not None and (result.step, result.base_step, result.continues) == (LAST, 0, (2, LAST, 0))
    assert_state(truth, result, m, o)
