"""Training-time overhead of checkpointing every step: diffckpt versus Lightning's own checkpoints
and ``torch.distributed.checkpoint.async_save``, and diffckpt before and after a change.

One Lightning run per configuration and round, each a fresh subprocess (``--child``) in a fresh
temp dir; the order of the configurations reverses every other round:

1. ``none``: no checkpointing (``enable_checkpointing=False``), the baseline;
2. ``diffckpt``: ``DiffCheckpoint`` every step with default settings, ``DiffCheckpointIO``;
3. ``lightning``: ``ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)``, ``TorchCheckpointIO``;
4. ``lightning-async``: the same with ``AsyncCheckpointIO``;
5. ``dcp-async``: ``torch.distributed.checkpoint.async_save`` of the model and optimizer state
   after every step (the previous save awaited first);
6. ``topk-none``: training on ``TopK(0.01)``-compressed gradients without checkpointing
   (``lightning_ckpt.compression.GradientCompression``, what ``DiffCheckpoint(codec=...)`` runs);
7. ``topk``: ``DiffCheckpoint(codec=TopK(0.01))``: the payloads are the diffs; its baseline is
   ``topk-none``.

``--before REV`` adds ``diffckpt@REV`` and ``topk@REV``: the same runs with the package as it was
at commit ``REV`` (``git archive`` into a temp dir, put first on the child's ``sys.path``), so a
change is measured against the code before it on the same machine, in the same run.

Timed: from the start of the first step after ``--warmup`` steps until ``Trainer.fit`` returns
(a background writer's final flush and async teardowns count). Also measured per run: the
process's CPU seconds over that window (all threads), and diffckpt's writer thread's own CPU
seconds (``time.thread_time`` around its loop), per step and per MB written.

    python bench/overhead.py [--steps 50] [--rounds 3] [--before REV] [--quick]

Writes a Markdown report to ``bench/results/overhead.md`` (``overhead-quick.md`` with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "bench"), os.path.join(ROOT, "examples")]

CONFIGS = ["none", "diffckpt", "lightning", "lightning-async", "dcp-async", "topk-none", "topk"]
BASELINE = {"topk": "topk-none"}  # a configuration's baseline, when not "none"


# ------------------------------------------------------------------------------- child
def child(args: argparse.Namespace) -> None:
    """One run (``--child CONFIG``), with the package from ``--tree`` when given."""
    if args.tree:
        sys.path.insert(0, args.tree)
    import logging
    import warnings

    import lightning as L
    import torch
    import torch.distributed.checkpoint as dcp
    from gpt import GPT, make_loader
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from provenance import dir_usage

    import diffckpt
    from diffckpt.codecs import TopK
    from diffckpt.writer import BackgroundWriter
    from lightning_ckpt import DiffCheckpoint, DiffCheckpointIO
    from lightning_ckpt.compression import GradientCompression

    if args.tree:  # the package really is the one asked for
        assert os.path.abspath(diffckpt.__file__).startswith(os.path.abspath(args.tree)), diffckpt.__file__
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "diffckpt"):
        logging.getLogger(name).setLevel(logging.WARNING)
    writer_cpu = [0.0]
    run = BackgroundWriter._run

    def timed_run(self: Any) -> None:  # on the writer thread: its own CPU time
        start = time.thread_time()
        try:
            run(self)
        finally:
            writer_cpu[0] += time.thread_time() - start

    BackgroundWriter._run = timed_run  # type: ignore[method-assign]

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.t0 = self.cpu0 = self.t_loop_end = None
            self.writer: Any = None

        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
            # By now the checkpoint of the previous step was taken (checkpoint callbacks run last).
            if self.t0 is None and trainer.global_step == args.warmup:
                self.t0, self.cpu0 = time.perf_counter(), time.process_time()

        def on_train_end(self, trainer: Any, *_: Any) -> None:
            self.t_loop_end = time.perf_counter()
            for cb in trainer.callbacks:
                if isinstance(cb, DiffCheckpoint):
                    # The engine holds its writer in .recorder (before, it was the writer itself: --before)
                    self.writer = getattr(cb.engine, "recorder", cb.engine).writer  # readable after close

    class DcpAsyncEveryStep(L.Callback):
        def __init__(self, root: str) -> None:
            self.root, self.future = root, None

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *_: Any) -> None:
            if self.future is not None:
                self.future.result()
            sd = {"model": pl_module.state_dict(), "optimizer": trainer.optimizers[0].state_dict()}
            self.future = dcp.async_save(sd, checkpoint_id=os.path.join(self.root, f"step{trainer.global_step}"))

        def on_train_end(self, *_: Any) -> None:
            if self.future is not None:
                self.future.result()

    config = args.child
    workdir = tempfile.mkdtemp(prefix="bench-overhead-", dir=args.tmp)
    try:
        L.seed_everything(0, verbose=False)
        model = GPT(args.size, total_steps=args.steps)
        timer = Timer()
        callbacks: list[Any] = [timer]
        plugins: list[Any] = []
        if config == "diffckpt":
            callbacks.append(DiffCheckpoint(workdir))
            plugins.append(DiffCheckpointIO())
        elif config == "topk":
            callbacks.append(DiffCheckpoint(workdir, codec=TopK(0.01)))
            plugins.append(DiffCheckpointIO())
        elif config == "topk-none":
            callbacks.insert(0, GradientCompression(TopK(0.01)))
        elif config.startswith("lightning"):
            callbacks.append(ModelCheckpoint(dirpath=workdir, every_n_train_steps=1, save_top_k=-1))
            if config == "lightning-async":
                plugins.append(AsyncCheckpointIO())
        elif config == "dcp-async":
            callbacks.append(DcpAsyncEveryStep(workdir))
        trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            enable_checkpointing=config in ("diffckpt", "topk") or config.startswith("lightning"),
                            callbacks=callbacks, plugins=plugins)
        trainer.fit(model, train_dataloaders=make_loader(args.size))
        t_fit, cpu_fit = time.perf_counter(), time.process_time()
        assert timer.t0 is not None and timer.cpu0 is not None and timer.t_loop_end is not None
        nbytes, nfiles = dir_usage(workdir)
        out: dict[str, Any] = {"seconds": t_fit - timer.t0, "cpu": cpu_fit - timer.cpu0,
                               "tail": t_fit - timer.t_loop_end, "bytes": nbytes, "files": nfiles}
        if timer.writer is not None:
            s = timer.writer.stats
            out["writer"] = {"cpu": writer_cpu[0], "stall": s.stall_seconds, "write": s.write_seconds,
                             "segments": s.segments, "records": s.records, "raw": s.raw_record_bytes,
                             "seg_bytes": s.segment_bytes}
        with open(args.result, "w") as f:
            json.dump(out, f)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# ------------------------------------------------------------------------------ driver
def run_child(config: str, tree: str | None, args: argparse.Namespace) -> dict[str, Any]:
    fd, result = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", config, "--result", result,
               "--size", args.size, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--threads", str(args.threads)]
        cmd += ["--tree", tree] if tree else []
        cmd += ["--tmp", args.tmp] if args.tmp else []
        subprocess.run(cmd, check=True)
        with open(result) as f:
            return json.load(f)
    finally:
        os.unlink(result)


def plain_write(parent: str | None, nbytes: int = 256 << 20, chunk: int = 16 << 20) -> tuple[float, float]:
    """CPU and wall milliseconds per MB of writing ``nbytes`` to a file and fsyncing it: the cost
    of the storage itself, which no writer can go below (the page-cache copy in the kernel)."""
    data = os.urandom(chunk)
    fd, path = tempfile.mkstemp(dir=parent)
    try:
        cpu, wall = time.thread_time(), time.perf_counter()
        for _ in range(nbytes // chunk):
            os.write(fd, data)
        os.fsync(fd)
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    finally:
        os.close(fd)
        os.unlink(path)
    return cpu / (nbytes / 1e6) * 1e3, wall / (nbytes / 1e6) * 1e3


def med(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def render(results: dict[str, list[dict[str, Any]]], steps: int, warmup: int) -> list[str]:
    timed = steps - warmup
    lines = ["| config | median s | s/step | vs baseline | CPU s/step (all threads) | writer CPU ms/step "
             "| writer CPU ms/MB | tail s | bytes/step | files |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for config, runs in results.items():
        t = med(runs, "seconds")
        kind = config.split("@")[0]
        base_name = BASELINE.get(kind, "none")
        base = med(results[base_name], "seconds") if base_name in results else float("nan")
        writer = [r["writer"] for r in runs if "writer" in r]
        w_cpu = statistics.median(w["cpu"] for w in writer) if writer else None
        w_mb = statistics.median(w["seg_bytes"] for w in writer) / 1e6 if writer else 0.0
        cells = [config, f"{t:.2f}", f"{t / timed:.3f}",
                 f"{t / base:.3f}x" + ("" if base_name == "none" else f" ({base_name})"),
                 f"{med(runs, 'cpu') / timed:.3f}",
                 "-" if w_cpu is None else f"{w_cpu / steps * 1e3:.1f}",
                 "-" if w_cpu is None or not w_mb else f"{w_cpu / w_mb * 1e3:.2f}",
                 f"{med(runs, 'tail'):.2f}", f"{med(runs, 'bytes') / steps / 1e6:.2f} MB", str(runs[0]["files"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "All runs (s, in round order):", ""]
    for config, runs in results.items():
        lines.append(f"- {config}: " + " ".join(f"{r['seconds']:.2f}" for r in runs))
    return lines


NOTES = (
    "`median s`: timed steps plus the end of `fit` (final flush / async teardown). `vs baseline`: "
    "against `none`, or the baseline named. `CPU s/step`: the process's CPU time over the window "
    "(all threads; torch's OpenMP workers included) per timed step. `writer CPU`: diffckpt's writer "
    "thread (encoding, checksums, writes, fsync calls), per step and per MB of segments written. "
    "`tail s`: from the end of the last step until `fit` returned. `bytes/step`: bytes on disk after "
    "the run / steps. Every run is a fresh process. With torch threads = cores, background threads "
    "(diffckpt's writer, AsyncCheckpointIO's, DCP's) compete with the OpenMP workers."
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of every run")
    ap.add_argument("--size", default="bench")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    ap.add_argument("--before", metavar="REV", help="also run diffckpt and topk with the package at commit REV")
    ap.add_argument("--tmp", help="parent of the temp run dirs (default: the system temp dir; use local disk)")
    ap.add_argument("--out", help="Markdown report path")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run: demo size, 10 steps, 1 round")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if args.quick:
        args.size, args.steps, args.rounds = "demo", 10, 1
    from gpt import GPT, SIZES
    from provenance import checkout, header, report_path, write_report

    configs = args.configs.split(",")
    unknown = set(configs) - set(CONFIGS)
    if unknown or "none" not in configs:
        sys.exit(f"--configs must include 'none' and only use {CONFIGS}")
    if args.steps <= args.warmup:
        sys.exit("--steps must exceed --warmup")
    trees: dict[str, str | None] = dict.fromkeys(configs)
    before = checkout(args.before, args.tmp) if args.before else None
    if before is not None:
        for c in ("diffckpt", "topk"):
            if c in configs:
                trees[f"{c}@{args.before}"] = before
    import lightning as L
    import torch

    torch.set_num_threads(args.threads)
    cfg = SIZES[args.size]
    n_params = sum(p.numel() for p in GPT(args.size).parameters())
    started = time.perf_counter()
    info = [*header(f"lightning {L.__version__}"),
            f"- model: GPT '{args.size}', {n_params / 1e6:.2f}M parameters (fp32), batch {cfg.batch_size} x "
            f"{cfg.ctx} tokens, AdamW + OneCycleLR, gradient clipping",
            f"- {args.steps} optimizer steps per run, first {args.warmup} untimed; {args.rounds} interleaved "
            f"rounds, a fresh process per run; temp dirs under {args.tmp or 'the system temp dir'}"]
    if before is not None:
        info.append(f"- `@{args.before}`: the package as committed at {args.before}, same script and workload")
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in trees}
    order = list(trees)
    try:
        run_child("none", None, args)  # untimed: fills the page cache with the imports and data
        for rnd in range(args.rounds):
            for config in order if rnd % 2 == 0 else reversed(order):
                r = run_child(config.split("@")[0], trees[config], args)
                results[config].append(r)
                print(f"round {rnd + 1}/{args.rounds} {config:22s} {r['seconds']:7.2f} s  tail {r['tail']:.2f} s "
                      f"{r['bytes'] / 1e6:8.1f} MB", flush=True)
    finally:
        if before is not None:
            shutil.rmtree(before, ignore_errors=True)
    table = render(results, args.steps, args.warmup)
    write_cpu, write_wall = plain_write(args.tmp)
    table += ["", f"The storage itself (a plain `os.write` of 256 MB in 16 MB chunks, then fsync, to the same "
              f"file system): CPU {write_cpu:.2f} ms/MB, wall {write_wall:.2f} ms/MB."]
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    info.append(f"- bench wall time {(time.perf_counter() - started) / 60:.1f} min; load average after it {load}")
    out = report_path(args.out, "overhead", args.quick)
    write_report(out, ["# Checkpointing overhead per training step", "", *info, "", *table, "", NOTES, ""])
    print("\n" + "\n".join(table))
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
