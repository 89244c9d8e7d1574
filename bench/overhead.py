"""Training-time overhead of checkpointing every step: diffckpt versus Lightning's own checkpoints.

One process, interleaved rounds (the order alternates each round), each run in a fresh temp dir:

1. ``none``: no checkpointing (``enable_checkpointing=False``), the baseline;
2. ``diffckpt``: ``DiffCheckpoint`` every step with default settings, ``DiffCheckpointIO``;
3. ``lightning``: ``ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)``, ``TorchCheckpointIO``;
4. ``lightning-async``: the same with ``AsyncCheckpointIO``.

Timed: from the start of the first step after ``--warmup`` steps until ``Trainer.fit`` returns
(so a background writer's final flush and Lightning's async teardown count). ``durable`` adds an
fsync of every file written (diffckpt already fsyncs its commits; Lightning does not).

    python bench/overhead.py [--steps 50] [--rounds 3] [--quick]

Writes a Markdown report to ``bench/results/overhead.md`` (``overhead-quick.md`` with --quick).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

from gpt import GPT, SIZES, make_loader
from provenance import dir_usage, header, report_path, write_report

from lightning_ckpt import DiffCheckpoint, DiffCheckpointIO

CONFIGS = ["none", "diffckpt", "lightning", "lightning-async"]


class Timer(L.Callback):
    """Marks the start of the timed window and the end of the training loop."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.t0: float | None = None
        self.t_loop_end: float | None = None
        self.writer: Any = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # By now the checkpoint of the previous step was taken (checkpoint callbacks run last).
        if self.t0 is None and trainer.global_step == self.warmup:
            self.t0 = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        # Runs before the checkpoint callbacks' on_train_end, i.e. before DiffCheckpoint closes.
        self.t_loop_end = time.perf_counter()
        for cb in trainer.callbacks:
            if isinstance(cb, DiffCheckpoint):
                self.writer = cb.engine.writer  # its stats stay readable after close


def fsync_tree(path: str) -> None:
    for dirpath, _, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def run_once(config: str, args: argparse.Namespace, steps: int, warmup: int) -> dict[str, Any]:
    workdir = tempfile.mkdtemp(prefix=f"bench-{config}-", dir=args.tmp)
    try:
        L.seed_everything(0, verbose=False)
        model = GPT(args.size, total_steps=steps)
        timer = Timer(warmup)
        callbacks: list[Any] = [timer]
        plugins: list[Any] = []
        if config == "diffckpt":
            callbacks.append(DiffCheckpoint(workdir))
            plugins.append(DiffCheckpointIO())
        elif config.startswith("lightning"):
            callbacks.append(ModelCheckpoint(dirpath=workdir, every_n_train_steps=1, save_top_k=-1))
            if config == "lightning-async":
                plugins.append(AsyncCheckpointIO())
        trainer = L.Trainer(
            max_steps=steps,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            enable_checkpointing=config != "none",
            callbacks=callbacks,
            plugins=plugins,
        )
        trainer.fit(model, train_dataloaders=make_loader(args.size))
        t_fit = time.perf_counter()
        fsync_tree(workdir)
        t_durable = time.perf_counter()
        assert timer.t0 is not None and timer.t_loop_end is not None
        nbytes, nfiles = dir_usage(workdir)
        out = {
            "seconds": t_fit - timer.t0,
            "durable": t_durable - timer.t0,
            "tail": t_fit - timer.t_loop_end,
            "bytes": nbytes,
            "files": nfiles,
        }
        if timer.writer is not None:
            s = timer.writer.stats
            out["writer"] = {
                "stall": s.stall_seconds,
                "write": s.write_seconds,
                "segments": s.segments,
                "records": s.records,
                "raw": s.raw_record_bytes,
                "seg_bytes": s.segment_bytes,
            }
        return out
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        gc.collect()


def machine_info(args: argparse.Namespace, steps: int, warmup: int) -> list[str]:
    cfg = SIZES[args.size]
    n_params = sum(p.numel() for p in GPT(args.size).parameters())
    tmp = args.tmp or tempfile.gettempdir()
    return [
        *header(f"lightning {L.__version__}"),
        f"- model: GPT '{args.size}', {n_params / 1e6:.2f}M parameters (fp32), "
        + f"batch {cfg.batch_size} x {cfg.ctx} tokens, AdamW + OneCycleLR, gradient clipping",
        f"- {steps} optimizer steps per run, first {warmup} untimed; "
        + f"{args.rounds} interleaved rounds; temp dirs under {tmp}",
    ]


