"""The node-local tier of a sharded job (FSDP2 ``fully_shard``, 2 gloo processes, ``fsdp_loop.py``):
each rank journals its own stream, each rank merges its own journal at the resume, and a step
counts only once every rank has it. With one rank's journal missing, the job resumes from what
that rank's run root holds, bitwise on every rank.

The job is killed at an instant that is stable, not a race: rank 0's upload of its segment 4-6
is held forever (``--stall``), so rank 0's writer queues segment 6-8 and base 8 behind it,
journals steps 9 and 10, and then waits to hand over segment 8-10 (two commits wait already); its
journals hold steps 5..10 for good and its run root ends at base 4. Rank 1 writes on (its run root
at step 10 or later) until it waits for rank 0. Journals go where ``DIFFCKPT_LOCAL_DIR`` says (``local_dir="auto"``),
a folder of the test's own. Every step is durable (``durability="every_step"``, ``fsdp_loop.py``):
paced, rank 0's writer would not wait behind its held upload.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, kill_tree, run_script, script_env
from test_fsdp_engine import SCRIPT, STEPS, assert_same_pieces

from diffckpt.journal import journal_folder
from diffckpt.shardedrun import ShardedRun
from diffckpt.storage import open_storage


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every rank's pieces at the end of a run without diffckpt."""
    out = tmp_path_factory.mktemp("uninterrupted")
    rc, log = run_script(SCRIPT, [str(out), "--steps", str(STEPS)], timeout=300)
    assert rc == 0, log
    return out


def journaled(folder: Path) -> list[int]:
    """The steps in the journals of ``folder``, read by the frame layout (b"DJ" | u32 length |
    JSON | 16-byte digest); the first frame is the header."""
    import json

    steps = []
    for path in folder.glob("*.journal"):
        data, pos, first = path.read_bytes(), 0, True
        while pos + 6 <= len(data):
            _, length = struct.unpack_from("<2sI", data, pos)
            if pos + 6 + length + 16 > len(data):
                break
            if not first:
                steps.append(json.loads(data[pos + 6: pos + 6 + length])["step"])
            first, pos = False, pos + 6 + length + 16
    return sorted(steps)


def resume(out: Path, root: Path, tmp: Path) -> str:
    rc, log = run_script(SCRIPT, [str(out), "--steps", str(STEPS), "--root", str(root), "--resume"],
                         env={"TMPDIR": str(tmp), "DIFFCKPT_LOCAL_DIR": str(tmp)}, timeout=300)
    assert rc == 0, log
    return log


def test_one_ranks_journal_missing(uninterrupted: Path, tmp_path: Path) -> None:
    root, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    run = ShardedRun(open_storage(root))
    folders = [Path(journal_folder(str(tmp), run.stream(rank).storage.url)) for rank in (0, 1)]
    rank1_at_10 = root / "ranks/r00001/diffs/000000000008-000000000010.g000001.seg"
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, SCRIPT), str(tmp_path / "a"), "--steps", str(STEPS),
                             "--root", str(root), "--stall", "0:diffs/000000000004-"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=script_env({"TMPDIR": str(tmp), "DIFFCKPT_LOCAL_DIR": str(tmp)}),
                            start_new_session=True)
    deadline = time.monotonic() + 120
    try:
        while not (rank1_at_10.exists() and journaled(folders[0]) == list(range(5, 11))
                   and journaled(folders[1]) == []):
            assert proc.poll() is None, "the job ended before the instant to kill it"
            assert time.monotonic() < deadline, ("the instant to kill never came", journaled(folders[0]))
            time.sleep(0.05)
    finally:
        kill_tree(proc.pid)
        log = proc.communicate(timeout=60)[0]
    assert "STALLED ranks/r00000/diffs/000000000004-" in log and "STEP 10\n" in log and "STEP 13\n" not in log, log
    newest = [inv.newest_step(1) for inv in run.inventories(2)]
    assert newest[0] == 4 and newest[1] >= 10, newest  # rank 0's run root ends at base 4
    # Training may go on a step between the instant seen and the kill landing: what each journal
    # holds is read after it. Rank 0's continues its base 4; rank 1's holds only what its run root
    # does not.
    j0, j1 = journaled(folders[0]), journaled(folders[1])
    assert j0 == list(range(5, j0[-1] + 1)) and j0[-1] >= 10 and all(s > newest[1] for s in j1), (j0, j1, newest)
    top = min(j0[-1], max([newest[1], *j1]))  # the newest step on every rank once the journals are merged
    shutil.copytree(root, tmp_path / "kept-run")
    shutil.copytree(tmp, tmp_path / "kept-tmp")

    # Every journal there: rank 0 takes back steps 5..10 (or 11), and that is durable on every rank.
    log = resume(tmp_path / "b", root, tmp)
    assert f"STEP {top + 1}\n" in log and f"STEP {top}\n" not in log, (top, log)
    assert_same_pieces(uninterrupted, tmp_path / "b")
    assert journaled(folders[0]) == []

    # Rank 0's journal missing (the job resumed on another node for rank 0): step 4, rank 0's
    # newest, is the newest on every rank.
    for path, kept in ((root, tmp_path / "kept-run"), (tmp, tmp_path / "kept-tmp")):
        shutil.rmtree(path)
        shutil.copytree(kept, path)
    assert journaled(folders[0]) == j0
    shutil.rmtree(folders[0])
    log = resume(tmp_path / "c", root, tmp)
    assert "STEP 5\n" in log and "STEP 4\n" not in log, log
    assert_same_pieces(uninterrupted, tmp_path / "c")
