"""``kill -9`` of a training process at random and at chosen instants, on local disk and on the
S3 server: every trial restores the newest durable step bit-exactly (see ``crash_trials``).

CI runs the bounded set below (22 trials); ``make soak`` runs ``test_crash_soak`` (200 trials)
and prints the tally per phase at the kill.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
from crash_trials import Outcome, Trial, run_trial, tally, truth_file
from faultproxy import FaultProxy
from helpers import subprocess_env
from s3env import S3Target

# (kind, argument): what the writer was doing when the process died
CHOSEN = {
    "local": [
        ("pause-before", r"diffs/000000000024-"),  # steps captured, their segment not yet written
        ("pause-after", r"bases/000000000020\.g\d+/state"),  # a base's state written, its COMMIT not
    ],
    "s3": [
        ("pause-after", r"bases/000000000020\.g\d+/state"),
        ("proxy", r"/diffs/000000000014-", 100_000),  # mid-upload of a segment
        ("proxy", r"/bases/000000000020\.g\d+/state", 100_000),  # mid-upload of a base
        ("proxy", r"/bases/000000000030\.g\d+/COMMIT", 0),  # the COMMIT marker in flight
    ],
}


@pytest.fixture(scope="module")
def truth(tmp_path_factory: pytest.TempPathFactory) -> str:
    return truth_file(str(tmp_path_factory.mktemp("crash-truth")))


def _trial(backend: str, kill: tuple, tmp_path: Path, s3: S3Target | None, proxy: FaultProxy | None,
           via_proxy: S3Target | None, forward: bool = False) -> Trial:
    name = f"{backend}-{kill[0]}-{kill[1]}"
    if backend == "local":
        return Trial(name, str(tmp_path / "run"), subprocess_env(), kill)
    target = via_proxy if kill[0] == "proxy" else s3
    assert target is not None
    return Trial(name, target.url, {**subprocess_env(), **target.env}, kill, proxy, forward)


@pytest.mark.parametrize("seed", range(8))
def test_random_kill_local(seed: int, tmp_path: Path, truth: str) -> None:
    run_trial(_trial("local", ("random", seed), tmp_path, None, None, None), truth)


@pytest.mark.parametrize("seed", range(100, 108))
def test_random_kill_s3(seed: int, tmp_path: Path, truth: str, s3_bucket: S3Target) -> None:
    run_trial(_trial("s3", ("random", seed), tmp_path, s3_bucket, None, None), truth)


@pytest.mark.parametrize("kill", CHOSEN["local"], ids=lambda k: k[0])
def test_chosen_kill_local(kill: tuple, tmp_path: Path, truth: str) -> None:
    outcome = run_trial(_trial("local", kill, tmp_path, None, None, None), truth)
    # before the segment after step 24: 24; a base's state without its COMMIT is ignored, and step
    # 20 comes from base 10 and its segments (written before the base)
    assert outcome.restored == (24 if kill[0] == "pause-before" else 20), outcome


@pytest.mark.parametrize("kill", CHOSEN["s3"], ids=lambda k: f"{k[0]}-{k[1].split('/')[1]}")
def test_chosen_kill_s3(kill: tuple, tmp_path: Path, truth: str, s3_bucket: S3Target,
                        fault_proxy: FaultProxy, s3_via_proxy: S3Target) -> None:
    # a COMMIT whose PUT completes after its writer died is a committed base like any other
    forward = kill[1].endswith("COMMIT")
    outcome = run_trial(_trial("s3", kill, tmp_path, s3_bucket, fault_proxy, s3_via_proxy, forward), truth)
    assert outcome.restored is not None and outcome.restored >= (outcome.last_durable or 0)


@pytest.mark.slow
def test_crash_soak(tmp_path: Path, truth: str, s3_bucket: S3Target, fault_proxy: FaultProxy,
                    s3_via_proxy: S3Target, capsys: pytest.CaptureFixture[str]) -> None:
    """200 trials (``DIFFCKPT_SOAK_TRIALS``): random instants on both backends, and every chosen
    instant in turn."""
    chosen = itertools.cycle([(b, k) for b, kills in CHOSEN.items() for k in kills])
    outcomes: list[Outcome] = []
    for i in range(int(os.environ.get("DIFFCKPT_SOAK_TRIALS", "200"))):
        if i % 5 == 4:
            backend, kill = next(chosen)
        else:
            backend, kill = ("local" if i % 2 else "s3"), ("random", 1000 + i)
        fault_proxy.clear()
        run = tmp_path / f"t{i}"
        url_target = S3Target.create(s3_bucket.endpoint, s3_bucket.bucket, f"t{i}")
        via = S3Target.create(s3_via_proxy.endpoint, s3_bucket.bucket, f"t{i}")
        forward = str(kill[1]).endswith("COMMIT")
        trial = _trial(backend, kill, run, url_target, fault_proxy, via, forward)
        outcomes.append(run_trial(trial, truth))
    with capsys.disabled():
        print("\n" + tally(outcomes))
