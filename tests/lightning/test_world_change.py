"""A Lightning DDP epoch interrupted on one number of processes and continued on others: every
sample of the epoch is trained on exactly once, counted from what each rank logged."""

from __future__ import annotations

from collections import Counter

from helpers import run_training, samples_seen

SCRIPT = "tests/lightning/order_script.py"


def test_epoch_continues_over_another_number_of_processes_every_sample_once(tmp_path):
    """96 samples in batches of 4, loaded by 2 worker processes. 2 processes (12 steps an epoch)
    stop 7 steps into epoch 1; 3 processes finish it: the 40 left, padded to 42, are 4 steps, while
    their own epoch is 8 steps long (Lightning's batch counters are moved so that it ends with the
    share, not after one batch), then stop 3 steps into epoch 2; 2 processes finish that one
    (60 samples, 30 a rank: 8 steps, the last of 2 samples)."""
    run, samples = str(tmp_path / "run"), str(tmp_path / "samples")
    common = ["--workers", "2"]
    run_training(SCRIPT, [run, f"{samples}.a", "--stop-at", "19", *common])
    log_b = run_training(SCRIPT, [run, f"{samples}.b", "--devices", "3", "--resume", "--stop-at", "26", *common])
    log_c = run_training(SCRIPT, [run, f"{samples}.c", "--resume", *common])
    everything = list(range(96))
    assert samples_seen(f"{samples}.a", 2, 0) == everything
    epoch1 = samples_seen(f"{samples}.a", 2, 1) + samples_seen(f"{samples}.b", 3, 1)
    assert sorted(set(epoch1)) == everything and len(epoch1) == 98  # two padded
    assert sum(n - 1 for n in Counter(epoch1).values()) == 2
    assert samples_seen(f"{samples}.b", 3, 1, (19, 23)) == samples_seen(f"{samples}.b", 3, 1)
    assert sorted(samples_seen(f"{samples}.b", 3, 2) + samples_seen(f"{samples}.c", 2, 2)) == everything
    assert len(samples_seen(f"{samples}.b", 3, 2, (23, 26))) == 36
    assert "STEP 34" in log_c and "STEP 35" not in log_c
    assert "trained on 2 processes and resumes on 3" in log_b
    assert "trained on 3 processes and resumes on 2" in log_c
    assert "not continued" not in log_b + log_c
