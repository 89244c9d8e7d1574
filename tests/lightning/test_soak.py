"""Long crash/resume soak: many random ``kill -9`` instants across configs (``make soak``).

CI runs the bounded versions in test_exactness.py and test_ddp.py; this one is marked slow.
Trials: DIFFCKPT_SOAK_TRIALS (default 40).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from helpers import assert_bitwise_equal, run_script
from test_exactness import SCRIPT, SEED, STEPS, reference  # noqa: F401  (fixture)

TRIALS = int(os.environ.get("DIFFCKPT_SOAK_TRIALS", "40"))


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(TRIALS))
def test_soak_kill9_resume(trial, reference, tmp_path):  # noqa: F811
    rng = random.Random(f"{SEED}-soak-{trial}")
    config = rng.choice(sorted(STEPS))
    kill_at = rng.randrange(1, STEPS[config])
    write_batch, base_every = rng.choice([1, 3, 8]), rng.choice([4, 10, 1000])
    opts = ["--write-batch", str(write_batch), "--base-every", str(base_every)]
    run = str(tmp_path / "run")
    rc, log = run_script(SCRIPT, [config, str(tmp_path / "x.pt"), "--dirpath", run, *opts], kill_at_step=kill_at)
    # A kill can land after training finished on the last steps; then the run simply completed.
    assert rc in (-9, 0), log[-2000:]
    out = tmp_path / "resumed.pt"
    rc, log = run_script(SCRIPT, [config, str(out), "--dirpath", run, "--resume", *opts])
    assert rc == 0, log[-3000:]
    assert_bitwise_equal(reference(config), torch.load(out, weights_only=False)), (config, kill_at, SEED)
