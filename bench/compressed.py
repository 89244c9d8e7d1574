"""Compressed-gradient diffs: bytes per step, training-time overhead and replay time per codec.

With ``DiffCheckpoint(codec=...)`` training runs on compressed gradients and the compressed payload
is the stored diff. For each codec (``dense``: no codec, exact dense diffs, for reference;
``topk``: ``TopK(0.01)``; ``topk-ef``: ``TopK(0.01, error_feedback=True)``; ``powersgd``:
``PowerSGD(rank=4)``; ``bf16``: ``LowPrecision("bf16")``), on the GPT of ``examples/gpt.py``
(AdamW + OneCycleLR, gradient clipping) two runs are compared:

1. ``none``: the same compressed training without checkpointing (``lightning_ckpt.compression.
   GradientCompression``, what ``DiffCheckpoint(codec=...)`` runs; for ``dense``: plain training);
2. ``diffckpt``: ``DiffCheckpoint(every_n_steps=1, write_batch=8, base_every_n_steps=<more than
   the steps>, codec=...)`` with ``DiffCheckpointIO``, so the starting base is the only base and
   diffs dominate.

Measured:

- diff bytes per step (bytes under ``<run>/diffs/`` / steps) as a fraction of a full checkpoint
  (``torch.save({"model": state_dict, "optimizer": AdamW state_dict})`` after training);
- time ratio ``diffckpt`` / ``none``, single process, interleaved rounds (the order reverses every
  other round), medians; timed from the first step after ``--warmup`` steps until ``Trainer.fit``
  returns (the final flush counts); also the process's CPU time (all threads, the background
  writer's included) over the same window, which other load on the machine disturbs less;
- the same with 2-process DDP on CPU (``strategy="ddp"``, gloo, one torch thread per process):
  each run is a fresh ``python bench/compressed.py --worker ...`` subprocess, which Lightning's
  launcher re-executes for rank 1; rank 0 writes its timings to a JSON file;
- replay time per step: ``CheckpointEngine(run).restore(model, [optimizer])`` of the newest step
  (base load included) / steps replayed, and the marginal cost (minus a restore of the base
  step alone), on the single-process runs.

Targets from the issue (reported, not asserted): ``TopK(0.01)`` diffs at most 2% of a full
checkpoint per step; at most 1.03x the time of the same compressed training without checkpointing.

    python bench/compressed.py [--steps 50] [--rounds 3] [--threads N] [--no-ddp] [--quick]

Torch threads default to the cores, as in ``bench/overhead.py``; the background writer then
competes with torch's OpenMP workers. ``--threads`` one less than the cores leaves it a core.

Writes a Markdown report to ``bench/results/compressed.md`` (``compressed-quick.md`` with
--quick, which uses the demo model, 10 steps, 1 round and no DDP unless ``--ddp``).
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import lightning as L
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

from gpt import GPT, SIZES, make_loader
from provenance import dir_usage, header, report_path, write_report

from diffckpt import CheckpointEngine
from diffckpt.codecs import LowPrecision, PowerSGD, TopK
from lightning_ckpt import DiffCheckpoint, DiffCheckpointIO
from lightning_ckpt.compression import GradientCompression

CODECS: dict[str, Any] = {
    "dense": lambda: None,
    "topk": lambda: TopK(0.01),
    "topk-ef": lambda: TopK(0.01, error_feedback=True),
    "powersgd": lambda: PowerSGD(rank=4),
    "bf16": lambda: LowPrecision("bf16"),
}
LABELS = {
    "dense": "dense (no codec)",
    "topk": "TopK(0.01)",
    "topk-ef": "TopK(0.01, error_feedback=True)",
    "powersgd": "PowerSGD(rank=4)",
    "bf16": 'LowPrecision("bf16")',
}
MODES = ("none", "diffckpt")
TARGET_BYTES, TARGET_TIME = 0.02, 1.03


class Timer(L.Callback):
    """Marks the start of the timed window and the end of the training loop."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.t0: float | None = None
        self.cpu0: float | None = None
        self.t_loop_end: float | None = None
        self.writer: Any = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # By now the checkpoint of the previous step was taken (checkpoint callbacks run last).
        if self.t0 is None and trainer.global_step == self.warmup:
            self.t0, self.cpu0 = time.perf_counter(), time.process_time()

    def on_train_end(self, trainer, pl_module) -> None:
        # Runs before the checkpoint callbacks' on_train_end, i.e. before DiffCheckpoint closes.
        self.t_loop_end = time.perf_counter()
        for cb in trainer.callbacks:
            if isinstance(cb, DiffCheckpoint) and cb.engine.started:
                self.writer = cb.engine.recorder.writer  # its stats stay readable after close


