"""``FabricCheckpointer`` in real Fabric loops on CPU: ``kill -9`` of the training process and
every process below it mid-run, resume, and compare bitwise (``torch.equal`` on every tensor of
model, optimizer, scheduler and RNG, on every rank) with an uninterrupted run of the same loop
that never imported diffckpt. One process, and two (``strategy="ddp"``, gloo) started by
Fabric's own launcher.
"""

from __future__ import annotations

import os
import random
import re
import signal
from pathlib import Path

import pytest
from helpers import (
    assert_bitwise_equal,
    free_port,
    last_step,
    load_ranks,
    reference_states,
    run_training,
    samples_seen,
    terminate_at_step,
)

SCRIPT = "tests/fabric/fabric_script.py"
SEED = int(os.environ.get("DIFFCKPT_TEST_SEED", "20261124"))

# name: (script arguments, processes, optimizer steps in the run)
CONFIGS = {
    "single": (["--clip", "1.0"], 1, 36),
    "single_accum": (["--accum", "2", "--every", "2", "--write-batch", "3"], 1, 18),
    "ddp": (["--devices", "2", "--accum", "2", "--clip", "1.0", "--epochs", "4"], 2, 12),
}


def _run(config: str, out: Path, extra: list[str] = (), **kw) -> str:
    args, _, _ = CONFIGS[config]
    env = {"MASTER_PORT": str(free_port())}
    return run_training(SCRIPT, [str(out), *args, *extra], env=env, **kw)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final state of every rank of the uninterrupted loop without diffckpt, per configuration."""
    return reference_states(tmp_path_factory, _run, lambda config: CONFIGS[config][1])


# One process and accumulation in make soak: DDP's two ranks run the same loop by default, and
# accumulation is killed and resumed under Accelerate's loop there.
@pytest.mark.parametrize("config", [pytest.param(c, marks=pytest.mark.slow) if c in ("single", "single_accum") else c
                                    for c in CONFIGS])
def test_kill9_then_restore_last_is_bitwise_identical(config, reference, tmp_path):
    args, ranks, steps = CONFIGS[config]
    # In the second half, so that steps past the starting base have had time to become durable.
    kill_at = random.Random(f"{SEED}-{config}").randrange(steps // 2, steps - 1)
    run = tmp_path / "run"
    killed = _run(config, tmp_path / "killed.pt", ["--dirpath", str(run)], kill_at_step=kill_at, drain=True)
    log = _run(config, tmp_path / "resumed.pt", ["--dirpath", str(run), "--resume", "last"])
    # anywhere in the log: ranks print to one pipe, unbuffered, so lines may run into each other
    resumed = [int(n) for n in re.findall(r"RESUMED (\d+) rank \d+", log)]
    assert len(resumed) == ranks and len(set(resumed)) == 1, log[-2000:]  # every rank, the same step
    assert 0 <= resumed[0] <= last_step(killed) + 1, (resumed, kill_at, last_step(killed))  # the step it reached
    # The node-local tier (on by default): STEP n is printed before step n is committed (at the
    # next batch request), so the kill loses at most that step and the one before it in flight,
    # and then the restorable steps in between (``--every``).
    every = int(args[args.index("--every") + 1]) if "--every" in args else 1
    assert resumed[0] >= kill_at - 1 - every, (resumed, kill_at, SEED)
    try:
        got = load_ranks(tmp_path / "resumed.pt", ranks)
        for r, (want, have) in enumerate(zip(reference(config), got)):
            assert_bitwise_equal(want, have, f"rank{r}")
    except AssertionError as exc:
        raise AssertionError(f"killed at step {kill_at}, resumed from {resumed[0]} (seed {SEED}): {exc}") from None


# ddp: make soak (SIGTERM on every rank of a DDP job is covered by the transformers Trainer's test, and
# Fabric under DDP by its kill -9 test); one process runs the adapter's SIGTERM path by default.
@pytest.mark.parametrize("config", ["single", pytest.param("ddp", marks=pytest.mark.slow)])
def test_sigterm_flushes_every_step_and_exits(config, reference, tmp_path):
    """SIGTERM to the process Fabric was started in (rank 0; under DDP its launcher's workers hear
    of it through the engine): every rank records the same step, flushes, logs how far durability
    got and exits; the resume from there is exact."""
    args, ranks, _ = CONFIGS[config]
    run = tmp_path / "run"
    env = {"MASTER_PORT": str(free_port())}
    rc, log, sent_after, last = terminate_at_step(SCRIPT, [str(tmp_path / "x.pt"), *args, "--dirpath", str(run)],
                                                  5, env=env)
    assert rc == 128 + signal.SIGTERM, log[-2000:]
    assert sent_after is not None and last <= sent_after + 1
    assert f"stopped by SIGTERM; durable up to step {last} in" in log, log[-2000:]
    log = _run(config, tmp_path / "resumed.pt", ["--dirpath", str(run), "--resume", "last"])
    assert {int(line.split()[1]) for line in log.splitlines() if line.startswith("RESUMED")} == {last}
    for r, (want, got) in enumerate(zip(reference(config), load_ranks(tmp_path / "resumed.pt", ranks))):
        assert_bitwise_equal(want, got, f"rank{r}")


# make soak: the kill -9 test above resumes Fabric through the same FabricCheckpointer calls.
@pytest.mark.slow
def test_example_resumes_where_it_stopped(tmp_path):
    """examples/fabric_train.py: one epoch, then a second run continues from its last step."""
    run = str(tmp_path / "run")
    assert "durable up to step 32 in" in run_training("examples/fabric_train.py", [run, "--epochs", "1"])
    log = run_training("examples/fabric_train.py", [run, "--epochs", "2"])
    assert "starting at step 32" in log and "durable up to step 64 in" in log, log[-2000:]


def test_epoch_continues_over_another_number_of_processes_every_sample_once(tmp_path):
    """2 processes stop 3 steps into epoch 1, 3 resume it and stop 2 steps later, 1 resumes it and
    stops 3 steps later, 1 finishes it: counting the samples each rank trained on, epoch 1 saw
    every sample exactly once (96 samples, dealt evenly: no padding), and the next epoch is whole
    on the new process count."""
    run, samples = tmp_path / "run", tmp_path / "samples"
    common = ["--dirpath", str(run), "--batch", "4", "--log-samples"]
    env = lambda: {"MASTER_PORT": str(free_port())}  # noqa: E731
    run_training(SCRIPT, [str(tmp_path / "a.pt"), "--devices", "2", "--stop-at", "15", *common, f"{samples}.a"],
                 env=env())
    log_b = run_training(SCRIPT, [str(tmp_path / "b.pt"), "--devices", "3", "--resume", "last", "--stop-at", "17",
                                  *common, f"{samples}.b"], env=env())
    log_c = run_training(SCRIPT, [str(tmp_path / "c.pt"), "--resume", "last", "--stop-at", "20", *common,
                                  f"{samples}.c"], env=env())
    # Interrupted again in the epoch dealt anew, and resumed on the same (one) process.
    log_d = run_training(SCRIPT, [str(tmp_path / "d.pt"), "--resume", "last", *common, f"{samples}.d"], env=env())
    assert "RESUMED 15 rank 0" in log_b and "RESUMED 17 rank 0" in log_c and "RESUMED 20 rank 0" in log_d
    everything = list(range(96))
    assert samples_seen(f"{samples}.a", 2, 0) == everything  # 12 steps of 2 × 4
    epoch1 = (samples_seen(f"{samples}.a", 2, 1, (12, 15)) + samples_seen(f"{samples}.b", 3, 1, (15, 17))
              + samples_seen(f"{samples}.c", 1, 1) + samples_seen(f"{samples}.d", 1, 1))
    assert sorted(epoch1) == everything
    assert len(samples_seen(f"{samples}.b", 3, 1, (15, 17))) == 24  # 2 steps of 3 × 4
    assert len(samples_seen(f"{samples}.c", 1, 1)) == 12  # 3 steps of 4
    assert samples_seen(f"{samples}.d", 1, 2) == everything
    assert "trained on 2 processes and resumes on 3" in log_b
    assert "cannot draw" not in log_b + log_c + log_d
