"""Bit-exact resume after a real ``kill -9``, against runs that never used the library."""

from __future__ import annotations

import os
import random

import pytest
import torch
from helpers import assert_bitwise_equal, count_tensors, run_script, steps_in

SCRIPT = "tests/lightning/train_script.py"
SEED = int(os.environ.get("DIFFCKPT_TEST_SEED", random.randrange(1 << 30)))
STEPS = {"adamw": 30, "adamw_bf16": 24, "sgd_bn": 30, "manual2": 40, "scaler_skip": 20}
ONE_STEP = ("adamw", "adamw_bf16", "sgd_bn")  # one optimizer step per STEP line, none skipped


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final state of an uninterrupted run without diffckpt, per config (computed once)."""
    cache: dict[str, dict] = {}

    def get(config: str) -> dict:
        if config not in cache:
            out = tmp_path_factory.mktemp("ref") / f"{config}.pt"
            rc, log = run_script(SCRIPT, [config, str(out), "--no-lib"])
            assert rc == 0, log[-3000:]
            cache[config] = torch.load(out, weights_only=False)
        return cache[config]

    return get


def _first_step(log: str) -> int:
    return steps_in(log)[0]


# make soak: adamw (adamw_bf16 is the same loop with 16-bit gradients), scaler_skip (skipped AMP
# steps are killed and resumed under Accelerate's loop and with a codec under Lightning) and sgd_bn
# (the core records a module's buffers whatever the front end: tests/storage/test_crash.py kills
# and resumes a batch-norm model on every trial; Lightning hands over the module as in adamw_bf16).
@pytest.mark.parametrize("config", [pytest.param(c, marks=pytest.mark.slow) if c in ("adamw", "scaler_skip", "sgd_bn")
                                    else c for c in sorted(STEPS)])
def test_kill9_then_resume_last_is_bitwise_identical(config, reference, tmp_path):
    rng = random.Random(f"{SEED}-{config}")
    kill_at = rng.randrange(2, STEPS[config] - 2)
    run = str(tmp_path / "run")
    rc, log = run_script(SCRIPT, [config, str(tmp_path / "crashed.pt"), "--dirpath", run], kill_at_step=kill_at)
    assert rc == -9, f"training was not killed (seed {SEED}): {log[-2000:]}"
    rc, log = run_script(SCRIPT, [config, str(tmp_path / "resumed.pt"), "--dirpath", run, "--resume"])
    assert rc == 0, log[-3000:]
    assert "Restoring states from the checkpoint path" in log
    resumed_from = _first_step(log)
    assert resumed_from <= kill_at + 2, (resumed_from, kill_at)
    if config in ONE_STEP:  # the node-local tier (on by default): a kill loses at most the step in
        # flight besides the one printed (STEP n is printed before DiffCheckpoint commits step n)
        assert resumed_from >= kill_at - 1, (resumed_from, kill_at, SEED)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)
    ref = reference(config)
    assert count_tensors(ref["model"]) > 10 and count_tensors(ref["optimizers"]) > 10
    try:  # model, optimizers, schedulers, step and all RNG states
        assert_bitwise_equal(ref, resumed)
    except AssertionError as exc:
        raise AssertionError(f"killed at step {kill_at}, resumed from {resumed_from} (seed {SEED}): {exc}") from None


# bf16-mixed kill -9 and resume also runs in make gpu-check's dry run (tests/test_gpu_check.py).
# make soak: every kill -9 test above compares its resumed run, whose state up to the kill is the
# library's run, with a run that never imported diffckpt: a perturbation before or after fails it.
@pytest.mark.slow
@pytest.mark.parametrize("config", ["adamw", "adamw_bf16"])
def test_library_does_not_perturb_training(config, reference, tmp_path):
    out = tmp_path / "with_lib.pt"
    rc, log = run_script(SCRIPT, [config, str(out), "--dirpath", str(tmp_path / "run")])
    assert rc == 0, log[-3000:]
    assert_bitwise_equal(reference(config), torch.load(out, weights_only=False))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One complete adamw run with diffckpt: every step durable, bases every 10 steps."""
    d = tmp_path_factory.mktemp("full")
    # every step durable: the tests resume explicit steps of it (paced, a busy machine may skip some)
    rc, log = run_script(SCRIPT, ["adamw", str(d / "out.pt"), "--dirpath", str(d / "run"),
                                  "--options", '{"durability": "every_step"}'])
    assert rc == 0, log[-3000:]
    return d / "run"


# step 1 (one step replayed from base 0) in make soak: base-step and mid-interval cover both ways here
@pytest.mark.parametrize("step", [pytest.param(1, marks=pytest.mark.slow), 10, 13],
                         ids=["step1", "base-step", "mid-interval"])
def test_resume_from_explicit_step(step, full_run, reference, tmp_path):
    """``ckpt_path=<root>/step=N`` resumes at N; training on from there matches the reference."""
    rc, log = run_script(SCRIPT, ["adamw", str(tmp_path / "out.pt"), "--dirpath", str(tmp_path / "run2"),
                                  "--ckpt-path", f"{full_run}/step={step}"])
    assert rc == 0, log[-3000:]
    assert _first_step(log) in (step, step + 1), log[-500:]
    assert_bitwise_equal(reference("adamw"), torch.load(tmp_path / "out.pt", weights_only=False))
