"""``make gpu-check``: what works on CUDA and what does not, in one command of at most 8 minutes.

Made for a GPU machine lent now and then, with no network and the machine's own ``python3``
(docs/gpu.md). It puts this checkout on the path without a build, installs what the machine lacks
from the wheels ``make gpu-wheels`` fetched (``.gpu-wheels/``, carried along) into ``.gpu-site/``,
then runs six parts, each even if an earlier one failed, each bounded in time:

1. ``environment``: the device, the packages, and each declared version range of pyproject.toml
   against what is installed;
2. ``cuda-tests``: the test modules that hold tests marked ``cuda`` (skipped everywhere else),
   among them training recorded every step under ``torch.cuda.set_sync_debug_mode``;
3. ``kill-resume``: training killed with SIGKILL and resumed, compared with ``torch.equal`` on
   every tensor against a run that never imported diffckpt (``bench/gpu_runs.py``): a plain loop
   over ``CheckpointEngine`` with AdamW's default, foreach and fused implementations, Lightning
   with ``bf16-mixed`` and ``16-mixed``, Accelerate;
4. ``overhead``: a diff every step on GPT-2 124M shapes with bf16 autocast and a batch that keeps
   the device busy about 100 ms a step, with the default options and with
   ``durability="every_step"`` (skipped, with a note, where the options have no ``durability``),
   against no checkpointing and DCP ``async_save`` every step and every 10 steps, in one run
   (``bench/gpu_scale.py``); for diffckpt, the durable and node-local steps when the loop ended
   and the writer's stall seconds;
5. ``restore``: the newest step of that run restored on the device, checked bitwise, against
   ``torch.load`` of the full state plus one bare optimizer step per replayed step;
6. ``kill-124m``: the kill -9 and resume of part 3 at GPT-2 124M (``gpu_runs.py``'s ``gpt2``).

It writes ``gpu-check.md`` and ``gpu-check.json`` to ``--out`` (default ``$OUT`` when set, else
``bench/results/gpu-check/``), prints a one-screen summary and exits 1 if a part failed. Without
CUDA it says so and exits 0; ``--dry`` (``make gpu-check DRY=1``) runs every part on the CPU
with tiny sizes, so that ``make test`` tests the check's own logic.

    python3 bench/gpu_check.py [--dry] [--out DIR] [--budget 480] [--parts kill-resume,restore]
    python bench/gpu_check.py --fetch-wheels  # here, with network: what `make gpu-wheels` runs
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
WHEELS = os.path.join(ROOT, ".gpu-wheels")
SITE = os.path.join(ROOT, ".gpu-site")
MISSING_THERE = ["zstandard", "torchdata"]  # what the GPU machine's python3 lacks (docs/gpu.md)
NEEDED = {  # import name -> distribution, for everything the parts import
    "torch": "torch", "numpy": "numpy", "fsspec": "fsspec", "zstandard": "zstandard", "safetensors": "safetensors",
    "xxhash": "xxhash", "tqdm": "tqdm", "lightning": "lightning", "torchdata": "torchdata",
    "accelerate": "accelerate", "transformers": "transformers", "pytest": "pytest",
}
PARTS = ["environment", "cuda-tests", "kill-resume", "overhead", "restore", "kill-124m"]
# What each part may count on, of 480 s: a part may use what earlier parts left, never what the
# parts after it are counting on (budget()). The last run on an H100 took 0, 18, 42, 159 and
# 41 s for the first five (before diffckpt-every-step and kill-124m).
ALLOTTED = {"environment": 10, "cuda-tests": 40, "kill-resume": 60, "overhead": 200, "restore": 60,
            "kill-124m": 110}
# How the overhead part's time is shared: diffckpt's run writes its starting base, flushes at the
# end and saves the trained state for the restore part (1.5 GB at 124M), so it needs the most.
OVERHEAD_SHARES = {"none": 1.0, "diffckpt": 1.3, "diffckpt-every-step": 1.0, "dcp-10": 0.8, "dcp-1": 1.0}
# The kill-124m part: GPT-2 124M killed at step KILL_124M[1] of KILL_124M[0] (dry run: tiny, 12 and 9).
KILL_124M = (20, 13)


@dataclass
class Part:
    name: str
    status: str = "not run"  # passed | failed | skipped | not run
    summary: str = ""
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Settings:
    device: str
    dry: bool
    workdir: str
    deadline: float  # time.monotonic() by which everything must end
    env: dict[str, str]
    plan: list[str] = field(default_factory=list)  # the parts to run, in order
    configs: list[str] = field(default_factory=list)  # the overhead part's configurations

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def budget(self, name: str) -> float:
        """Seconds part ``name`` may take: what is left, less what the parts after it count on."""
        later = self.plan[self.plan.index(name) + 1:] if name in self.plan else []
        return max(1.0, self.left() - sum(ALLOTTED[p] for p in later))


# ------------------------------------------------------------------------------ child processes
@dataclass
class Child:
    rc: int | None  # None: stopped at its time limit
    log: str
    seconds: float

    def tail(self, n: int = 1500) -> str:
        return self.log[-n:].strip()

    def lines(self, prefix: str) -> list[str]:
        return [line[len(prefix):].strip() for line in self.log.splitlines() if line.startswith(prefix)]


def run_child(cmd: list[str], env: dict[str, str], timeout: float, kill_at_step: int | None = None) -> Child:
    """Run ``cmd`` in a session of its own; SIGKILL it and every descendant once it prints
    ``STEP <n>`` with ``n >= kill_at_step``, or when ``timeout`` seconds have passed."""
    from helpers import kill_tree, read_output

    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, cwd=ROOT)
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        try:
            kill_tree(proc.pid)
        except ProcessLookupError:  # it ended just now
            pass

    timer = threading.Timer(max(timeout, 1.0), expire)
    timer.start()
    try:
        lines = read_output(proc, kill_at_step, drain=True)
        rc: int | None = proc.wait()
    finally:
        timer.cancel()
    seconds = time.monotonic() - start
    if expired.is_set():
        rc, lines = None, [*lines, f"\n[gpu-check: stopped at its time limit of {timeout:.0f} s]\n"]
    return Child(rc, "".join(lines), seconds)


def python(script: str, *args: str) -> list[str]:
    return [sys.executable, os.path.join(ROOT, "bench", script), *args]


# ------------------------------------------------------------------------------ 1. environment
def floors() -> list[dict[str, Any]]:
    """Each requirement pyproject.toml declares (core and framework extras) against what is installed."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: the table is left out, the check goes on
        return []
    from packaging.requirements import Requirement

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    declared = list(project["dependencies"])
    for extra in ("lightning", "accelerate", "transformers"):
        declared += project["optional-dependencies"][extra]
    rows, seen = [], set()
    for text in declared:
        req = Requirement(text)
        if req.name in seen:
            continue
        seen.add(req.name)
        try:
            installed: str | None = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        ok = installed is not None and req.specifier.contains(installed, prereleases=True)
        rows.append({"package": req.name, "declared": str(req.specifier), "installed": installed, "within": ok})
    return rows


