"""The node-local tier after a real ``kill -9``, its journal damaged or out of place before the
resume: the resume takes exactly the records that are whole and continue the run root's chain of
the newest session, and restores bitwise the uninterrupted run's state at the step it claims.

One training process per module (``killed``): base 0, steps 1..5 flushed to the run root (a
segment 0-5), steps 6..12 recorded into an open segment (``write_batch`` 100) and so only in the
journal and its spool; it is killed once the journal holds step 12 (its gradients let go by the
``zero_grad`` of a next step). Each test starts from a copy
of that run root and journal folder put back at the same paths (the journal names its spool by
absolute path). The journal is read here with ``struct``/``json`` by its frame layout (b"DJ" |
u32 length | JSON | 16-byte XXH3-128), not by diffckpt's reader.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from engine_runs import (  # noqa: F401  (one_thread: autouse, one torch thread as the training process)
    OPTIONS,
    Truth,
    assert_state,
    make,
    one_thread,
    plain_truth,
    train_steps,
)
from helpers import subprocess_env

from diffckpt import CheckpointEngine, CheckpointOptions, FsspecStorage
from diffckpt.localtier import read_local_tier
from diffckpt.runstore import RunStore

TESTS = str(Path(__file__).resolve().parent.parent)
DURABLE, STEPS = 5, 12  # the run root's newest step, and the journal's

TRAINING = """
import sys, time
sys.path[:0] = [{tests!r}]
from engine_runs import OPTIONS, make, train_steps
from diffckpt import CheckpointEngine, CheckpointOptions
module, optimizers = make()
options = CheckpointOptions(**{{**OPTIONS, "write_batch": 100, "base_every_n_steps": 1000, "local_dir": {local!r}}})
engine = CheckpointEngine({root!r}, options)
engine.start(module, optimizers, 0)
engine.write_base(0, module.state_dict(), [o.state_dict() for o in optimizers], {{"x": 0}})
truth = {{}}
train_steps(engine, module, optimizers, 1, {durable}, truth)
engine.flush()
train_steps(engine, module, optimizers, {durable} + 1, {steps}, truth)
for o in optimizers:  # as the next step begins: the last record's gradients are let go
    o.zero_grad()
