"""``kill -9`` of a training process at random and at chosen instants, on local disk and on the
S3 server: every trial restores the newest durable step bit-exactly (see ``crash_trials``), and
with the node-local tier on (a journal folder of the trial's own) loses at most one step.

CI runs the bounded set below (16 trials); ``make soak`` adds four random kills without the
journal and runs ``test_crash_soak`` (100 trials with the journal on, ``write_batch=16``: random
instants on both backends and mid-upload through the fault proxy) and prints the tally per phase
at the kill and of the steps lost.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
from crash_trials import Outcome, Trial, run_trial, tally, truth_file
from faultproxy import FaultProxy
from helpers import subprocess_env
from s3env import S3Target

# (kind, argument): what the writer was doing when the process died
CHOSEN = {
    "s3": [
        ("pause-after", r"bases/000000000020\.g\d+/state"),
        ("proxy", r"/diffs/000000000014-", 100_000),  # mid-upload of a segment
        ("proxy", r"/bases/000000000020\.g\d+/state", 100_000),  # mid-upload of a base
        ("proxy", r"/bases/000000000030\.g\d+/COMMIT", 0),  # the COMMIT marker in flight
    ],
}
# write_batch 16 with a base every 20 steps: segments 0-16, 16-20, 20-36, 36-40, so an open
# segment holds up to 15 steps the run root does not have
BATCH16 = {"write_batch": 16, "base_every": 20}


@pytest.fixture(scope="module")
def truth(tmp_path_factory: pytest.TempPathFactory) -> str:
    return truth_file(str(tmp_path_factory.mktemp("crash-truth")))


def _trial(backend: str, kill: tuple, tmp_path: Path, s3: S3Target | None, proxy: FaultProxy | None,
           via_proxy: S3Target | None, forward: bool = False, journal: bool = True, **settings: Any) -> Trial:
    """A trial; ``journal``: the node-local tier on, in a folder of the trial's own."""
    name = f"{backend}-{kill[0]}-{kill[1]}-{'journal' if journal else 'no journal'}"
    local_dir = str(tmp_path / "local") if journal else None
    if backend == "local":
        return Trial(name, str(tmp_path / "run"), subprocess_env(), kill, local_dir=local_dir, **settings)
    target = via_proxy if kill[0] == "proxy" else s3
    assert target is not None
    return Trial(name, target.url, {**subprocess_env(), **target.env}, kill, proxy, forward, local_dir=local_dir,
                 **settings)


# Without the journal (local_dir=None): a crash loses what no segment committed yet. Two seeds
# each in `make test`, the other two in `make soak` (they paid for the local tier's corner tests).
_SOAKED = pytest.mark.slow


@pytest.mark.parametrize("seed", [0, 1, pytest.param(2, marks=_SOAKED), pytest.param(3, marks=_SOAKED)])
def test_random_kill_local(seed: int, tmp_path: Path, truth: str) -> None:
    run_trial(_trial("local", ("random", seed), tmp_path, None, None, None, journal=False), truth)


# 101-103 in make soak: 100 kills at a random point of the same run (and test_random_kill_s3_journal with the journal)
@pytest.mark.parametrize("seed", [100, pytest.param(101, marks=_SOAKED), pytest.param(102, marks=_SOAKED),
                                  pytest.param(103, marks=_SOAKED)])
def test_random_kill_s3(seed: int, tmp_path: Path, truth: str, s3_bucket: S3Target) -> None:
    run_trial(_trial("s3", ("random", seed), tmp_path, s3_bucket, None, None, journal=False), truth)


# With the journal, write_batch 16: at most one step lost (checked in run_trial).
@pytest.mark.parametrize("seed", [200, 201])
def test_random_kill_local_journal(seed: int, tmp_path: Path, truth: str) -> None:
    outcome = run_trial(_trial("local", ("random", seed), tmp_path, None, None, None, **BATCH16), truth)
    assert outcome.lost <= 1, outcome


# 301 in make soak: 300 kills at a random point of the same run with the journal on
@pytest.mark.parametrize("seed", [300, pytest.param(301, marks=_SOAKED)])
def test_random_kill_s3_journal(seed: int, tmp_path: Path, truth: str, s3_bucket: S3Target) -> None:
    outcome = run_trial(_trial("s3", ("random", seed), tmp_path, s3_bucket, None, None, **BATCH16), truth)
    assert outcome.lost <= 1, outcome


def test_kill_mid_upload_journal(tmp_path: Path, truth: str, s3_bucket: S3Target, fault_proxy: FaultProxy,
                                 s3_via_proxy: S3Target) -> None:
    """The upload of the first segment (steps 1..16) held by the proxy: training runs on into the
    journal until the writer waits for that upload, and the kill loses at most one step of it."""
    kill = ("proxy", r"/diffs/000000000000-", 100_000)
    outcome = run_trial(_trial("s3", kill, tmp_path, s3_bucket, fault_proxy, s3_via_proxy, **BATCH16), truth)
    # the upload never finished; it started once record 16 was journaled (after STEP 15)
    assert outcome.last_durable in (None, 0) and outcome.last_step >= 15, outcome
    assert outcome.lost <= 1 and outcome.restored is not None and outcome.restored >= 16, outcome