def environment(s: Settings, part: Part) -> None:
    import torch

    d = part.details
    d["python"] = platform.python_version()
    d["torch"] = torch.__version__
    d["cuda"] = torch.version.cuda
    d["cpus"] = os.cpu_count()
    # nvidia-smi, not torch: this process creates no CUDA context (in exclusive-process compute
    # mode one would lock every training child out of the device).
    d["device"] = gpu_description() if s.device == "cuda" else "cpu (dry run)"
    d["disk_free"] = shutil.disk_usage(s.workdir).free
    d["floors"] = floors()
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    d["missing"] = missing
    outside = [f"{r['package']} {r['installed'] or 'missing'} (declared {r['declared']})"
               for r in d["floors"] if not r["within"]]
    part.summary = (f"{d['device']}; torch {d['torch']}, CUDA {d['cuda']}, Python {d['python']}; "
                    f"{size(d['disk_free'])} free for the runs")
    if outside:
        part.summary += "; outside the declared ranges: " + ", ".join(outside)
    if missing:
        part.status = "failed"
        part.summary += (f"; missing: {', '.join(missing)} (run `make gpu-wheels` where there is network and "
                         "carry .gpu-wheels)")
    else:
        part.status = "passed"


def gpu_description() -> str:
    """Name, memory, driver and compute mode of the first GPU, as nvidia-smi reports them."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,compute_mode",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        name, memory, driver, mode = (f.strip() for f in out.stdout.splitlines()[0].split(","))
        return f"{name}, {memory}, driver {driver}, compute mode {mode}"
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return "a CUDA device (nvidia-smi did not answer)"


# ------------------------------------------------------------------------------- 2. CUDA tests
def cuda_test_files() -> list[str]:
    """The test modules that hold tests marked ``cuda`` (only those are collected: the others
    import packages the GPU machine may lack, such as s3fs and moto)."""
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "tests")):
        for name in sorted(files):
            if name.startswith("test_") and name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    if "pytest.mark.cuda" in f.read():
                        found.append(os.path.relpath(path, ROOT))
    return sorted(found)


def cuda_tests(s: Settings, part: Part) -> None:
    files = cuda_test_files()
    xml = os.path.join(s.workdir, "cuda-tests.xml")
    # Every test of those modules: the CPU ones too, since the machine's Python is not CI's (3.12:
    # leases depend on reference counts).
    child = run_child([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rs",
                       "-o", "faulthandler_timeout=60",
                       f"--junitxml={xml}", *files], s.env, s.budget(part.name))
    d = part.details
    d["files"] = files
    if not os.path.exists(xml):
        part.status, part.summary = "failed", f"pytest did not finish (exit {child.rc}): {child.tail(600)}"
        return
    suites = ET.parse(xml).getroot()
    suite = suites if suites.tag == "testsuite" else suites[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    d.update(counts)
    d["failed_tests"] = [f"{c.get('classname')}::{c.get('name')}: {(c[0].get('message') or '')[:300]}"
                         for c in suite.iter("testcase") if len(c) and c[0].tag in ("failure", "error")]
    ran = counts["tests"] - counts["skipped"]
    text = f"{ran - counts['failures'] - counts['errors']} passed, {counts['failures'] + counts['errors']} failed, " \
           f"{counts['skipped']} skipped of {counts['tests']} in {len(files)} files"
    if counts["failures"] or counts["errors"] or child.rc not in (0, 5):
        part.status = "failed"
    elif s.device != "cuda":
        part.status, text = "skipped", text + " (no CUDA device: the tests marked cuda skip themselves)"
    elif counts["skipped"] or ran == 0:
        part.status, text = "failed", text + ": every one of them should run on a CUDA device"
    else:
        part.status = "passed"
    part.summary = text


# ------------------------------------------------------------------------------ 3. kill / resume
def kill_and_resume(s: Settings, name: str, steps: int, kill_at: int, timeout: float,
                    extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Scenario ``name`` of ``gpu_runs.py``: a reference run that never imports diffckpt beside a
    run killed with SIGKILL at step ``kill_at`` of ``steps``, that run resumed, and the two final
    states compared; on a difference, a second plain run says whether training is deterministic."""
    folder = os.path.join(s.workdir, name)
    os.makedirs(folder, exist_ok=True)
    args = [name, "--device", s.device, "--steps", str(steps), *extra]
    run_dir = os.path.join(folder, "run")
    out = {n: os.path.join(folder, f"{n}.pt") for n in ("reference", "killed", "resumed", "control")}
    left = lambda: max(1.0, timeout - (time.monotonic() - t0))  # noqa: E731
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(2) as pool:  # the reference and the run to kill are independent
            ref = pool.submit(run_child, python("gpu_runs.py", *args, "--out", out["reference"]), s.env, left())
            killed = run_child(python("gpu_runs.py", *args, "--out", out["killed"], "--run-dir", run_dir),
                               s.env, left(), kill_at_step=kill_at)
            reference = ref.result()
        row: dict[str, Any] = {"scenario": name}
        if reference.rc != 0:
            return {**row, "status": "failed", "note": f"the reference run failed: {reference.tail()}"}
        if killed.rc != -9:
            return {**row, "status": "failed", "note": f"the run to kill ended with {killed.rc}: {killed.tail()}"}
        last = max((n.split() for n in killed.lines("STEP ")), key=lambda f: int(f[0]))
        row["killed_at"] = int(last[0])
        if len(last) >= 5:  # the plain loops say how far each tier got: "<n> durable <d> local <l>"
            row["durable_at_kill"], row["local_at_kill"] = int(last[2]), int(last[4])
        resumed = run_child(python("gpu_runs.py", *args, "--out", out["resumed"], "--run-dir", run_dir, "--resume"),
                            s.env, left())
        if resumed.rc != 0:
            return {**row, "status": "failed", "note": f"the resumed run failed: {resumed.tail()}"}
        starts = resumed.lines("START ")
        row["resumed_from"] = int(starts[0]) if starts else None
        if row["resumed_from"] is None or row["killed_at"] >= steps:
            return {**row, "status": "failed", "note": "the kill came too late or the resume printed no START "
                    f"line: nothing was tested ({resumed.tail(300)})"}
        row["steps_lost"] = row["killed_at"] - row["resumed_from"]
        problem, row["tensors"] = compare(out["reference"], out["resumed"])
        if problem is None:
            return {**row, "status": "passed", "note": "bitwise equal"}
        control = run_child(python("gpu_runs.py", *args, "--out", out["control"]), s.env, left())
        same, _ = compare(out["reference"], out["control"]) if control.rc == 0 else ("control failed", 0)
        why = ("; two plain runs agree, so diffckpt's resume differs" if same is None else
               f"; two plain runs differ too ({same}): training is not deterministic here")
        return {**row, "status": "failed", "note": problem + why}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)  # at 124M a run root holds gigabytes


