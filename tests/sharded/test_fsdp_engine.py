"""Sharded training (FSDP2 ``fully_shard``, 2 gloo processes) checkpointed through the core engine.

Every run is a real multi-process job (``fsdp_loop.py``), killed for real with SIGKILL of the whole
process tree where a test says so. A resumed run is compared on every rank, tensor by tensor with
``torch.equal``, with a run that never used diffckpt; runs restored onto another layout are
compared with the full tensors of that run at the restored step.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_runs import record_span
from helpers import ROOT, assert_bitwise_equal, kill_tree, run_script, script_env

import diffckpt
from diffckpt.shardedrun import ShardedRun
from diffckpt.storage import open_storage

SCRIPT = "tests/sharded/fsdp_loop.py"
STEPS = 12
FULL_AT = ["4", "6", "8", "9", "10", "12"]


def train(out: Path, steps: int, *extra: str, kill_at: int | None = None) -> str:
    rc, log = run_script(SCRIPT, [str(out), "--steps", str(steps), *extra], kill_at_step=kill_at, timeout=300)
    if kill_at is None:
        assert rc == 0, log
    return log


def load(path: Path) -> Any:
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run without diffckpt: every rank's pieces at the end, full tensors at
    the steps in FULL_AT."""
    out = tmp_path_factory.mktemp("reference")
    train(out, STEPS, "--full-at", *FULL_AT)
    return out


def assert_same_pieces(reference: Path, out: Path) -> None:
    for rank in (0, 1):
        assert_bitwise_equal(load(reference / f"rank{rank}.pt"), load(out / f"rank{rank}.pt"), f"rank {rank}")


def assert_full_equal(expected: dict[str, Any], state: dict[str, Any]) -> None:
    assert_bitwise_equal(expected["model"], state["model"])
    assert_bitwise_equal(expected["optimizer"], state["optimizers"][0]["state"])


@pytest.mark.slow  # make soak: FSDP2 is killed and resumed bitwise by the example and on S3 by default
def test_kill_at_a_random_step_and_resume_is_bitwise_on_every_rank(reference, tmp_path):
    kill_at = random.Random(os.getpid()).randint(3, STEPS - 2)
    root = tmp_path / "run"
    train(tmp_path / "a", STEPS, "--root", str(root), kill_at=kill_at)
    log = train(tmp_path / "b", STEPS, "--root", str(root), "--resume")
    assert "STEP 1\n" not in log, f"killed at step {kill_at}, but the resumed run started over"
    assert_same_pieces(reference, tmp_path / "b")
    # The run as it is now, rebuilt in one process from both ranks' streams, is the full state.
    state = diffckpt.load_state(root)
    assert state["step"] == STEPS
    assert_full_equal(load(reference / f"full{STEPS}.pt"), state)
    for step in (6, 10):  # an explicit older step too, from each rank's base and diffs
        assert_full_equal(load(reference / f"full{step}.pt"), diffckpt.load_state(root, step))


# make soak: test_fsdp_2d.py's chain of layouts (1 unsharded -> 4 -> ... -> 2 -> 1 unsharded) covers these
# restores by default, on the 2-D model.
@pytest.mark.slow
def test_layout_changes_restore_the_saved_step_exactly(reference, tmp_path):
    # 1 -> 2: a single-process run (no sharding) resumed by a 2-rank FSDP2 job.
    one = tmp_path / "one"
    train(tmp_path / "u", 6, "--world", "1", "--unsharded", "--root", str(one), "--full-at", "6")
    train(tmp_path / "v", 8, "--root", str(one), "--resume", "--dump-restored")
    restored = load(tmp_path / "v" / "restored.pt")
    assert restored["step"] == 6
    assert_bitwise_equal(load(tmp_path / "u" / "full6.pt")["model"], restored["model"])
    assert_bitwise_equal(load(tmp_path / "u" / "full6.pt")["optimizer"], restored["optimizer"])
    assert diffckpt.load_state(one)["step"] == 8  # training went on, sharded, on the same root

    # 2 -> 1: a 2-rank run stopped at step 6, resumed by one process on a plain module.
    two = tmp_path / "two"
    train(tmp_path / "w", 6, "--root", str(two))
    train(tmp_path / "x", 8, "--world", "1", "--unsharded", "--root", str(two), "--resume", "--dump-restored")
    restored = load(tmp_path / "x" / "restored.pt")
    assert restored["step"] == 6
    expected = load(reference / "full6.pt")
    assert_bitwise_equal(expected["model"], restored["model"])
    assert_bitwise_equal(expected["optimizer"], restored["optimizer"])
    assert diffckpt.load_state(two)["step"] == 8