def test_chosen_kill_local_no_journal(tmp_path: Path, truth: str) -> None:
    # the segment after step 24 never written: without the journal, step 24 is the newest durable
    kill = ("pause-before", r"diffs/000000000024-")
    outcome = run_trial(_trial("local", kill, tmp_path, None, None, None, journal=False), truth)
    assert outcome.restored == 24, outcome


def test_chosen_kill_local_journal_takes_back_the_queued_segments(tmp_path: Path, truth: str) -> None:
    # The segment after step 24 never written: the writer queues segment 28-30 and base 30 behind
    # it (two waiting), journals steps 31..34 and waits at the cut of segment 30-34, so training
    # stops after step 35 (record_step(36) waits for record 35). The journals hold steps 25..34,
    # which continue the run root's step 24 without base 30; a resume commits them and restores 34.
    kill = ("pause-before", r"diffs/000000000024-", "STEP 35")
    outcome = run_trial(_trial("local", kill, tmp_path, None, None, None, durability="every_step"), truth)
    assert outcome.last_step == 35 and outcome.restored == 34, outcome


def test_chosen_kill_local_paced_keeps_every_step_behind_a_held_write(tmp_path: Path, truth: str) -> None:
    # Paced (the default): the segment after step 4 is never written, and training does not wait
    # for it. The run root falls behind, so each base supersedes the segments waiting before it
    # (parked in the local tier) and bases 10 and 20 wait behind the held write too; training
    # runs to its end and the final flush waits there. The journals hold every step after 4 (the
    # parked segments, the waiting ones, the open one), and a resume restores step 40, or 39 when
    # the kill, which follows "STEP 40" at once, came before record 40 was journaled.
    kill = ("pause-before", r"diffs/000000000004-", "STEP 40")
    outcome = run_trial(_trial("local", kill, tmp_path, None, None, None), truth)
    assert outcome.last_step == 40 and (outcome.last_durable or 0) <= 4 and outcome.restored >= 39, outcome


def test_chosen_kill_local_base_state_without_commit(tmp_path: Path, truth: str) -> None:
    # a base's state written, its COMMIT not: the base is ignored. The segments after it wait
    # (20-24 and 24-28: two) and the writer waits at the cut of 28-30 before base 30, so training
    # stops after step 31; a resume takes back steps 21..30 from the journals, replayed from base
    # 10 through the segments written before base 20.
    kill = ("pause-after", r"bases/000000000020\.g\d+/state", "STEP 31")
    outcome = run_trial(_trial("local", kill, tmp_path, None, None, None, durability="every_step"), truth)
    assert outcome.last_step == 31 and outcome.restored == 30, outcome


@pytest.mark.parametrize("kill", CHOSEN["s3"], ids=lambda k: f"{k[0]}-{k[1].split('/')[1]}")
def test_chosen_kill_s3(kill: tuple, tmp_path: Path, truth: str, s3_bucket: S3Target,
                        fault_proxy: FaultProxy, s3_via_proxy: S3Target) -> None:
    # a COMMIT whose PUT completes after its writer died is a committed base like any other
    forward = kill[1].endswith("COMMIT")
    outcome = run_trial(_trial("s3", kill, tmp_path, s3_bucket, fault_proxy, s3_via_proxy, forward,
                               durability="every_step"), truth)
    assert outcome.restored is not None and outcome.restored >= (outcome.last_durable or 0)
    assert outcome.lost <= 1, outcome


@pytest.mark.slow
def test_crash_soak(tmp_path: Path, truth: str, s3_bucket: S3Target, fault_proxy: FaultProxy,
                    s3_via_proxy: S3Target, capsys: pytest.CaptureFixture[str]) -> None:
    """100 trials (``DIFFCKPT_SOAK_TRIALS``) with the journal on and ``write_batch=16``: random
    instants (mid-append, mid-commit, between steps) on local disk and on S3, and every fifth a
    segment's upload held by the proxy after a random number of bytes. Each loses at most one
    step and resumes bitwise."""
    rng = random.Random(29)
    outcomes: list[Outcome] = []
    for i in range(int(os.environ.get("DIFFCKPT_SOAK_TRIALS", "100"))):
        fault_proxy.clear()
        run = tmp_path / f"t{i}"
        url_target = S3Target.create(s3_bucket.endpoint, s3_bucket.bucket, f"t{i}")
        via = S3Target.create(s3_via_proxy.endpoint, s3_bucket.bucket, f"t{i}")
        if i % 5 == 4:
            segment = rng.choice([0, 16, 20])
            backend, kill = "s3", ("proxy", rf"/t{i}/diffs/{segment:012d}-", rng.randint(0, 200_000))
        else:
            backend, kill = ("local" if i % 2 else "s3"), ("random", 1000 + i)
        trial = _trial(backend, kill, run, url_target, fault_proxy, via, **BATCH16)
        outcome = run_trial(trial, truth)
        assert outcome.lost <= 1, outcome
        outcomes.append(outcome)
    with capsys.disabled():
        print("\n" + tally(outcomes))
