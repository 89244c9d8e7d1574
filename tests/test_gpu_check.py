"""``make gpu-check``'s own logic (``bench/gpu_check.py``), tested on the CPU: the dry run goes
through every part with tiny sizes, as the GPU machine would at full size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check
import gpu_scale


def check(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("OUT", None)
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def parts(out: Path) -> dict[str, dict[str, Any]]:
    report = json.loads((out / "gpu-check.json").read_text())
    return {p["name"]: p for p in report["parts"]}


def make_n(*args: str) -> list[str]:
    """What ``make -n`` would run here (outside any make that runs this test)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    done = subprocess.run(["make", "--no-print-directory", "-n", *args], cwd=ROOT, capture_output=True, text=True,
                          env=env)
    return done.stdout.strip().splitlines()


def test_the_makefile_target_runs_the_dry_check_with_the_projects_python() -> None:
    assert make_n("gpu-check", "DRY=1")[-1] == ".venv/bin/python bench/gpu_check.py --dry"
    assert make_n("gpu-check") == ["python3 bench/gpu_check.py"]  # the GPU machine's own python3, no venv


@pytest.mark.slow  # 3-4 minutes on 2 cores, its parts' kill -9 checks in each front end's suite too
def test_the_dry_run_goes_through_every_part_and_reports_each(tmp_path: Path) -> None:
    done = check("--dry", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = parts(tmp_path)
    assert list(found) == gpu_check.PARTS
    assert {n: p["status"] for n, p in found.items()} == {
        "environment": "passed", "cuda-tests": "skipped", "kill-resume": "passed", "overhead": "passed",
        "restore": "passed", "kill-124m": "passed"}
    env = found["environment"]["details"]
    assert {"torch", "lightning", "accelerate", "transformers", "zstandard"} <= {r["package"] for r in env["floors"]}
    tests = found["cuda-tests"]["details"]
    assert "tests/core/test_cuda.py" in tests["files"] and tests["tests"] > tests["skipped"] > 0
    assert tests["failures"] == tests["errors"] == 0
    rows = {r["scenario"]: r for r in found["kill-resume"]["details"]["scenarios"]}
    assert rows.pop("lightning-16")["status"] == "skipped"  # fp16 with a scaler: CUDA only
    assert set(rows) == {"plain-single", "plain-foreach", "plain-fused", "lightning-bf16", "accelerate"}
    for row in rows.values():  # killed for real, resumed from an earlier durable step, every tensor equal
        assert row["status"] == "passed" and row["tensors"] > 50, row
        assert 0 < row["resumed_from"] <= row["killed_at"], row
    for name in ("plain-single", "plain-foreach", "plain-fused"):  # the plain loops say where each tier was
        assert 0 <= rows[name]["durable_at_kill"] <= rows[name]["local_at_kill"] <= rows[name]["killed_at"]
    big = found["kill-124m"]["details"]["row"]
    assert big["scenario"] == "gpt2" and big["status"] == "passed" and big["tensors"] > 50, big
    assert 0 < big["resumed_from"] <= big["killed_at"] and big["steps_lost"] <= 1, big  # the node-local tier
    overhead = found["overhead"]["details"]
    runs = overhead["runs"]
    expected = {"none", "diffckpt", "dcp-1", "dcp-10"}
    if gpu_scale.options_missing("diffckpt-every-step") is None:
        expected.add("diffckpt-every-step")
    else:  # durability="every_step" does not exist in this checkout yet: skipped, and said so
        assert "durability" in overhead["skipped"]["diffckpt-every-step"]
    assert set(runs) == expected
    assert runs["none"]["ratio"] == 1.0 and runs["diffckpt"]["bytes_per_step"] > 0 and runs["dcp-1"]["bytes_per_step"] > 0
    for name in expected & set(gpu_scale.DIFFCKPT):  # each tier's step at the loop's end, and the writer's stall
        r = runs[name]
        assert 0 <= r["durable_step"] <= r["local_step"] <= 8 and r["local_lag_steps"] == 8 - r["local_step"], r
        assert r["durable_lag_s"] >= r["local_lag_s"] >= 0 and r["writer"]["stall_seconds"] >= 0, r
    restore = found["restore"]["details"]
    assert restore["diffckpt"]["exact"] is True and restore["diffckpt"]["replayed"] == restore["limit"]["steps"]
    assert restore["diffckpt"]["base_step"] + restore["diffckpt"]["replayed"] == restore["diffckpt"]["steps"] > 0
    report = (tmp_path / "gpu-check.md").read_text()
    for name, part in found.items():
        assert f"| {name} | {part['status']} |" in report
    assert "every part passed or was skipped" in done.stdout


def test_without_cuda_it_says_so_and_exits_0(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    done = check("--out", str(tmp_path), timeout=120)
    assert done.returncode == 0 and "no CUDA device" in done.stdout
    assert not (tmp_path / "gpu-check.json").exists()


def test_a_failed_part_is_reported_and_the_command_fails(tmp_path: Path) -> None:
    done = check("--dry", "--parts", "environment,restore", "--out", str(tmp_path), timeout=120)
    assert done.returncode == 1
    found = parts(tmp_path)
    assert found["environment"]["status"] == "passed"
    assert found["restore"]["status"] == "failed" and "nothing to restore" in found["restore"]["summary"]
    assert "FAILED: restore" in done.stdout
    assert "| restore | failed |" in (tmp_path / "gpu-check.md").read_text()


def test_a_child_past_its_time_is_killed_with_its_descendants() -> None:
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
             "print('STEP 1', flush=True); time.sleep(60)"
    child = gpu_check.run_child([sys.executable, "-c", script], dict(os.environ), timeout=2)
    assert child.rc is None and "time limit" in child.log and child.seconds < 30


def test_a_state_that_differs_in_one_element_is_found(tmp_path: Path) -> None:
    state = {"model": {"w": torch.zeros(3)}, "optimizers": [{"state": {0: {"exp_avg": torch.ones(2)}}}]}
    torch.save(state, tmp_path / "a.pt")
    state["optimizers"][0]["state"][0]["exp_avg"][1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    torch.save(state, tmp_path / "b.pt")
    assert gpu_check.compare(str(tmp_path / "a.pt"), str(tmp_path / "a.pt")) == (None, 2)
    problem, _ = gpu_check.compare(str(tmp_path / "a.pt"), str(tmp_path / "b.pt"))
    assert problem is not None and "exp_avg" in problem
