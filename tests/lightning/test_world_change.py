"""A Lightning DDP epoch interrupted on one number of processes and continued on others: every
sample of the epoch is trained on exactly once, counted from what each rank logged."""

from __future__ import annotations

from helpers import run_training, samples_seen

SCRIPT = "tests/lightning/order_script.py"


def test_epoch_continues_over_another_number_of_processes_every_sample_once(tmp_path):
    """96 samples in batches of 4. 2 processes (12 steps an epoch) stop 3 steps into epoch 1;
    3 processes finish it (6 steps: more than the 8 - 3 their own epoch length leaves, so Lightning's
    batch counters are moved) and stop 3 steps into epoch 2; 2 processes finish that one
    (60 samples, 30 a rank: 8 steps, the last of 2 samples)."""
    run, samples = str(tmp_path / "run"), str(tmp_path / "samples")
    run_training(SCRIPT, [run, f"{samples}.a", "--stop-at", "15"])
    log_b = run_training(SCRIPT, [run, f"{samples}.b", "--devices", "3", "--resume", "--stop-at", "24"])
    log_c = run_training(SCRIPT, [run, f"{samples}.c", "--resume"])
    everything = list(range(96))
    assert samples_seen(f"{samples}.a", 2, 0) == everything
    assert sorted(samples_seen(f"{samples}.a", 2, 1) + samples_seen(f"{samples}.b", 3, 1)) == everything
    assert samples_seen(f"{samples}.b", 3, 1, (15, 21)) == samples_seen(f"{samples}.b", 3, 1)
    assert sorted(samples_seen(f"{samples}.b", 3, 2) + samples_seen(f"{samples}.c", 2, 2)) == everything
    assert len(samples_seen(f"{samples}.b", 3, 2, (21, 24))) == 36
    assert "STEP 32" in log_c and "STEP 33" not in log_c
    assert "trained on 2 processes and resumes on 3" in log_b
    assert "trained on 3 processes and resumes on 2" in log_c