print("RECORDED", flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def truth() -> Truth:
    return plain_truth(STEPS + 9)


def frames(data: bytes) -> list[tuple[int, int, dict[str, Any]]]:
    """``(start, end, body)`` of each whole frame of a journal."""
    out, pos = [], 0
    while pos + 6 <= len(data):
        magic, length = struct.unpack_from("<2sI", data, pos)
        end = pos + 6 + length + 16
        if magic != b"DJ" or end > len(data):
            break
        try:
            out.append((pos, end, json.loads(data[pos + 6: pos + 6 + length])))
        except ValueError:  # damaged
            break
        pos = end
    return out


def journal_files(local: Path) -> list[Path]:
    return sorted(local.glob(f"diffckpt-{os.geteuid()}/*/*.journal"))


def journaled_steps(local: Path) -> list[int]:
    return [body["step"] for path in journal_files(local) for _, _, body in frames(path.read_bytes())[1:]]


def start_training(root: Path, local: Path) -> subprocess.Popen[str]:
    """The training process, once the journal holds every step up to ``STEPS``."""
    script = TRAINING.format(tests=TESTS, root=str(root), local=str(local), durable=DURABLE, steps=STEPS)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=subprocess_env(), start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "RECORDED", proc.stdout.read()
        deadline = time.monotonic() + 60
        while journaled_steps(local) != list(range(DURABLE + 1, STEPS + 1)):
            assert time.monotonic() < deadline, journaled_steps(local)
            time.sleep(0.02)
    except BaseException:
        kill(proc)
        raise
    return proc


def kill(proc: subprocess.Popen[str]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    if proc.stdout is not None:
        proc.stdout.close()


@dataclass
class Crash:
    root: Path
    local: Path
    pristine: Path

    @property
    def journal(self) -> Path:
        (path,) = journal_files(self.local)
        return path

    def header(self) -> dict[str, Any]:
        return frames(self.journal.read_bytes())[0][2]

    def entry(self, step: int) -> tuple[int, int, dict[str, Any]]:
        """The journal frame of ``step``: ``(start, end, body)``."""
        return next(f for f in frames(self.journal.read_bytes())[1:] if f[2]["step"] == step)

    @property
    def spool(self) -> Path:
        return Path(self.header()["spool"])

    def put_back(self) -> None:
        """The run root and journal folder as the kill left them."""
        for name in ("run", "local"):
            shutil.rmtree(self.root.parent / name, ignore_errors=True)
            shutil.copytree(self.pristine / name, self.root.parent / name)


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Crash:
    base = tmp_path_factory.mktemp("killed")
    crash = Crash(base / "run", base / "local", base / "pristine")
    kill(start_training(crash.root, crash.local))
    shutil.copytree(crash.root, crash.pristine / "run")
    shutil.copytree(crash.local, crash.pristine / "local")
    return crash


@pytest.fixture
def crash(killed: Crash) -> Crash:
    killed.put_back()
    # what the kill left: steps up to 5 in the run root, 6..12 only in the journal and its spool
    assert segments(killed.root) == [(0, DURABLE, 1)]
    assert killed.spool.is_file() and killed.spool.parent == killed.root / "diffs"
    assert killed.header()["after"] == DURABLE and killed.header()["gen"] == 1
    return killed


def segments(root: Path) -> list[tuple[int, int, int]]:
    return [(s.after, s.last, s.gen) for s in RunStore(FsspecStorage(str(root))).inventory().segments]


def restore(root: Path, local: Path | None, truth: Truth) -> int:
    """Restore the newest step with the local tier in ``local``; check it bitwise; return it."""
    module, optimizers = make()
    engine = CheckpointEngine(root, CheckpointOptions(**{**OPTIONS, "local_dir": None if local is None else str(local)}))
    result = engine.restore(module, optimizers)
    assert_state(truth, result, module, optimizers)
    return result.step


def test_a_resume_on_the_node_takes_back_every_journaled_step(crash: Crash, truth: Truth,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    journal, spool = crash.journal.read_bytes(), crash.spool
    assert restore(crash.root, None, truth) == DURABLE  # the journal off: not read, not touched
    assert crash.journal.read_bytes() == journal and spool.is_file()
    with caplog.at_level(logging.WARNING, logger="diffckpt"):
        assert restore(crash.root, crash.local, truth) == STEPS
    assert "held steps 6..12 of session g1" in caplog.text
    assert segments(crash.root) == [(0, DURABLE, 1), (DURABLE, STEPS, 1)]
    assert journal_files(crash.local) == [] and not spool.exists()
    assert restore(crash.root, crash.local, truth) == STEPS  # committed: the same again, nothing left to take


def test_the_journal_deleted_resumes_from_the_run_roots_durable_step(crash: Crash, truth: Truth) -> None:
    """A resume on another node: no journal there."""
    shutil.rmtree(crash.local)
    assert restore(crash.root, crash.local, truth) == DURABLE
    assert segments(crash.root) == [(0, DURABLE, 1)]


def _tear_journal(crash: Crash, step: int) -> None:
    start, end, _ = crash.entry(step)
    with open(crash.journal, "r+b") as f:
        f.truncate((start + end) // 2)


def _flip_journal(crash: Crash, step: int) -> None:
    start, end, _ = crash.entry(step)
    _flip(crash.journal, start + 6 + (end - 16 - start - 6) // 2)  # inside its JSON


def _tear_spool(crash: Crash, step: int) -> None:
    entry = crash.entry(step)[2]
    with open(crash.spool, "r+b") as f:
        f.truncate(entry["offset"] + entry["length"] // 2)


def _flip_spool(crash: Crash, step: int) -> None:
    entry = crash.entry(step)[2]
    _flip(crash.spool, entry["offset"] + entry["length"] // 2)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("damage", "step"), [
    (_tear_journal, 10),  # the journal cut mid-frame
    (_flip_journal, 10),  # a frame that fails its checksum
    (_tear_spool, 10),  # the spool cut mid-record
    (_flip_spool, 10),  # a flipped byte in a record's bytes
    (_flip_spool, DURABLE + 1),  # ... in the first record: nothing is taken
], ids=["journal-torn", "journal-flipped", "spool-torn", "spool-flipped", "first-record-flipped"])
def test_damage_ends_what_is_taken_at_the_last_whole_record(crash: Crash, truth: Truth, damage: Any,
                                                             step: int) -> None:
    spool = crash.spool
    damage(crash, step)
    assert restore(crash.root, crash.local, truth) == step - 1
    assert segments(crash.root) == [(0, DURABLE, 1)] + ([(DURABLE, step - 1, 1)] if step - 1 > DURABLE else [])
    assert journal_files(crash.local) == [] and not spool.exists()  # what could not be taken is gone


def test_a_journal_of_an_older_session_is_stale(crash: Crash, truth: Truth) -> None:
    """The run resumed elsewhere (no journal there) and a new session trained on; then the old
    session's journal, which continues its own session's chain, is stale: removed, never merged."""
    kept = crash.pristine / "local"
    shutil.rmtree(crash.local)
    module, optimizers = make()
    engine = CheckpointEngine(crash.root, CheckpointOptions(**{**OPTIONS, "local_dir": str(crash.local)}))
    result = engine.restore(module, optimizers)
    assert result.step == DURABLE
    engine.start(module, optimizers, DURABLE)  # session 2
    engine.write_base(DURABLE, module.state_dict(), [o.state_dict() for o in optimizers], {"x": DURABLE})
    seen: Truth = {}
    train_steps(engine, module, optimizers, DURABLE + 1, DURABLE + 3, seen)
    assert engine.close() == DURABLE + 3
    shutil.copytree(kept, crash.local, dirs_exist_ok=True)  # the journal of session 1 is back
    spool = crash.spool
    if not spool.exists():  # a clean-up of the run root may have taken the orphan spool
        shutil.copy(crash.pristine / spool.relative_to(crash.root.parent), spool)
    tier = read_local_tier(RunStore(FsspecStorage(str(crash.root))), str(crash.local))
    assert [j.path for j in tier.stale] == [str(crash.journal)] and tier.records == [] and tier.step is None
    assert restore(crash.root, crash.local, truth) == DURABLE + 3
    assert [s for s in segments(crash.root) if s[2] == 1] == [(0, DURABLE, 1)]  # nothing of session 1 added
    assert journal_files(crash.local) == [] and not spool.exists()


def test_a_journal_still_being_written_is_another_jobs(tmp_path: Path, truth: Truth,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Two jobs on one root: a restore while the first job still runs (its journal written by a
    live process) leaves that journal alone; once the process is gone, a resume takes it."""
    root, local = tmp_path / "run", tmp_path / "local"
    proc = start_training(root, local)
    try:
        (journal,) = journal_files(local)
        before = journal.read_bytes()
        with caplog.at_level(logging.WARNING, logger="diffckpt"):
            assert restore(root, local, truth) == DURABLE
        assert f"is in use (written by process {proc.pid}" in caplog.text
        assert journal.read_bytes() == before and segments(root) == [(0, DURABLE, 1)]
    finally:
        kill(proc)
    assert restore(root, local, truth) == STEPS
    assert journal_files(local) == []