def full_checkpoint_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    buf = io.BytesIO()
    torch.save({"model": module.state_dict(), "optimizer": optimizer.state_dict()}, buf)
    return buf.tell()


def train(codec: str, mode: str, size: str, steps: int, warmup: int, run_dir: str,
          devices: int) -> dict[str, Any] | None:
    """One training run; its timings on rank 0, ``None`` on other ranks."""
    L.seed_everything(0, verbose=False)
    model = GPT(size, total_steps=steps)
    timer = Timer(warmup)
    callbacks: list[Any] = [timer]
    plugins: list[Any] = []
    diff = None
    if mode == "diffckpt":
        diff = DiffCheckpoint(run_dir, every_n_steps=1, write_batch=8,
                              base_every_n_steps=steps + 1000, codec=CODECS[codec]())
        callbacks.append(diff)
        plugins.append(DiffCheckpointIO())
    elif codec != "dense":
        callbacks.insert(0, GradientCompression(CODECS[codec]()))
    parallel = {"strategy": "ddp", "devices": devices} if devices > 1 else {"devices": 1}
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, enable_checkpointing=diff is not None,
        callbacks=callbacks, plugins=plugins, **parallel,
    )
    trainer.fit(model, train_dataloaders=make_loader(size))
    t_fit, cpu_fit = time.perf_counter(), time.process_time()
    if not trainer.is_global_zero:
        return None
    assert timer.t0 is not None and timer.cpu0 is not None and timer.t_loop_end is not None
    out: dict[str, Any] = {
        "seconds": t_fit - timer.t0,
        "cpu": cpu_fit - timer.cpu0,  # this process, all threads (the writer's included)
        "tail": t_fit - timer.t_loop_end,
        "full_bytes": full_checkpoint_bytes(model, trainer.optimizers[0]),
    }
    if diff is not None:
        s = timer.writer.stats
        out["raw"], out["encoded"] = s.raw_record_bytes, s.segment_bytes
        out["stall"] = s.stall_seconds
        # The compressor warns once when it has to record a step dense (payloads != gradients).
        out["dense_fallback"] = bool(getattr(diff.compressor, "_warned", False))
    return out


def replay_times(run_dir: str, size: str) -> dict[str, Any]:
    """Restore the newest step and the base step alone into a fresh model and optimizer."""
    def restore(step: int | None) -> tuple[float, Any]:
        model = GPT(size)
        optimizer = model.configure_optimizers()["optimizer"]
        t0 = time.perf_counter()
        result = CheckpointEngine(run_dir).restore(model, [optimizer], step)
        return time.perf_counter() - t0, result

    t_newest, result = restore(None)
    t_base, _ = restore(result.base_step)
    return {"restore": t_newest, "base_restore": t_base, "replayed": result.replayed}


def run_single(codec: str, mode: str, args: argparse.Namespace, steps: int) -> dict[str, Any]:
    run_dir = tempfile.mkdtemp(prefix=f"bench-{codec}-{mode}-", dir=args.tmp)
    try:
        out = train(codec, mode, args.size, steps, args.warmup, run_dir, devices=1)
        assert out is not None
        if mode == "diffckpt":
            out["diff_bytes"] = dir_usage(os.path.join(run_dir, "diffs"))[0]
            out.update(replay_times(run_dir, args.size))
        return out
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        gc.collect()


