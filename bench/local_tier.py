"""The node-local tier (``CheckpointOptions(local_dir=...)``): steps lost at a ``kill -9``, and
what the journal costs per step.

Part 1, steps lost at a kill. A plain PyTorch loop (an MLP of about 1.6M parameters, AdamW, as
``tests/storage/crash_script.py`` drives the core ``CheckpointEngine``: ``start``, the starting
base at step 0, ``record_step`` after every ``optimizer.step()``, every step restorable, no
further bases) runs in a subprocess of its own (``train``) and prints ``STEP n`` once
``record_step(n)`` returned. After its first step, it is killed with SIGKILL (the whole process
group) at a random instant, drawn uniformly in ``--kill-after`` seconds. A fresh engine then
restores in the bench's own process (another process than the killed one, as a restarted job
on the same node is): ``CheckpointEngine(url, CheckpointOptions(local_dir=...)).restore(...)``,
which first takes what the node-local tier holds into the run root.

    lost = the last STEP printed - the restored step

Configurations: run root (``local``: a temp dir; ``s3``: ``s3://`` on a moto server on loopback,
a process of its own: ``bench/s3server.py``) x ``write_batch`` in (1, 4, 16, 64) x journal
(``off``: ``local_dir=None``, the behaviour before the local tier; ``on``: ``local_dir`` a temp
folder of the trial's own). Each of ``--trials`` rounds runs every configuration once, the order
reversed every other round. Also reported with the journal on: ``node loss``, the steps lost had
the node been lost with the process (the last STEP printed minus the step the run root held
before the resume merged the journal), and how many steps the merge took from the journal. The
subprocess of the next trial is started (and imports torch) while the current one resumes.

Part 2, cost per step: the same model trained ``--cost-steps`` steps after ``--warmup``, each
configuration in a fresh subprocess (``cost``): ``none`` (no checkpointing, the baseline),
``off`` (diffckpt, ``local_dir=None``), ``on`` (diffckpt, journal in a temp folder), on local
disk and on S3, with ``write_batch=--cost-batch``. Timed: the first step after the warm-up until
``engine.close()`` returned (the final flush counts). One run each.

    python bench/local_tier.py [--trials 4] [--threads 1] [--compression auto] [--quick] [--out FILE]

``--compression`` is the library's default, ``auto`` (decided per segment from a sample of its
first record: a resume takes back a run of segments of either kind). ``--quick``: one trial,
``write_batch`` 1 and 16, 40 cost steps (about a minute).

The Markdown report goes to stdout (and to ``--out``). Torch runs ``--threads`` threads (1: a
core left for the writer on a 2-core machine); the moto server shares the same cores, so S3
figures include its CPU work. Timings on a loaded machine are noisy; the steps lost are not
sensitive to load in their bound, only in how far the writer lags.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

from s3server import LoopbackS3

BATCHES = (1, 4, 16, 64)
BACKENDS = ("local", "s3")
JOURNAL = ("off", "on")
BUCKET = "diffckpt-local-tier"
MERGED = re.compile(r"held steps (\d+)\.\.(\d+) of session")


# ------------------------------------------------------------------------------ the training side
def make() -> tuple[Any, list[Any]]:
    """An MLP of about 1.6M parameters (6.3 MB of fp32 gradients per step) and its AdamW."""
    import torch

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                            torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    return m, [torch.optim.AdamW(m.parameters(), lr=1e-4)]


def step_once(m: Any, opts: list[Any], step: int, batch: int) -> None:
    import torch

    x = torch.randn(batch, 256, generator=torch.Generator().manual_seed(step))
    for o in opts:
        o.zero_grad()
    m(x).pow(2).mean().backward()
    for o in opts:
        o.step()


COMPRESSION = "auto"  # set from --compression in every process


def options(write_batch: int, local_dir: str | None) -> Any:
    from diffckpt import CheckpointOptions, RetryPolicy

    return CheckpointOptions(write_batch=write_batch, every_n_steps=1, base_every_n_steps=None, retention=None,
                             local_dir=local_dir, compression=COMPRESSION,  # type: ignore[arg-type]
                             retry=RetryPolicy(budget_s=20, initial_backoff_s=0.05, max_backoff_s=0.5))


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def child_train(args: argparse.Namespace) -> None:
    """``train``: import, print READY, wait for a line on stdin, then train until killed."""
    import torch

    from diffckpt import CheckpointEngine

    torch.set_num_threads(args.threads)
    m, opts = make()
    local_dir = None if args.local_dir == "none" else args.local_dir
    engine = CheckpointEngine(args.url, options(args.write_batch, local_dir))
    say("READY")
    sys.stdin.readline()
    engine.start(m, opts, 0)
    engine.write_base(0, m.state_dict(), [o.state_dict() for o in opts], {"step": 0})
    for step in range(1, args.steps + 1):
        step_once(m, opts, step, args.batch)
        engine.record_step(step, {"step": step})
        say(f"STEP {step}")
    engine.close()
    say("DONE")


def child_cost(args: argparse.Namespace) -> None:
    """``cost``: train ``--warmup`` + ``--steps`` steps in configuration ``--config``; print the
    timed window as ``RESULT {json}``."""
    import torch

    from diffckpt import CheckpointEngine

    torch.set_num_threads(args.threads)
    m, opts = make()
    engine = None
    if args.config != "none":
        engine = CheckpointEngine(args.url, options(args.write_batch, args.local_dir if args.config == "on" else None))
        engine.start(m, opts, 0)
        engine.write_base(0, m.state_dict(), [o.state_dict() for o in opts], {"step": 0})
    start = cpu = 0.0
    for step in range(1, args.warmup + args.steps + 1):
        if step == args.warmup + 1:
            start, cpu = time.perf_counter(), time.process_time()
        step_once(m, opts, step, args.batch)
        if engine is not None:
            engine.record_step(step, {"step": step})
    if engine is not None:
        engine.close()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    say("RESULT " + json.dumps({"s_per_step": wall / args.steps, "cpu_per_step": cpu / args.steps}))


# ---------------------------------------------------------------------------------------- part 1
@dataclass
class Trial:
    backend: str
    batch: int
    journal: str
    url: str = ""
    local_dir: str | None = None
    proc: subprocess.Popen[str] | None = None
    lines: list[str] = field(default_factory=list)


@dataclass
class Outcome:
    lost: int
    node_lost: int
    from_journal: int
    last: int
    restored: int
    resume_s: float


class Merges(logging.Handler):
    """Catches the resume's "the local tier on this host held steps a..b" line."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.spans: list[tuple[int, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            print(f"  diffckpt: {record.getMessage()}", file=sys.stderr, flush=True)
        found = MERGED.search(record.getMessage())
        if found:
            self.spans.append((int(found.group(1)), int(found.group(2))))