def _run_until(args: list[str], done: Any, timeout: float = 120) -> str:
    """Start the script, wait until ``done()`` holds, then SIGKILL its whole process tree."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, SCRIPT), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=script_env(), start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while not done():
            assert proc.poll() is None, f"the job ended before the instant to kill it:\n{proc.stdout.read()}"
            assert time.monotonic() < deadline, "the instant to kill never came"
            time.sleep(0.05)
    finally:
        kill_tree(proc.pid)
        out = proc.communicate(timeout=60)[0]
    return out


def test_kill_between_rank_0s_and_rank_1s_part_of_a_base(reference, tmp_path):
    root = tmp_path / "run"
    r0 = root / "ranks/r00000/bases/000000000008.g000001/COMMIT"
    r1 = root / "ranks/r00001/bases/000000000008.g000001/COMMIT"
    log = _run_until([str(tmp_path / "a"), "--steps", str(STEPS), "--root", str(root),
                      "--stall", "1:bases/000000000008[^/]*/COMMIT"], lambda: r0.exists())
    assert r0.exists() and not r1.exists(), log
    run = ShardedRun(open_storage(root))
    res = run.resolve()
    assert res is not None and res.step >= 6  # rank 1's diffs up to its stalled base still count
    train(tmp_path / "b", STEPS, "--root", str(root), "--resume")
    assert_same_pieces(reference, tmp_path / "b")


# make soak: test_fsdp_2d.py's test_a_damaged_owner_record_sends_every_rank_back_a_step damages one rank's
# stream the same way (a flipped byte in its last record, a missing segment) under HSDP, through the same
# per-rank replay and outcome exchange, and costs the suite's time instead.
@pytest.mark.slow
def test_one_ranks_damaged_or_missing_segment(reference, tmp_path):
    root = tmp_path / "run"
    train(tmp_path / "a", 10, "--root", str(root))
    seg = root / "ranks/r00001/diffs/000000000008-000000000010.g000001.seg"
    data = bytearray(seg.read_bytes())
    offset, length = record_span(bytes(data), 10)
    data[offset + length // 2] ^= 0xFF  # a flipped byte in the last record: only reading finds it
    seg.write_bytes(bytes(data))
    assert ShardedRun(open_storage(root)).resolve().step == 10  # the listings cannot tell
    with pytest.warns(UserWarning, match="restoring step 9"):
        state = diffckpt.load_state(root)
    assert state["step"] == 9  # rank 1 stops at 9, so rank 0 goes back there too
    assert_full_equal(load(reference / "full9.pt"), state)
    # Resumed: every rank agrees on step 9 (rank 0 replays again to it), and training continues.
    train(tmp_path / "b", STEPS, "--root", str(root), "--resume")
    assert_same_pieces(reference, tmp_path / "b")

    # A missing segment on one rank: the listing shows it, and the step before it is chosen.
    other = tmp_path / "run2"
    train(tmp_path / "c", 10, "--root", str(other))
    (other / "ranks/r00000/diffs/000000000008-000000000010.g000001.seg").unlink()
    assert diffckpt.load_state(other)["step"] == 8


def test_nothing_durable_on_every_rank_is_a_clear_error(tmp_path):
    root = tmp_path / "run"
    shutil.copytree(Path(ROOT) / "tests/golden/sharded", root)  # a two-rank run, steps 0..4
    for p in (root / "ranks/r00001/bases").glob("*/COMMIT"):
        p.unlink()  # rank 1's only base never committed: no step is restorable on rank 1
    with pytest.raises(diffckpt.CheckpointNotFoundError, match="no step is durable on every rank.*g1 \\(2 ranks\\)"):
        diffckpt.load_state(root)


# make soak: the example trains, kills and resumes as the kill -9 tests of this file and test_fsdp_2d.py do,
# through the same CheckpointEngine calls; they cover it by default (the suite's 25 minutes on CI's 2 cores).
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", "hsdp", "tp"])
def test_the_example_resumes_bit_exact(layout):
    rc, log = run_script("examples/sharded_train.py", ["--steps", "12", "--kill-at", "7", "--layout", layout])
    assert rc == 0, log
    assert "killed the job with SIGKILL after step 7" in log and "bit-exact" in log and "NOT" not in log


# make soak: each rank's stream is a run root under ranks/ written through fsspec like any other, so the
# sharded tests above on local disk, tests/storage/test_s3_engine.py (writers on S3) and the Lightning S3
# kill -9 test (credentials from the environment in a subprocess) cover its parts by default.
@pytest.mark.slow
def test_s3_per_rank_writers(reference, s3_bucket, tmp_path):
    url = s3_bucket.url  # the subprocesses find moto through the environment, as users configure S3
    train(tmp_path / "a", STEPS, "--root", url, kill_at=7)
    train(tmp_path / "b", STEPS, "--root", url, "--resume")
    assert_same_pieces(reference, tmp_path / "b")
    keys = open_storage(url, **s3_bucket.storage_options).list("")
    assert any(k.startswith("ranks/r00000/diffs/") for k in keys) and any(k.startswith("ranks/r00001/diffs/") for k in keys)
    assert diffckpt.load_state(url, storage_options=s3_bucket.storage_options)["step"] == STEPS


# make soak: retention trims every rank's stream in the test below, and every rank follows rank 0's
# auto-tuned settings in tests/core/test_base_by_bytes.py (the review's broadcast under DDP)
@pytest.mark.slow
def test_auto_tuning_and_retention_beside_sharded_training(reference, tmp_path):
    root = tmp_path / "run"
    train(tmp_path / "a", STEPS, "--root", str(root), "--auto", "--keep-last-bases", "1")
    # Rank 0 reviewed from both ranks' measurements, and both streams follow its settings.
    decisions = (root / "ranks/r00000/sessions/g000001.tuning.json")
    assert decisions.exists()
    run = ShardedRun(open_storage(root))
    invs = run.inventories(2)
    assert [s.path for s in invs[0].segments] == [s.path for s in invs[1].segments]
    # Retention kept only what the newest base needs, on both ranks, and the run still restores.
    assert all(len(inv.bases) == 1 for inv in invs), [inv.bases for inv in invs]
    state = diffckpt.load_state(root)
    assert state["step"] == STEPS
    assert_full_equal(load(reference / f"full{STEPS}.pt"), state)


def test_default_options_base_by_bytes_alike_on_every_rank_and_retention_trims_every_stream(tmp_path):
    """The shipped defaults on a sharded job: the byte-sized base interval is rank 0's, so every
    rank writes its bases at the same steps; the default retention leaves each stream the chains
    of its two newest bases, and the newest step restores."""
    root, steps = tmp_path / "run", 40
    log = train(tmp_path / "a", steps, "--root", str(root), "--defaults", "--full-at", str(steps))
    # Found anywhere in the log: two ranks print to one pipe, and unbuffered output
    # (PYTHONUNBUFFERED) may put one rank's line before the other's newline.
    followed = [m[1] for m in re.finditer(r"INTERVAL rank \d+: (\S+ \[[^\]]*\])", log)]
    assert len(followed) == 2 and followed[0] == followed[1], log  # the same interval and base steps
    every, based = int(followed[0].split(" ", 1)[0]), json.loads(followed[0].split(" ", 1)[1])
    assert len(based) >= 3 and based[0] <= every + 1, (every, based)  # periodic bases, from step 0
    invs = ShardedRun(open_storage(root)).inventories(2)
    kept = [[b.step for b in inv.bases] for inv in invs]
    # Both streams kept the same bases: the two newest and the one training ended on at most.
    assert kept[0] == kept[1] and set(kept[0]) <= {0, *based, steps} and len(kept[0]) <= 3, (based, kept)
    state = diffckpt.load_state(root)
    assert state["step"] == steps
    assert_full_equal(load(tmp_path / "a" / f"full{steps}.pt"), state)


def _stored_grad_dtypes(root: Path, rank: int) -> set[torch.dtype]:
    from diffckpt.segment import decode_segment

    dtypes = set()
    for seg in (root / f"ranks/r{rank:05d}/diffs").glob("*.seg"):
        _, records, _ = decode_segment(seg.read_bytes(), str(seg))
        dtypes |= {g.dtype for r in records for e in r["events"] for grp in e["grads"] for g in grp if g is not None and g.numel()}
    return dtypes


def test_bfloat16_reduction_is_stored_in_16_bits_and_resumes_bitwise(tmp_path):
    # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16), no clipping that engages and no
    # accumulation (a float32 sum of two reductions): the float32 gradients the optimizer gets
    # hold bfloat16 values, stored losslessly in 16 bits.
    args = ["--bf16", "--clip", "inf", "--micro", "1"]
    train(tmp_path / "ref", 8, *args)
    root = tmp_path / "run"
    train(tmp_path / "a", 8, *args, "--root", str(root), kill_at=5)
    assert _stored_grad_dtypes(root, 0) == {torch.bfloat16} and _stored_grad_dtypes(root, 1) == {torch.bfloat16}
    train(tmp_path / "b", 8, *args, "--root", str(root), "--resume")
    assert_same_pieces(tmp_path / "ref", tmp_path / "b")
    # Clipping that engages rescales them in float32, which the bits show: then they are kept in
    # 32 bits (decided per tensor from its bits, tests/core/test_narrowing.py).


@pytest.mark.slow  # a benchmark's smoke run: its code paths are the sharded tests above
def test_sharded_benchmark_smoke_run(tmp_path):
    """``bench/sharded.py --quick``: every configuration runs, and every restore (diffckpt and
    DCP) is bitwise equal to the trained state on every rank."""
    out = tmp_path / "sharded.md"
    rc, log = run_script("bench/sharded.py", ["--quick", "--out", str(out)])
    assert rc == 0, log
    report = out.read_text()
    for row in ("| none |", "| diffckpt |", "| dcp-async-1 |", "| dcp-async-10 |", "| dcp-sync-10 |"):
        assert row in report
    restores = [line for line in report.splitlines() if line.startswith("| 10 |") or line.startswith("| 20 |")]
    assert len(restores) == 2 and all(line.endswith("| yes / yes |") for line in restores), restores


SOAK_TRIALS = int(os.environ.get("DIFFCKPT_SHARDED_SOAK_TRIALS", "12"))


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(SOAK_TRIALS))
def test_soak_kill_at_random_steps_and_resume(reference, tmp_path, trial):
    """Soak: a run killed at a random step, its resume killed again at a later random step (ranks
    at different points of their writes each time), then finished: every rank bitwise equal."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    root = tmp_path / "run"
    first = rng.randint(2, STEPS - 3)
    second = rng.randint(first + 1, STEPS - 1)
    train(tmp_path / "a", STEPS, "--root", str(root), kill_at=first)
    train(tmp_path / "b", STEPS, "--root", str(root), "--resume", kill_at=second)
    train(tmp_path / "c", STEPS, "--root", str(root), "--resume")
    assert_same_pieces(reference, tmp_path / "c")
    print(f"trial {trial}: killed at steps {first} and {second}")


def test_fsdp1_is_refused_before_anything_is_written(tmp_path):
    from torch.distributed.fsdp import FullyShardedDataParallel

    from diffckpt import CheckpointEngine, UnsupportedConfigurationError

    # FSDP1 cannot be built on a machine without an accelerator ("FSDP needs a non-CPU accelerator
    # device"), so the wrapper is made without its own __init__: what is checked is that the engine
    # recognises it, in a model, before it records or restores anything.
    wrapper = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    torch.nn.Module.__init__(wrapper)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.add_module("flat", wrapper)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = CheckpointEngine(tmp_path / "run")
    for call in (lambda: engine.begin(model, [opt], 0, None), lambda: engine.resume(model, [opt])):
        with pytest.raises(UnsupportedConfigurationError, match="FullyShardedDataParallel \\(FSDP1\\).*fully_shard"):
            call()
    assert not (tmp_path / "run").exists()
