"""``bench/fast_steps.py`` at toy size, for a few steps: the script runs and reports what it says
(correctness of the bench, not speed; its figures are in docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import fast_steps

TOY = ["--size", "toy", "--grad-sets", "2"]


def bench(tmp: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp / f"out-{len(list(tmp.glob('out-*')))}.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "fast_steps.py"), *TOY, "--workdir", str(tmp),
                           "--out", str(out), *args], capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(out.read_text())


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fast-steps")


def test_configurations_are_checkpoint_options_keywords() -> None:
    assert fast_steps.parse_config("none") == ("none", None)
    assert fast_steps.parse_config("defaults") == ("defaults", {})
    name, kwargs = fast_steps.parse_config("x:compression=none,local_dir=None,write_batch=4,durability=every_step")
    assert name == "x" and kwargs == {"compression": "none", "local_dir": None, "write_batch": 4,
                                      "durability": "every_step"}
    assert fast_steps.options_problem({"compression": "none"}) is None
    assert "no_such_option" in (fast_steps.options_problem({"no_such_option": 1}) or "")
    assert "refuses" in (fast_steps.options_problem({"write_batch": 0}) or "")


@pytest.mark.slow  # subprocesses that import torch and transformers: a minute or more on 2 cores
def test_timed_runs_report_each_configuration_against_none(work: Path) -> None:
    done, data = bench(work, "--steps", "3", "--warmup", "1", "--device-ms", "5", "--config", "none",
                       "--config", "defaults", "--config", "later:no_such_option=1")
    runs = {r["config"]: r for r in data["timed"]["runs"]}
    assert set(runs) == {"none", "defaults"}
    assert "no_such_option" in data["timed"]["skipped"]["later"]
    none, ours = runs["none"], runs["defaults"]
    assert none["ratio"] == 1.0 and not none["imported_diffckpt"] and none["bytes_per_step"] == 0
    assert ours["ratio"] > 0 and ours["bytes_per_step"] > 0 and ours["rss_peak"] > 0 and ours["steps"] == 3
    assert ours["s_per_step_with_flush"] >= ours["s_per_step"]
    # the tiers at the loop's end: the journal holds at least what the run root holds
    assert 0 <= ours["durable_at_loop_end"] <= ours["local_at_loop_end"] <= ours["last"] == 4
    assert ours["local_lag_steps"] == ours["last"] - ours["local_at_loop_end"]
    assert {"stall_seconds", "write_seconds", "segment_bytes"} <= set(ours["writer"])
    assert "| 5 | defaults |" in done.stdout and "later skipped" in done.stdout


@pytest.mark.slow  # subprocesses that import torch and transformers: a minute or more on 2 cores
def test_kill_and_resume_is_bitwise_with_and_without_the_local_tier(work: Path) -> None:
    _, data = bench(work, "--kill", "--grads", str(work / "grads.pt"), "--kill-steps", "10", "--kill-at", "6",
                    "--device-ms", "50", "--config", "defaults")
    rows = {r["scenario"]: r for r in data["kill"]["rows"]}
    assert data["kill"]["reference"]["imported_diffckpt"] is False
    for row in rows.values():
        assert row["status"] == "passed" and row["bitwise"] and row["tensors"] > 20, row
        assert 0 <= row["resumed_from"] <= row["killed_at"] < 10, row
    assert rows["process crash"]["steps_lost"] <= 1  # the journal: at most the step in flight
    gone = rows["local tier gone"]  # the run root alone: at least what it held when the run last said
    assert gone["resumed_from"] >= (gone["durable_printed"] or 0)