def spawn(trial: Trial, work: str, args: argparse.Namespace, env: dict[str, str]) -> None:
    name = f"run-{uuid.uuid4().hex[:8]}"
    trial.url = f"s3://{BUCKET}/{name}" if trial.backend == "s3" else os.path.join(work, name)
    trial.local_dir = os.path.join(work, f"local-{name}") if trial.journal == "on" else None
    cmd = [sys.executable, os.path.abspath(__file__), "train", "--url", trial.url, "--write-batch", str(trial.batch),
           "--local-dir", trial.local_dir or "none", "--threads", str(args.threads), "--batch", str(args.batch),
           "--compression", args.compression]
    trial.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  text=True, env=env, start_new_session=True)


def run_trial(trial: Trial, rng: random.Random, args: argparse.Namespace, merges: Merges) -> Outcome:
    from diffckpt import CheckpointEngine, CheckpointNotFoundError

    proc = trial.proc
    assert proc is not None and proc.stdin is not None and proc.stdout is not None
    first = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            trial.lines.append(line.strip())
            if line.startswith("STEP"):
                first.set()

    if proc.stdout.readline().strip() != "READY":
        raise RuntimeError(f"the training process of {trial} did not start")
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc.stdin.write("go\n")
    proc.stdin.flush()
    if not first.wait(120):
        raise RuntimeError(f"the training process of {trial} made no step in 120 s")
    time.sleep(rng.uniform(*args.kill_after))
    os.killpg(proc.pid, 9)
    proc.wait()
    reader.join(10)
    steps = [int(line.split()[1]) for line in trial.lines if line.startswith("STEP ")]
    last = max(steps)
    m, opts = make()
    merges.spans.clear()
    start = time.perf_counter()
    try:
        restored = CheckpointEngine(trial.url, options(trial.batch, trial.local_dir)).restore(m, opts).step
    except CheckpointNotFoundError:  # killed before the starting base was durable
        restored = 0
    resume_s = time.perf_counter() - start
    span = merges.spans[-1] if merges.spans else None
    durable_root = span[0] - 1 if span else restored  # what the run root held before the merge
    return Outcome(last - restored, last - durable_root, span[1] - span[0] + 1 if span else 0, last, restored,
                   resume_s)


