"""DDP on CPU (gloo, 2 processes): rank 0 writes, every rank resumes bit-exactly."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import assert_bitwise_equal, run_script
from test_exactness import SCRIPT, SEED

DDP = ["--devices", "2"]


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_ref") / "ref.pt"
    rc, log = run_script(SCRIPT, ["adamw", str(out), "--no-lib", *DDP])
    assert rc == 0, log[-3000:]
    return [torch.load(out, weights_only=False), torch.load(f"{out}.rank1", weights_only=False)]


@pytest.mark.parametrize("trial", [0])
def test_ddp_kill9_mid_epoch_resume_is_bitwise_identical_on_every_rank(trial, ddp_reference, tmp_path):
    kill_at = random.Random(f"{SEED}-ddp-{trial}").randrange(4, 27)
    run = str(tmp_path / "run")
    rc, log = run_script(SCRIPT, ["adamw", str(tmp_path / "x.pt"), "--dirpath", run, *DDP], kill_at_step=kill_at)
    assert rc == -9, log[-2000:]
    out = tmp_path / "resumed.pt"
    rc, log = run_script(SCRIPT, ["adamw", str(out), "--dirpath", run, "--resume", *DDP])
    assert rc == 0, log[-3000:]
    assert "Restoring states from the checkpoint path" in log
    resumed = [torch.load(out, weights_only=False), torch.load(f"{out}.rank1", weights_only=False)]
    for rank in (0, 1):  # model, optimizer, schedulers and each rank's own RNG streams
        try:
            assert_bitwise_equal(ddp_reference[rank], resumed[rank])
        except AssertionError as exc:
            raise AssertionError(f"rank {rank}, killed at step {kill_at} (seed {SEED}): {exc}") from None


@pytest.fixture(scope="module")
def ddp_full_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("ddp_full")
    # every step durable: the tests resume explicit steps of it (paced, a busy machine may skip some)
    rc, log = run_script(SCRIPT, ["adamw", str(d / "out.pt"), "--dirpath", str(d / "run"), *DDP,
                                  "--options", '{"durability": "every_step"}'])
    assert rc == 0, log[-3000:]
    return d / "run"


# make soak: an explicit step under 2 Lightning processes is restored in test_model_parallel.py
# (test_resume_from_an_explicit_step_is_bitwise_identical), and under DDP in Accelerate's tests
@pytest.mark.slow
@pytest.mark.parametrize("step", [13, 18], ids=["mid-epoch", "epoch-end"])  # 3 steps per epoch
def test_ddp_resume_from_explicit_step(step, ddp_full_run, ddp_reference, tmp_path):
    """At an epoch end Lightning counts the epoch twice on resume; the data order must not care."""
    out = tmp_path / "resumed.pt"
    rc, log = run_script(SCRIPT, ["adamw", str(out), "--dirpath", str(tmp_path / "run"),
                                  "--ckpt-path", f"{ddp_full_run}/step={step}", *DDP])
    assert rc == 0, log[-3000:]
    resumed = [torch.load(out, weights_only=False), torch.load(f"{out}.rank1", weights_only=False)]
    for rank in (0, 1):
        assert_bitwise_equal(ddp_reference[rank], resumed[rank])


# make soak: rank 0's reviews reach every DDP rank in tests/core/test_base_by_bytes.py, and an auto-tuned
# run is killed and resumed bitwise by default in tests/lightning/test_autotune_lightning.py and Accelerate's.
@pytest.mark.slow
def test_ddp_auto_tuned_kill9_resume_is_bitwise_identical_on_every_rank(ddp_reference, tmp_path):
    """Settings on "auto": rank 0 decides at each review and rank 1 adopts (broadcast), so both
    take the same restorable steps (else their per-rank state gathers would hang)."""
    run = str(tmp_path / "run")
    auto = ["--auto", "--tuning", '{"retune_every_n_steps": 5, "mtbf_s": 10, "max_overhead": 0.5}']
    rc, log = run_script(SCRIPT, ["adamw", str(tmp_path / "x.pt"), "--dirpath", run, *DDP, *auto], kill_at_step=24)
    assert rc == -9, log[-2000:]
    assert "auto-tuned at step" in log, log[-3000:]
    out = tmp_path / "resumed.pt"
    rc, log = run_script(SCRIPT, ["adamw", str(out), "--dirpath", run, "--resume", *DDP, *auto])
    assert rc == 0, log[-3000:]
    resumed = [torch.load(out, weights_only=False), torch.load(f"{out}.rank1", weights_only=False)]
    for rank in (0, 1):
        assert_bitwise_equal(ddp_reference[rank], resumed[rank])
