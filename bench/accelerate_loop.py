"""Training-time overhead and bytes of checkpointing every step in an Accelerate loop.

One process, interleaved rounds (the order alternates each round), each run in a fresh temp dir,
the same loop (GPT "bench" of ``examples/gpt.py`` used as a plain module, AdamW, a warm-up
schedule, clipping, a shuffling loader):

1. ``none``: no checkpointing, the baseline;
2. ``diffckpt``: ``DiffCheckpointer`` every step (dense diffs), loader tracked;
3. ``save_state``: ``accelerator.save_state()`` every step;
4. ``dcp-async``: ``torch.distributed.checkpoint.async_save`` of model and optimizer every step
   (each save waits for the previous one, as its docs ask);
5. ``topk-none``: compressed training with TopK(0.01) (``GradientCompression``), no checkpoints;
6. ``diffckpt-topk``: the same with ``DiffCheckpointer(codec=TopK(0.01))``: compared with 5.

Timed: from the first step after ``--warmup`` until the last checkpoint is written (the final
flush or the last future), so background work counts.

    python bench/accelerate_loop.py [--steps 50] [--rounds 3] [--threads 1] [--quick]

Writes ``bench/results/accelerate.md`` (``accelerate-quick.md`` with --quick).
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

import accelerate
import torch
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator
from accelerate.state import AcceleratorState

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

from gpt import GPT, SIZES, make_dataset
from provenance import dir_usage, header, report_path, write_report

from accelerate_ckpt import DiffCheckpointer, GradientCompression
from diffckpt.codecs import TopK

CONFIGS = ["none", "diffckpt", "save_state", "dcp-async", "topk-none", "diffckpt-topk"]
BASELINE = {"diffckpt": "none", "save_state": "none", "dcp-async": "none", "diffckpt-topk": "topk-none"}


def run_once(config: str, args: argparse.Namespace, steps: int) -> dict[str, Any]:
    workdir = tempfile.mkdtemp(prefix=f"bench-{config}-", dir=args.tmp)
    try:
        accelerator = Accelerator(cpu=True)
        torch.manual_seed(0)
        model = GPT(args.size, total_steps=steps)
        cfg = model.cfg
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        loader = torch.utils.data.DataLoader(make_dataset(args.size), batch_size=cfg.batch_size, shuffle=True)
        model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
        codec = TopK(0.01) if "topk" in config else None
        ckpt = None
        if config.startswith("diffckpt"):
            ckpt = DiffCheckpointer(accelerator, os.path.join(workdir, "run"), codec=codec)
            loader = ckpt.dataloader(loader)
        elif codec is not None:
            GradientCompression(accelerator, codec, model=model)
        future = None
        t0 = None
        step = 0
        while step < steps:
            for batch in loader:
                if step == args.warmup:
                    t0 = time.perf_counter()
                x, y = batch[:, :-1], batch[:, 1:]
                loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, cfg.vocab), y.reshape(-1))
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
                step += 1
                if config == "save_state":
                    accelerator.save_state(os.path.join(workdir, f"step{step}"))
                elif config == "dcp-async":
                    if future is not None:
                        future.result()
                    state = {"model": model.state_dict(), "optimizer": opt.optimizer.state_dict()}
                    future = dcp.async_save(state, checkpoint_id=os.path.join(workdir, f"step{step}"))
                if step == steps:
                    break
        if ckpt is not None:
            ckpt.close()
        if future is not None:
            future.result()
        seconds = time.perf_counter() - t0
        full = os.path.join(workdir, "full.pt")
        torch.save({"model": model.state_dict(), "optimizer": opt.optimizer.state_dict()}, full)
        full_bytes = os.path.getsize(full)
        os.remove(full)
        return {"seconds": seconds, "bytes": dir_usage(workdir)[0], "full": full_bytes}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        AcceleratorState._reset_state(True)
        gc.collect()


def render(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> list[str]:
    def med(config: str, key: str) -> float:
        return statistics.median(r[key] for r in results[config])

    timed = args.steps - args.warmup
    full = med("none", "full")
    lines = ["| config | median s | s/step | vs baseline | bytes/step | of a full checkpoint |",
             "|---|---:|---:|---:|---:|---:|"]
    for config in results:
        base = BASELINE.get(config)
        ratio = f"{med(config, 'seconds') / med(base, 'seconds'):.2f}× `{base}`" if base in results else "-"
        per_step = med(config, "bytes") / args.steps
        lines.append(f"| {config} | {med(config, 'seconds'):.2f} | {med(config, 'seconds') / timed:.3f} | {ratio} | "
                     f"{per_step / 1e6:.2f} MB | {100 * per_step / full:.1f}% |")
    lines += ["", f"Full checkpoint (model + AdamW, torch.save): {full / 1e6:.2f} MB. Runs (s):"]
    lines += [f"- {c}: " + " ".join(f"{r['seconds']:.2f}" for r in runs) for c, runs in results.items()]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of every run")
    ap.add_argument("--size", default="bench", choices=sorted(SIZES))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a core for writers)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    ap.add_argument("--tmp", help="parent of the temp run dirs (default: the system temp dir)")
    ap.add_argument("--out", help="Markdown report path")
    ap.add_argument("--quick", action="store_true", help="smoke run: demo size, 10 steps, 1 round")
    args = ap.parse_args()
    if args.quick:
        args.size, args.steps, args.rounds = "demo", 10, 1
    configs = args.configs.split(",")
    if set(configs) - set(CONFIGS) or "none" not in configs:
        sys.exit(f"--configs must include 'none' and only use {CONFIGS}")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    for name in ("accelerate", "diffckpt", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    n_params = sum(p.numel() for p in GPT(args.size).parameters())
    info = [*header(f"accelerate {accelerate.__version__}"),
            (f"- model: GPT '{args.size}' as a plain module, {n_params / 1e6:.2f}M parameters (fp32), AdamW, "
             "LambdaLR warm-up, clipping; one process"),
            f"- {args.steps} optimizer steps per run, first {args.warmup} untimed; {args.rounds} interleaved rounds"]
    run_once("none", args, args.warmup + 2)  # warm the process up
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for rnd in range(args.rounds):
        for config in configs if rnd % 2 == 0 else list(reversed(configs)):
            r = run_once(config, args, args.steps)
            results[config].append(r)
            print(f"round {rnd + 1}/{args.rounds} {config:14s} {r['seconds']:7.2f} s {r['bytes'] / 1e6:9.1f} MB",
                  flush=True)
    table = render(results, args)
    print("\n" + "\n".join(table))
    out = report_path(args.out, "accelerate", args.quick)
    write_report(out, ["# Checkpointing every step in an Accelerate loop", "", *info, "", *table, ""])
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