NOTES = (
    "`median s`: timed steps plus the end of `fit` (final flush / async teardown). "
    "`durable s`: plus an fsync of every file written. `tail s`: from the end of the last step "
    "until `fit` returned. `bytes/step`: bytes on disk after the run / steps. Lightning's "
    "`TorchCheckpointIO` does not fsync; diffckpt fsyncs every commit. With torch threads = "
    "cores, background writer threads (diffckpt's, AsyncCheckpointIO's) compete with the OpenMP "
    "workers; compare with `--threads` one less than the cores."
)


def render(results: dict[str, list[dict[str, Any]]], steps: int, warmup: int) -> list[str]:
    def med(runs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    timed = steps - warmup
    base = med(results["none"], "seconds")
    lines = [
        "| config | median s | s/step | vs none | durable s | tail s | bytes/step | files |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for config, runs in results.items():
        t = med(runs, "seconds")
        cells = [
            config,
            f"{t:.2f}",
            f"{t / timed:.3f}",
            f"{t / base:.2f}x",
            f"{med(runs, 'durable'):.2f}",
            f"{med(runs, 'tail'):.2f}",
            f"{med(runs, 'bytes') / steps / 1e6:.2f} MB",
            str(runs[0]["files"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    writer = [r["writer"] for r in results.get("diffckpt", []) if "writer" in r]
    if writer:
        w = {k: statistics.median(x[k] for x in writer) for k in writer[0]}
        ratio = f"{w['raw'] / w['seg_bytes']:.2f}" if w["seg_bytes"] and w["raw"] else "n/a"
        lines += [
            "",
            f"diffckpt writer (median per run): {w['records']:.0f} records in "
            + f"{w['segments']:.0f} segments, {w['seg_bytes'] / 1e6:.1f} MB "
            + f"(raw/encoded {ratio}), write time {w['write']:.2f} s, "
            + f"training stalled on a full queue {w['stall']:.2f} s",
        ]
    lines += ["", "All runs (s, in round order):", ""]
    for config, runs in results.items():
        lines.append(f"- {config}: " + " ".join(f"{r['seconds']:.2f}" for r in runs))
    return [*lines, "", NOTES]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of every run")
    ap.add_argument("--size", default="bench", choices=sorted(SIZES))
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help="comma-separated subset of " + ",".join(CONFIGS),
    )
    ap.add_argument(
        "--tmp", help="parent of the temp run dirs (default: the system temp dir; use local disk)"
    )
    ap.add_argument("--out", help="Markdown report path")
    ap.add_argument(
        "--quick", action="store_true", help="tiny smoke run: demo size, 10 steps, 1 round"
    )
    args = ap.parse_args()
    if args.quick:
        args.size, args.steps, args.rounds = "demo", 10, 1
    out = report_path(args.out, "overhead", args.quick)
    configs = args.configs.split(",")
    unknown = set(configs) - set(CONFIGS)
    if unknown or "none" not in configs:
        sys.exit(f"--configs must include 'none' and only use {CONFIGS}")
    steps, warmup = args.steps, args.warmup
    if steps <= warmup:
        sys.exit("--steps must exceed --warmup")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")  # Lightning's and torch's deprecation chatter, once per run
    for name in ("lightning.pytorch", "lightning.fabric", "diffckpt"):
        logging.getLogger(name).setLevel(logging.WARNING)

    info = machine_info(args, steps, warmup)
    run_once("none", args, warmup + 2, warmup)  # warm up the process (allocator, lazy imports)
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for rnd in range(args.rounds):
        for config in configs if rnd % 2 == 0 else reversed(configs):
            r = run_once(config, args, steps, warmup)
            results[config].append(r)
            head = f"round {rnd + 1}/{args.rounds} {config:16s}"
            tail = f"tail {r['tail']:.2f} s {r['bytes'] / 1e6:8.1f} MB"
            print(f"{head} {r['seconds']:7.2f} s  {tail}", flush=True)
    table = render(results, steps, warmup)
    report = ["# Checkpointing overhead per training step", "", *info, "", *table, ""]
    print("\n" + "\n".join(table))
    write_report(out, report)
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