def kill_resume(s: Settings, part: Part) -> None:
    from gpu_runs import CUDA_ONLY, SCENARIOS

    steps = 12 if s.dry else 40
    kill_at = steps // 2 + 3
    timeout = s.budget(part.name)
    part.details["steps"], part.details["kill_at"] = steps, kill_at
    todo = [sc for sc in SCENARIOS if s.device == "cuda" or sc not in CUDA_ONLY]

    # A GPU machine has the cores: every scenario at once (2 processes each, about 0.5 GB of device
    # memory apiece), unless the device takes one process at a time. Here: 2 processes at a time.
    exclusive = s.device == "cuda" and "Exclusive" in gpu_description()  # nvidia-smi's compute mode
    workers = len(todo) if s.device == "cuda" and not exclusive else 1
    part.details["parallel"] = workers
    with ThreadPoolExecutor(workers) as pool:
        rows = list(pool.map(guarded(lambda name: kill_and_resume(s, name, steps, kill_at, timeout)), todo))
    rows += [{"scenario": sc, "status": "skipped", "note": CUDA_ONLY[sc]} for sc in SCENARIOS if sc not in todo]
    part.details["scenarios"] = rows
    failed = [r["scenario"] for r in rows if r["status"] == "failed"]
    passed = [r for r in rows if r["status"] == "passed"]
    part.status = "failed" if failed or not passed else "passed"
    lost = [r["steps_lost"] for r in passed if "steps_lost" in r]
    part.summary = (f"{len(passed)} of {len(rows)} scenarios bitwise equal after kill -9 at step {kill_at}"
                    + (f" (steps lost: {min(lost)}-{max(lost)})" if lost else "")
                    + (f"; failed: {', '.join(failed)}" if failed else ""))