def part1(args: argparse.Namespace, work: str, moto: LoopbackS3 | None) -> dict[tuple[str, int, str], list[Outcome]]:
    rng = random.Random(args.seed)
    configs = [(b, n, j) for b in args.backends for n in args.batches for j in JOURNAL]
    schedule: list[Trial] = []
    for r in range(args.trials):
        schedule += [Trial(*c) for c in (configs if r % 2 == 0 else configs[::-1])]
    env = {**os.environ, **(moto.env if moto else {}), "PYTHONPATH": ROOT}
    merges = Merges()
    log = logging.getLogger("diffckpt")
    log.setLevel(logging.WARNING)
    log.propagate = False  # the merge's WARNING is counted, not printed
    log.addHandler(merges)
    results: dict[tuple[str, int, str], list[Outcome]] = {c: [] for c in configs}
    spawn(schedule[0], work, args, env)
    for i, trial in enumerate(schedule):
        try:
            outcome = run_trial(trial, rng, args, merges)
        finally:
            if trial.proc is not None and trial.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(trial.proc.pid, 9)
                trial.proc.wait()
        if i + 1 < len(schedule):  # it imports torch while this trial's resume cleans up
            spawn(schedule[i + 1], work, args, env)
        results[(trial.backend, trial.batch, trial.journal)].append(outcome)
        print(f"  trial {i + 1}/{len(schedule)} {trial.backend} B={trial.batch} journal {trial.journal}: "
              f"last STEP {outcome.last}, restored {outcome.restored}, lost {outcome.lost}"
              f" (resume {outcome.resume_s:.1f}s)", file=sys.stderr, flush=True)
        if moto is not None and trial.backend == "s3":
            moto.clear(trial.url)
        else:
            shutil.rmtree(trial.url, ignore_errors=True)
        if trial.local_dir:
            shutil.rmtree(trial.local_dir, ignore_errors=True)
    log.removeHandler(merges)
    log.propagate = True
    return results