def run_ddp(codec: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """A 2-process DDP run in a fresh worker subprocess (and process group)."""
    run_dir = tempfile.mkdtemp(prefix=f"bench-ddp-{codec}-{mode}-", dir=args.tmp)
    result = os.path.join(run_dir, "result.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", codec, mode, "--size", args.size,
           "--steps", str(args.ddp_steps), "--warmup", str(args.warmup), "--run-dir",
           os.path.join(run_dir, "run"), "--result", result]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        if proc.returncode != 0 or not os.path.exists(result):
            sys.exit(f"DDP worker {codec}/{mode} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        with open(result) as f:
            out = json.load(f)
        if mode == "diffckpt":
            out["diff_bytes"] = dir_usage(os.path.join(run_dir, "run", "diffs"))[0]
        return out
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def worker(args: argparse.Namespace) -> None:
    """Entry point of a DDP run (both ranks: Lightning re-executes this command for rank 1)."""
    codec, mode = args.worker
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // 2))
    out = train(codec, mode, args.size, args.steps, args.warmup, args.run_dir, devices=2)
    if out is not None:
        out["threads"] = torch.get_num_threads()
        with open(args.result, "w") as f:
            json.dump(out, f)


# ---------------------------------------------------------------------------------- report
def med(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def bytes_table(single: dict, ddp: dict, steps: int, ddp_steps: int) -> list[str]:
    full = med(single["dense", "none"], "full_bytes")
    lines = [
        f"Full checkpoint (model + AdamW state, `torch.save`): {full / 1e6:.2f} MB.",
        "",
        "| codec | diff bytes/step | of full ckpt | raw/encoded | DDP (2 ranks) bytes/step | "
        "of full ckpt | dense fallback |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for codec in CODECS:
        runs = single[codec, "diffckpt"]
        per_step = med(runs, "diff_bytes") / steps
        ratio = med(runs, "raw") / med(runs, "encoded")
        cells = [LABELS[codec], f"{per_step / 1e3:.1f} kB", f"{per_step / full:.2%}", f"{ratio:.2f}"]
        if (codec, "diffckpt") in ddp:
            d = med(ddp[codec, "diffckpt"], "diff_bytes") / ddp_steps
            cells += [f"{d / 1e3:.1f} kB", f"{d / full:.2%}"]
        else:
            cells += ["-", "-"]
        fallback = any(r.get("dense_fallback") for r in runs + ddp.get((codec, "diffckpt"), []))
        cells.append("yes" if fallback else "no")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def time_table(results: dict, timed: int) -> list[str]:
    lines = [
        "| codec | none s/step | diffckpt s/step | diffckpt / none | CPU time diffckpt / none | "
        "tail s | runs none | runs diffckpt |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for codec in CODECS:
        none, diff = results[codec, "none"], results[codec, "diffckpt"]
        t_none, t_diff = med(none, "seconds"), med(diff, "seconds")
        cells = [
            LABELS[codec], f"{t_none / timed:.3f}", f"{t_diff / timed:.3f}",
            f"**{t_diff / t_none:.3f}x**", f"{med(diff, 'cpu') / med(none, 'cpu'):.3f}x",
            f"{med(diff, 'tail'):.2f}",
            " ".join(f"{r['seconds']:.2f}" for r in none),
            " ".join(f"{r['seconds']:.2f}" for r in diff),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def replay_table(single: dict) -> list[str]:
    lines = [
        "| codec | steps replayed | restore s | s/replayed step | base alone s | marginal s/step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for codec in CODECS:
        runs = single[codec, "diffckpt"]
        n, t, base = med(runs, "replayed"), med(runs, "restore"), med(runs, "base_restore")
        cells = [LABELS[codec], f"{n:.0f}", f"{t:.3f}", f"{t / n * 1e3:.2f} ms",
                 f"{base:.3f}", f"{(t - base) / n * 1e3:.2f} ms"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def targets(single: dict, ddp: dict, steps: int) -> list[str]:
    full = med(single["dense", "none"], "full_bytes")
    topk = med(single["topk", "diffckpt"], "diff_bytes") / steps / full

    def ratio(results: dict, codec: str, key: str = "seconds") -> float:
        return med(results[codec, "diffckpt"], key) / med(results[codec, "none"], key)

    def verdict(ok: bool) -> str:
        return "met" if ok else "**not met**"

    lines = [f"- TopK(0.01) diff bytes/step <= {TARGET_BYTES:.0%} of a full checkpoint: "
             f"{topk:.2%}, {verdict(topk <= TARGET_BYTES)}"]
    for name, results in (("single process", single), ("DDP, 2 processes", ddp)):
        if not results:
            continue
        for codec in CODECS:
            if codec == "dense":
                continue
            r = ratio(results, codec)
            lines.append(f"- {LABELS[codec]}, {name}: overhead <= {TARGET_TIME}x: "
                         f"{r:.3f}x, {verdict(r <= TARGET_TIME)} (CPU time "
                         f"{ratio(results, codec, 'cpu'):.3f}x)")
    return lines


NOTES = (
    "`none`: the same (compressed) training without checkpointing. Times: the timed steps plus "
    "the end of `fit` (final flush); medians over rounds. `CPU time`: of the (rank 0) process over "
    "the same window, all threads (the background writer's included), less sensitive than wall "
    "time to other load on the machine; `tail s`: from the end of the last step "
    "until `fit` returned. `diff bytes/step`: bytes under `<run>/diffs/` / steps (every step "
    "restorable, so each record also carries Lightning's small state: loops, RNG, scheduler). "
    "`raw/encoded`: the writer's raw record bytes over segment bytes (zstd when `auto` finds it "
    "pays). Under DDP, TopK's payload holds every rank's values and indices, hence about twice "
    "the bytes. `dense fallback`: whether the compressor recorded any step dense because "
    "decoded payloads did not match the consumed gradients (it should say no). Replay: restore of "
    "the newest step into a fresh model and AdamW, base load included; `marginal`: minus a "
    "restore of the base step alone. On 2 cores the background writer thread competes with "
    "torch's OpenMP workers; a concurrent load on the machine shows in the load average above."
)


def machine_info(args: argparse.Namespace) -> list[str]:
    cfg = SIZES[args.size]
    n_params = sum(p.numel() for p in GPT(args.size).parameters())
    lines = [
        *header(f"lightning {L.__version__}"),
        f"- model: GPT '{args.size}', {n_params / 1e6:.2f}M parameters (fp32), "
        f"batch {cfg.batch_size} x {cfg.ctx} tokens, AdamW + OneCycleLR, gradient clipping (norm 1)",
        f"- single process: {args.steps} optimizer steps per run, first {args.warmup} untimed; "
        f"{args.rounds} interleaved rounds",
    ]
    if args.ddp:
        lines.append(f"- DDP: 2 processes (gloo, 1 torch thread each), {args.ddp_steps} steps per "
                     f"run, first {args.warmup} untimed; {args.ddp_rounds} interleaved rounds, "
                     "a fresh subprocess per run")
    return lines


# ------------------------------------------------------------------------------------ main
def rounds(n: int, fn: Any, label: str) -> dict[tuple[str, str], list[dict[str, Any]]]:
    configs = [(codec, mode) for codec in CODECS for mode in MODES]
    results: dict[tuple[str, str], list[dict[str, Any]]] = {c: [] for c in configs}
    for rnd in range(n):
        for codec, mode in configs if rnd % 2 == 0 else reversed(configs):
            r = fn(codec, mode)
            results[codec, mode].append(r)
            extra = f"  {r['diff_bytes'] / 1e6:7.2f} MB diffs" if "diff_bytes" in r else ""
            print(f"{label} round {rnd + 1}/{n} {codec:9s} {mode:9s} {r['seconds']:7.2f} s{extra}",
                  flush=True)
    return results


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50, help="single-process steps per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ddp-steps", type=int, default=30, help="DDP steps per run")
    ap.add_argument("--ddp-rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of every run")
    ap.add_argument("--size", default="bench", choices=sorted(SIZES))
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="torch threads of the single-process runs (DDP: cores / 2 per process)")
    ap.add_argument("--ddp", action=argparse.BooleanOptionalAction, default=None,
                    help="also time 2-process DDP runs (default: yes, except with --quick)")
    ap.add_argument("--tmp", help="parent of the temp run dirs (default: the system temp dir)")
    ap.add_argument("--out", help="Markdown report path")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: demo size, 10 steps, 1 round, no DDP unless --ddp")
    # internal: one DDP run (see run_ddp)
    ap.add_argument("--worker", nargs=2, metavar=("CODEC", "MODE"), help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.size, args.steps, args.rounds = "demo", 10, 1
        args.ddp_steps, args.ddp_rounds = 10, 1
    if args.ddp is None:
        args.ddp = not args.quick
    if min(args.steps, args.ddp_steps) <= args.warmup:
        sys.exit("--steps and --ddp-steps must exceed --warmup")
    return args


def quiet() -> None:
    warnings.filterwarnings("ignore")  # Lightning's and torch's deprecation chatter
    for name in ("lightning.pytorch", "lightning.fabric", "diffckpt"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main() -> None:
    args = parse_args()
    quiet()
    if args.worker:
        worker(args)
        return
    torch.set_num_threads(args.threads)
    out = report_path(args.out, "compressed", args.quick)
    info = machine_info(args)
    t_start = time.perf_counter()
    run_single("dense", "none", args, args.warmup + 2)  # warm up the process
    single = rounds(args.rounds, lambda c, m: run_single(c, m, args, args.steps), "single")
    ddp = rounds(args.ddp_rounds, lambda c, m: run_ddp(c, m, args), "ddp") if args.ddp else {}
    wall = time.perf_counter() - t_start

    sections = [
        "## Diff bytes per step", "", *bytes_table(single, ddp, args.steps, args.ddp_steps), "",
        "## Time, single process", "", *time_table(single, args.steps - args.warmup), "",
    ]
    if ddp:
        sections += ["## Time, DDP (2 processes, CPU, gloo)", "",
                     *time_table(ddp, args.ddp_steps - args.warmup), ""]
    sections += ["## Replay time per step (single-process runs)", "", *replay_table(single), "",
                 "## Targets", "", *targets(single, ddp, args.steps), "", NOTES]
    report = ["# Compressed-gradient diffs: bytes, overhead and replay per codec", "", *info,
              f"- bench wall time: {wall / 60:.1f} min", "", *sections, ""]
    print("\n" + "\n".join(sections))
    write_report(out, report)
    print(f"\nwritten to {out} ({wall:.0f} s)")


if __name__ == "__main__":
    main()