def kill_124m(s: Settings, part: Part) -> None:
    """``gpu_runs.py``'s ``gpt2`` scenario at GPT-2 124M (tiny in the dry run): the kill -9 and
    resume of the kill-resume part, at the size the overhead part measures."""
    steps, kill_at = (12, 9) if s.dry else KILL_124M
    size = "tiny" if s.dry else "124m"
    row = guarded(lambda name: kill_and_resume(s, name, steps, kill_at, s.budget(part.name),
                                               ("--size", size)))("gpt2")
    part.details.update(row=row, steps=steps, kill_at=kill_at, size=size)
    part.status = "passed" if row["status"] == "passed" else "failed"
    tiers = (f" (durable step {row['durable_at_kill']}, node-local step {row['local_at_kill']} when killed)"
             if "local_at_kill" in row else "")
    part.summary = (f"GPT-2 {size} killed at step {row.get('killed_at', '?')} of {steps}{tiers}, resumed from "
                    f"{row.get('resumed_from', '?')} ({row.get('steps_lost', '?')} steps lost): "
                    + ("bitwise equal" if part.status == "passed" else str(row.get("note", ""))[:600]))


def guarded(fn: Callable[[str], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
    """``fn`` whose exception becomes a failed row, so that the other scenarios still report."""
    def call(name: str) -> dict[str, Any]:
        try:
            return fn(name)
        except Exception as exc:
            return {"scenario": name, "status": "failed", "note": f"{type(exc).__name__}: {exc}"}
    return call


def compare(a: str, b: str) -> tuple[str | None, int]:
    """``(None, tensors compared)`` when the two saved states are bitwise equal, else what differs."""
    import torch
    from helpers import assert_bitwise_equal, count_tensors

    left = torch.load(a, map_location="cpu", weights_only=False)
    right = torch.load(b, map_location="cpu", weights_only=False)
    try:
        assert_bitwise_equal(left, right)
    except AssertionError as exc:
        return str(exc)[:400], count_tensors(left)
    return None, count_tensors(left)


# ---------------------------------------------------------------------------- 4-5. at GPT-2 size
def scale_args(s: Settings) -> list[str]:
    if s.dry:
        return ["--device", "cpu", "--size", "tiny", "--warmup", "2", "--steps", "6"]
    # A configuration that cannot keep up (DCP every step writes 1.5 GB a step at this size) stops
    # timing after 20 s, so that the part keeps to its time.
    return ["--device", "cuda", "--size", "124m", "--warmup", "5", "--steps", "20", "--max-seconds", "20"]


def result_of(child: Child, what: str) -> dict[str, Any]:
    found = child.lines("RESULT ")
    if child.rc != 0 or not found:
        raise RuntimeError(f"{what} failed (exit {child.rc}): {child.tail(800)}")
    return json.loads(found[-1])


def overhead(s: Settings, part: Part) -> None:
    from gpu_scale import CONFIGS, options_missing

    end = time.monotonic() + s.budget(part.name)
    runs: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    # a configuration of options this checkout lacks (durability="every_step" before it lands)
    skipped = {c: why for c in CONFIGS if (why := options_missing(c))}
    skipped.update({c: "left out by --configs" for c in CONFIGS if c not in s.configs and c not in skipped})
    configs = [c for c in CONFIGS if c not in skipped]
    batch = "4" if s.dry else "auto"
    for i, config in enumerate(configs):  # "none" first: it picks the batch the others use
        # a slow one cannot starve the next: each takes its share of what is left
        share = (end - time.monotonic()) * OVERHEAD_SHARES[config] / sum(OVERHEAD_SHARES[c] for c in configs[i:])
        child = run_child(python("gpu_scale.py", "train", config, "--workdir", s.workdir, "--batch", batch,
                                 *scale_args(s)), s.env, max(1.0, share))
        try:
            runs[config] = result_of(child, config)
            batch = str(runs[config]["batch"])
        except RuntimeError as exc:
            errors[config] = str(exc)
        if config != "diffckpt":  # its run root stays for the restore part
            shutil.rmtree(os.path.join(s.workdir, config), ignore_errors=True)
    base = runs.get("none")
    for r in runs.values():
        if base:
            r["ratio"] = r["s_per_step"] / base["s_per_step"]
            r["ratio_with_flush"] = (r["total_s"] / r["steps"]) / (base["total_s"] / base["steps"])
            if r["device_peak"] is not None:
                r["device_held"] = max(0, r["device_peak"] - base["device_peak"])  # peaks vary a little
    part.details.update(runs=runs, errors=errors, batch=batch, skipped=skipped)
    part.status = "failed" if errors or not base else "passed"
    if base:
        part.summary = f"{base['params'] / 1e6:.1f}M parameters, batch {base['batch']}, " \
                       f"{base['s_per_step'] * 1000:.0f} ms/step without checkpointing; " + ", ".join(
                           f"{c} {r['ratio']:.2f}x" + (f" (stall {r['writer']['stall_seconds']:.1f} s)"
                                                       if "stall_seconds" in r.get("writer", {}) else "")
                           for c, r in runs.items() if c != "none")
    if errors:
        part.summary += ("; " if part.summary else "") + "failed: " + ", ".join(errors)
    if skipped:
        part.summary += ("; " if part.summary else "") + "skipped: " + ", ".join(skipped)


def restore(s: Settings, part: Part) -> None:
    if not os.path.exists(os.path.join(s.workdir, "final.pt")):
        part.status, part.summary = "failed", "nothing to restore: the overhead part's diffckpt run did not finish"
        return
    end = time.monotonic() + s.budget(part.name)
    ours = result_of(run_child(python("gpu_scale.py", "restore", "diffckpt", "--workdir", s.workdir, *scale_args(s)),
                               s.env, max(1.0, end - time.monotonic())), "restore")
    limit = result_of(run_child(python("gpu_scale.py", "restore", "limit", "--workdir", s.workdir,
                                       "--steps-replayed", str(ours["replayed"]), "--base-step",
                                       str(ours["base_step"]), *scale_args(s)),
                                s.env, max(1.0, end - time.monotonic())), "limit")
    shutil.rmtree(os.path.join(s.workdir, "diffckpt"), ignore_errors=True)  # gigabytes at 124M
    ratio = ours["seconds"] / limit["seconds"]
    part.details.update(diffckpt=ours, limit=limit, ratio=ratio)
    part.status = "passed" if ours["exact"] else "failed"
    part.summary = (f"step {ours['steps']} restored in {ours['seconds']:.2f} s (base {ours['base_step']} and "
                    f"{ours['replayed']} steps replayed), {ratio:.2f}x a full load plus {ours['replayed']} bare "
                    f"steps ({limit['seconds']:.2f} s); "
                    + ("bitwise equal to the trained state" if ours["exact"] else "NOT equal to the trained state"))


# ------------------------------------------------------------------------------------- the run
RUNNERS: dict[str, Callable[[Settings, Part], None]] = {
    "environment": environment, "cuda-tests": cuda_tests, "kill-resume": kill_resume,
    "overhead": overhead, "restore": restore, "kill-124m": kill_124m,
}


def run_part(s: Settings, part: Part) -> None:
    start = time.monotonic()
    if s.left() < 5:
        part.status, part.summary = "failed", "not started: the time budget was spent"
        return
    try:
        RUNNERS[part.name](s, part)
    except Exception as exc:
        part.status, part.summary = "failed", f"{type(exc).__name__}: {str(exc)[:800]}"
    finally:
        part.seconds = time.monotonic() - start


def install_wheels(wheels: str) -> str | None:
    """Install the wheels of modules this Python lacks into ``SITE``; returns what it did."""
    missing = [name for name in MISSING_THERE if importlib.util.find_spec(name) is None]
    files = [os.path.join(wheels, f) for f in sorted(os.listdir(wheels))] if os.path.isdir(wheels) else []
    files = [f for f in files if f.endswith(".whl") and any(
        os.path.basename(f).lower().startswith(m.lower() + "-") for m in missing)]
    if not missing or not files:
        return None
    names = ", ".join(os.path.basename(f) for f in files)
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", SITE, *files], check=True)
    except (OSError, subprocess.CalledProcessError) as exc:  # no pip there: a wheel is a zip to unpack
        import zipfile

        for f in files:
            with zipfile.ZipFile(f) as wheel:
                wheel.extractall(SITE)
        return f"unpacked from wheels (pip failed: {exc}): {names}"
    return "installed from wheels: " + names


def fetch_wheels(dest: str) -> int:
    """Download, for the GPU machine's Python 3.12 on x86-64, the wheels of ``MISSING_THERE`` at
    the versions installed here."""
    os.makedirs(dest, exist_ok=True)
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in MISSING_THERE]
    platforms = [a for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
                 for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", *platforms, "-d", dest, *pins]
    print(" ".join(cmd[2:]))
    return subprocess.run(cmd).returncode


def size(n: float | None) -> str:
    from diffckpt.units import format_bytes

    return "—" if n is None else format_bytes(n)


def report(parts: list[Part], info: dict[str, Any]) -> str:
    lines = [f"# diffckpt GPU check{' (dry run on the CPU)' if info['dry'] else ''}", "",
             f"{info['date']}, commit {info['commit']}, {info['seconds']:.0f} s in all"
             + (f"; {info['setup']}" if info["setup"] else "") + ".", "",
             "| part | outcome | seconds | what it found |", "|---|---|---:|---|"]
    lines += [f"| {p.name} | {p.status} | {p.seconds:.0f} | {p.summary.replace('|', '/')} |" for p in parts]
    by = {p.name: p for p in parts}
    env = by.get("environment")
    if env and env.details.get("floors"):
        lines += ["", "## Environment", "", f"{env.summary}.", "",
                  "| package | declared | installed | within |", "|---|---|---|---|"]
        lines += [f"| {r['package']} | `{r['declared']}` | {r['installed'] or 'missing'} | {'yes' if r['within'] else '**no**'} |"
                  for r in env.details["floors"]]
    tests = by.get("cuda-tests")
    if tests and tests.details:
        lines += ["", "## CUDA tests", "", tests.summary + ".", ""]
        lines += [f"- failed: `{t}`" for t in tests.details.get("failed_tests", [])]
    kr = by.get("kill-resume")
    if kr and kr.details.get("scenarios"):
        lines += ["", "## kill -9 and resume", "", f"{kr.details['steps']} steps, SIGKILL at step "
                  f"{kr.details['kill_at']}, every tensor compared with `torch.equal` against a run without diffckpt.", "",
                  "| scenario | outcome | killed at | durable / node-local step then | resumed from | steps lost | "
                  "tensors | note |", "|---|---|---:|---|---:|---:|---:|---|"]
        lines += [f"| {r['scenario']} | {r['status']} | {r.get('killed_at', '—')} | "
                  f"{r.get('durable_at_kill', '—')} / {r.get('local_at_kill', '—')} | {r.get('resumed_from', '—')} | "
                  f"{r.get('steps_lost', '—')} | {r.get('tensors', '—')} | {str(r.get('note', '')).replace('|', '/')[:300]} |"
                  for r in kr.details["scenarios"]]
    ov = by.get("overhead")
    if ov and ov.details.get("runs"):
        lines += ["", "## Overhead of a diff every step", "",
                  "| configuration | s/step | ratio | ratio with final flush | device peak | device held vs none | "
                  "peak RSS | bytes/step | not durable at loop end |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for c, r in ov.details["runs"].items():
            lines.append(f"| {c} | {r['s_per_step']:.4f} | {r.get('ratio', 0):.3f} | {r.get('ratio_with_flush', 0):.3f} | "
                         f"{size(r['device_peak'])} | {size(r.get('device_held'))} | {size(r['rss_peak'])} | "
                         f"{size(r['bytes_per_step'])} | {r['not_durable_at_loop_end'] if r['not_durable_at_loop_end'] is not None else '—'} |")
        lines += [f"- {c} failed: {e[:400]}" for c, e in ov.details.get("errors", {}).items()]
        lines += [f"- {c} skipped: {why}" for c, why in ov.details.get("skipped", {}).items()]
        tiers = {c: r for c, r in ov.details["runs"].items() if "durable_lag_steps" in r}
        if tiers:
            lines += ["", "The tiers when the loop ended (lag behind the last step, in steps and in seconds since "
                      "that step was committed) and the writer (`WriterStats`; stall: training waiting for it):", "",
                      "| configuration | durable step | lag steps | lag s | node-local step | lag steps | lag s | "
                      "stall s | write s | segments | bases |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for c, r in tiers.items():
                w = r.get("writer", {})
                lines.append(f"| {c} | {dash(r['durable_step'])} | {dash(r['durable_lag_steps'])} | "
                             f"{dash(r['durable_lag_s'], '.2f')} | {dash(r['local_step'])} | {dash(r['local_lag_steps'])} | "
                             f"{dash(r['local_lag_s'], '.2f')} | {dash(w.get('stall_seconds'), '.2f')} | "
                             f"{dash(w.get('write_seconds'), '.2f')} | {size(w.get('segment_bytes'))} | "
                             f"{size(w.get('base_bytes'))} |")
            lines += ["", "Where a record's time went on the writer thread (ms a record: staging to the host, waiting "
                      "for the device's step included; appending to its spool with hashing), the timed steps' times "
                      "(median and slowest) and the CPU each thread used a step:", "",
                      "| configuration | stage ms | append ms | step ms median | slowest | CPU ms a step by thread |",
                      "|---|---:|---:|---:|---:|---|"]
            for c, r in ov.details["runs"].items():
                w, steps = r.get("writer", {}), sorted(r.get("step_ms") or [0.0])
                per = max(1, w.get("appended") or w.get("records", 0))  # records a spool took (committed: fewer when paced)
                lines.append(f"| {c} | {dash(w.get('stage_seconds', None) and 1000 * w['stage_seconds'] / per, '.0f')} | "
                             f"{dash(w.get('append_seconds', None) and 1000 * w['append_seconds'] / per, '.0f')} | "
                             f"{steps[len(steps) // 2]:.0f} | {steps[-1]:.0f} | "
                             + ", ".join(f"{k} {v:g}" for k, v in sorted(r.get("cpu_ms_per_step", {}).items())) + " |")
    rs = by.get("restore")
    if rs and rs.details.get("diffckpt"):
        lines += ["", "## Restore", "", "| | seconds | steps | peak RSS | device peak | exact |", "|---|---:|---:|---:|---:|---|"]
        for name in ("diffckpt", "limit"):
            r = rs.details[name]
            lines.append(f"| {name} | {r['seconds']:.3f} | {r['steps']} | {size(r['rss_peak'])} | {size(r['device_peak'])} | "
                         f"{'—' if r['exact'] is None else r['exact']} |")
    big = by.get("kill-124m")
    if big and big.details.get("row"):
        r = big.details["row"]
        lines += ["", "## kill -9 and resume at GPT-2 124M", "", f"{big.summary}.", "",
                  "| scenario | outcome | killed at | durable / node-local step then | resumed from | steps lost | "
                  "tensors |", "|---|---|---:|---|---:|---:|---:|",
                  f"| {r['scenario']} ({big.details['size']}) | {r['status']} | {r.get('killed_at', '—')} | "
                  f"{r.get('durable_at_kill', '—')} / {r.get('local_at_kill', '—')} | {r.get('resumed_from', '—')} | "
                  f"{r.get('steps_lost', '—')} | {r.get('tensors', '—')} |"]
    return "\n".join(lines) + "\n"


def dash(x: Any, spec: str = "") -> str:
    return "—" if x is None else format(x, spec)


def write_report(out: str, parts: list[Part], info: dict[str, Any]) -> None:
    with open(os.path.join(out, "gpu-check.md"), "w") as f:
        f.write(report(parts, info))
    with open(os.path.join(out, "gpu-check.json"), "w") as f:
        json.dump({**info, "parts": [asdict(p) for p in parts]}, f, indent=1, default=str)


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", help="every part on the CPU with tiny sizes (tests the check)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "bench", "results", "gpu-check"))
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for all parts (default 480)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"a comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--configs", default=None, help="the overhead part's configurations, comma-separated (default: "
                    "all; 'none' is the baseline and always runs)")
    ap.add_argument("--workdir", help="where the runs write (default: a temporary folder, removed)")
    ap.add_argument("--wheels", default=WHEELS, help="wheels to install what this Python lacks")
    ap.add_argument("--fetch-wheels", action="store_true", help="download those wheels (needs network) and stop")
    args = ap.parse_args()
    if args.fetch_wheels:
        return fetch_wheels(args.wheels)
    began = time.monotonic()
    installed = install_wheels(args.wheels)
    if installed:
        sys.path.insert(0, SITE)
    import torch

    if not args.dry and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here, nothing to check on a GPU. `make gpu-check DRY=1` runs the "
              "check's own logic on the CPU with tiny sizes.")
        return 0
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        ap.error(f"unknown parts: {', '.join(sorted(unknown))}")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([p for p in (ROOT, os.path.join(ROOT, "tests"), SITE if installed else "",
                                                       os.environ.get("PYTHONPATH", "")) if p]))
    workdir = args.workdir or tempfile.mkdtemp(prefix="diffckpt-gpu-check-")
    os.makedirs(workdir, exist_ok=True)
    parts = [Part(name) for name in PARTS if name in args.parts.split(",")]
    from gpu_scale import CONFIGS

    configs = CONFIGS if args.configs is None else ["none", *(c for c in args.configs.split(",") if c != "none")]
    if set(configs) - set(CONFIGS):
        ap.error(f"unknown configurations: {', '.join(sorted(set(configs) - set(CONFIGS)))}")
    s = Settings("cpu" if args.dry else "cuda", args.dry, workdir, began + args.budget, env, [p.name for p in parts],
                 list(configs))
    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit(), "dry": args.dry,
            "seconds": 0.0, "setup": installed}
    os.makedirs(args.out, exist_ok=True)
    try:
        for part in parts:
            print(f"gpu-check: {part.name} ...", flush=True)
            run_part(s, part)
            print(f"gpu-check: {part.name}: {part.status} ({part.seconds:.0f} s) {part.summary}", flush=True)
            info["seconds"] = time.monotonic() - began
            write_report(args.out, parts, info)  # after each part: a run cut short keeps what it found
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    failed = [p.name for p in parts if p.status == "failed"]
    print("\n" + "\n".join(f"{p.name:12} {p.status:8} {p.summary}" for p in parts))
    print(f"\ngpu-check: {'FAILED: ' + ', '.join(failed) if failed else 'every part passed or was skipped'}; "
          f"report in {os.path.join(args.out, 'gpu-check.md')} ({info['seconds']:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