# ---------------------------------------------------------------------------------------- part 2
def part2(args: argparse.Namespace, work: str, moto: LoopbackS3 | None) -> dict[tuple[str, str], dict[str, float]]:
    env = {**os.environ, **(moto.env if moto else {}), "PYTHONPATH": ROOT}
    out: dict[tuple[str, str], dict[str, float]] = {}
    for backend in args.backends:
        for config in ("none", "off", "on"):
            if backend != args.backends[0] and config == "none":
                continue  # the baseline touches no storage: measured once
            name = f"cost-{uuid.uuid4().hex[:8]}"
            url = f"s3://{BUCKET}/{name}" if backend == "s3" else os.path.join(work, name)
            local_dir = os.path.join(work, f"local-{name}")
            cmd = [sys.executable, os.path.abspath(__file__), "cost", "--config", config, "--url", url,
                   "--local-dir", local_dir, "--write-batch", str(args.cost_batch), "--steps", str(args.cost_steps),
                   "--warmup", str(args.warmup), "--threads", str(args.threads), "--batch", str(args.batch),
                   "--compression", args.compression]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                raise RuntimeError(f"cost run {backend}/{config} failed:\n{proc.stderr[-3000:]}")
            out[(backend, config)] = json.loads(line[-1][len("RESULT "):])
            print(f"  cost {backend} {config}: {out[(backend, config)]['s_per_step'] * 1e3:.1f} ms/step",
                  file=sys.stderr, flush=True)
            if moto is not None and backend == "s3":
                moto.clear(url)
            else:
                shutil.rmtree(url, ignore_errors=True)
            shutil.rmtree(local_dir, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------------------- report
def report(args: argparse.Namespace, lost: dict[tuple[str, int, str], list[Outcome]],
           cost: dict[tuple[str, str], dict[str, float]]) -> list[str]:
    from provenance import header

    import diffckpt

    lines = ["# The node-local tier: steps lost at a kill, and the journal's cost", "",
             *header(f"diffckpt {getattr(diffckpt, '__version__', '?')}", " (each training process)"),
             f"- model: MLP 256-1024-1024-256 (1.6M parameters, 6.3 MB of gradients per step), AdamW, batch "
             f"{args.batch}; every step restorable, one base (step 0), compression {args.compression}",
             f"- part 1: {args.trials} trial(s) per configuration, kill -9 of the process group "
             f"{args.kill_after[0]:g}-{args.kill_after[1]:g} s after the first step, resume in another process",
             "", "## Steps lost at a kill -9", "",
             "lost = last `STEP n` printed − step restored. `node loss`: what the same kill would have lost "
             "had the node gone with the process (the run root alone, before the resume merged the journal). "
             "`from journal`: steps the resume took from the local tier.", "",
             "| storage | write_batch | journal | lost mean | lost max | node loss mean | node loss max "
             "| from journal mean | steps at kill mean | resume s mean |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for (backend, batch, journal), outs in lost.items():
        if not outs:
            continue
        mean = statistics.mean
        lines.append(f"| {backend} | {batch} | {journal} | {mean(o.lost for o in outs):.1f} | {max(o.lost for o in outs)} "
                     f"| {mean(o.node_lost for o in outs):.1f} | {max(o.node_lost for o in outs)} "
                     f"| {mean(o.from_journal for o in outs):.1f} | {mean(o.last for o in outs):.0f} "
                     f"| {mean(o.resume_s for o in outs):.2f} |")
    if cost:
        base = cost[(args.backends[0], "none")]
        lines += ["", f"## Cost per step (write_batch {args.cost_batch}, {args.cost_steps} steps after "
                  f"{args.warmup} warm-up steps, one run each)", "",
                  "| storage | checkpointing | ms/step | ratio to none | CPU ms/step (all threads) |",
                  "|---|---|---:|---:|---:|"]
        label = {"none": "none", "off": "diffckpt, local_dir=None", "on": "diffckpt, journal on"}
        for (backend, config), r in cost.items():
            lines.append(f"| {backend if config != 'none' else '-'} | {label[config]} | {r['s_per_step'] * 1e3:.1f} "
                         f"| {r['s_per_step'] / base['s_per_step']:.2f} | {r['cpu_per_step'] * 1e3:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", nargs="?", default="bench", choices=["bench", "train", "cost"])
    p.add_argument("--trials", type=int, default=4, help="kills per configuration (part 1)")
    p.add_argument("--kill-after", type=float, nargs=2, default=(0.5, 3.0), metavar=("LO", "HI"),
                   help="the kill comes this many seconds after the first step, uniformly")
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--cost-steps", type=int, default=150)
    p.add_argument("--cost-batch", type=int, default=8, help="write_batch of part 2")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch threads of each training process")
    p.add_argument("--batch", type=int, default=64, help="training batch size")
    p.add_argument("--compression", choices=["auto", "zstd", "none"], default="auto",
                   help="CheckpointOptions.compression (the default, auto, decides per segment)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", choices=["lost", "cost"], help="leave one part out")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 trial, write_batch 1 and 16, 40 cost steps")
    p.add_argument("--out", help="also write the report to this file")
    # the subprocesses' own arguments
    p.add_argument("--url")
    p.add_argument("--local-dir")
    p.add_argument("--write-batch", type=int, default=8)
    p.add_argument("--config", choices=["none", "off", "on"])
    p.add_argument("--steps", type=int, default=10**6)
    args = p.parse_args(argv)
    global COMPRESSION
    COMPRESSION = args.compression
    if args.mode == "train":
        return child_train(args)
    if args.mode == "cost":
        return child_cost(args)
    if args.quick:
        args.trials, args.batches, args.cost_steps = 1, [1, 16], 40
    import torch

    torch.set_num_threads(args.threads)  # as in the training processes (the report's header says so)
    work = tempfile.mkdtemp(prefix="bench-local-tier-")
    moto = LoopbackS3(BUCKET) if "s3" in args.backends else None
    if moto is not None:
        moto.export()  # the resumes in this process reach it as the trials' processes do
    started = time.perf_counter()
    try:
        lost = part1(args, work, moto) if args.skip != "lost" else {}
        cost = part2(args, work, moto) if args.skip != "cost" else {}
    finally:
        if moto is not None:
            moto.stop()
        shutil.rmtree(work, ignore_errors=True)
    lines = report(args, lost, cost)
    lines += ["", f"Total bench time {time.perf_counter() - started:.0f} s."]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
