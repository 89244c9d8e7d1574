"""Per-step overhead and bytes of checkpointing a transformers ``Trainer`` run on CPU.

One process, interleaved rounds (the order alternates each round), each run in a fresh temp dir,
the same ``Trainer`` (a GPT-2 built from a config, no downloads; synthetic token rows; dropout
on; AdamW and a linear schedule as the Trainer sets them up; one epoch of ``--steps`` steps):

1. ``none``: ``save_strategy="no"``, the baseline;
2. ``diffckpt``: ``DiffCheckpointCallback(run_root)`` with its defaults (a step record every
   step), on local disk;
3. ``trainer-save-1``: the Trainer's own ``save_strategy="steps", save_steps=1`` (model,
   optimizer, scheduler, RNG and trainer state every step);
4. ``trainer-save-N``: the same every ``--save-steps`` steps (default 50);
5. ``dcp-async``: ``torch.distributed.checkpoint.async_save`` of the model and optimizer state
   dicts every step from a callback's ``on_step_end`` (each save first waits for the previous
   one's future, as its docs ask and as ``bench/accelerate_loop.py`` does).

Timed: the wall clock between consecutive ``on_step_end`` events (a callback that runs before
every other one), after ``--warmup`` untimed steps. Step k's checkpoint work (the Trainer's save
after ``on_step_end``, diffckpt's commit at the next ``on_step_begin``, DCP's ``async_save``)
falls in the interval that ends at step k+1's ``on_step_end``, so ``s/step`` (their mean over
the timed steps) carries every variant's cost, periodic saves included. ``tail``: from the last
``on_step_end`` until ``train()`` returns: the last step's save (the Trainer also saves at
``max_steps``), diffckpt's final commit and flush, the last DCP future.

    python bench/transformers_trainer.py [--steps 55] [--rounds 5] [--threads 1] [--quick]

Writes ``bench/results/transformers.md`` (``transformers-quick.md`` with --quick).
"""

from __future__ import annotations

import argparse
import gc
import glob
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import transformers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

from provenance import dir_usage, header, report_path, write_report

from transformers_ckpt import DiffCheckpointCallback

SIZE = {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 4096, "n_positions": 128}


def configs(save_steps: int) -> list[str]:
    return ["none", "diffckpt", "trainer-save-1", f"trainer-save-{save_steps}", "dcp-async"]


class Rows(torch.utils.data.Dataset):
    """Synthetic token rows, the labels the inputs (the model shifts them)."""

    def __init__(self, n: int, ctx: int, vocab: int) -> None:
        self.x = torch.randint(0, vocab, (n, ctx), generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class StepClock(TrainerCallback):
    """Wall clock at every ``on_step_end``; first in the callback list, so before any other work."""

    def __init__(self, diff: DiffCheckpointCallback | None = None) -> None:
        self.ends: list[float] = []
        self.cpu: list[float] = []  # process CPU time, all threads (the writers' too)
        self.threads = 0
        self.diff = diff
        self.writer: Any = None

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        self.threads = torch.get_num_threads()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.ends.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def on_train_end(self, args, state, control, **kwargs) -> None:
        if self.diff is not None:  # before diffckpt's on_train_end closes it; the stats stay readable
            self.writer = self.diff.engine.recorder.writer


class DcpAsyncEveryStep(TrainerCallback):
    """``dcp.async_save`` of the model and optimizer state dicts after every optimizer step."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.future: Any = None
        self.saves = 0

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs) -> None:
        if self.future is not None:
            self.future.result()
        opt = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
        sd = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        self.future = dcp.async_save(sd, checkpoint_id=os.path.join(self.root, f"step{state.global_step}"))
        self.saves += 1

    def on_train_end(self, args, state, control, **kwargs) -> None:
        if self.future is not None:
            self.future.result()


def time_calls(obj: Any, name: str, calls: list[tuple[float, float]]) -> None:
    """Shadow ``obj.name`` with a wrapper that appends ``(end, seconds)`` of every call to ``calls``."""
    method = getattr(obj, name)

    def timed(*a: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*a, **kw)
        finally:
            end = time.perf_counter()
            calls.append((end, end - start))

    setattr(obj, name, timed)


def run_once(config: str, args: argparse.Namespace, steps: int) -> dict[str, Any]:
    workdir = tempfile.mkdtemp(prefix=f"bench-{config}-", dir=args.tmp)
    try:
        out_dir, run_root = os.path.join(workdir, "out"), os.path.join(workdir, "run")
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(**SIZE, bos_token_id=0, eos_token_id=0))
        diff = DiffCheckpointCallback(run_root) if config == "diffckpt" else None
        clock = StepClock(diff)
        callbacks: list[Any] = [clock]
        dcp_cb = None
        save: dict[str, Any] = {"save_strategy": "no"}
        if diff is not None:
            callbacks.append(diff)
        elif config.startswith("trainer-save-"):
            save = {"save_strategy": "steps", "save_steps": int(config.rsplit("-", 1)[1])}
        elif config == "dcp-async":
            dcp_cb = DcpAsyncEveryStep(run_root)
            callbacks.append(dcp_cb)
        targs = TrainingArguments(
            output_dir=out_dir, use_cpu=True, per_device_train_batch_size=args.batch, max_steps=steps,
            learning_rate=1e-3, warmup_steps=2, max_grad_norm=1.0, logging_steps=10**6, seed=42,
            report_to="none", disable_tqdm=True, dataloader_num_workers=0, **save)
        trainer = Trainer(model=model, args=targs, train_dataset=Rows(steps * args.batch, args.ctx, SIZE["vocab_size"]),
                          callbacks=callbacks)
        trainer.remove_callback(PrinterCallback)  # the final metrics line, printed with disable_tqdm
        # The training thread's time in checkpoint calls: diffckpt commits at on_step_begin, the
        # DCP callback waits and stages at on_step_end, the Trainer saves in _save_checkpoint.
        calls: list[tuple[float, float]] = []
        if diff is not None:
            time_calls(diff, "on_step_begin", calls)
        elif dcp_cb is not None:
            time_calls(dcp_cb, "on_step_end", calls)
        elif config != "none":
            time_calls(trainer, "_save_checkpoint", calls)
        trainer.train()
        t_done = time.perf_counter()
        ends = clock.ends
        assert len(ends) == steps, (len(ends), steps)
        gaps = [b - a for a, b in zip(ends[args.warmup - 1:], ends[args.warmup:])]
        r: dict[str, Any] = {"step": (ends[-1] - ends[args.warmup - 1]) / len(gaps),
                             "median_gap": statistics.median(gaps), "tail": t_done - ends[-1],
                             "cpu": (clock.cpu[-1] - clock.cpu[args.warmup - 1]) / len(gaps),
                             "blocked": sum(d for end, d in calls if ends[args.warmup - 1] < end <= ends[-1]) / len(gaps),
                             "threads": clock.threads, "optim": str(getattr(targs.optim, "value", targs.optim))}
        if diff is not None:
            assert diff.durable_step == steps, (diff.durable_step, steps)  # every step was recorded
            r["bytes_step"] = dir_usage(run_root)[0] / steps
            s = clock.writer.stats
            r["writer"] = {"records": s.records, "segments": s.segments, "bases": s.bases,
                           "write": s.write_seconds, "stall": s.stall_seconds,
                           "seg_bytes": s.segment_bytes, "base_bytes": s.base_bytes}
        elif config.startswith("trainer-save-"):
            folders = glob.glob(os.path.join(out_dir, "checkpoint-*"))
            assert len(folders) == steps // save["save_steps"] + bool(steps % save["save_steps"]), folders
            per_save = sum(dir_usage(f)[0] for f in folders) / len(folders)
            r["bytes_step"] = per_save / save["save_steps"]
            r["per_save"] = per_save
        elif dcp_cb is not None:
            r["bytes_step"] = dir_usage(run_root)[0] / dcp_cb.saves
            r["per_save"] = r["bytes_step"]
        else:
            r["bytes_step"] = dir_usage(workdir)[0] / steps
        return r
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        gc.collect()


def render(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> list[str]:
    def med(runs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    none = results["none"]
    base = med(none, "step")
    lines = ["| variant | median s/step | vs none | vs none, per round | median step interval s | in checkpoint "
             "calls s/step | CPU s/step | tail s | bytes/step |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for config, runs in results.items():
        paired = statistics.median(r["step"] / n["step"] for r, n in zip(runs, none))
        lines.append(f"| {config} | {med(runs, 'step'):.3f} | {med(runs, 'step') / base:.2f}x | {paired:.2f}x | "
                     f"{med(runs, 'median_gap'):.3f} | {med(runs, 'blocked'):.3f} | {med(runs, 'cpu'):.3f} | {med(runs, 'tail'):.2f} | "
                     f"{med(runs, 'bytes_step') / 1e6:.2f} MB |")
    per_save = [med(runs, "per_save") for c, runs in results.items() if c.startswith("trainer-save-")]
    if per_save:
        lines += ["", f"One Trainer checkpoint folder (model safetensors, optimizer, scheduler, RNG, "
                      f"trainer state): {per_save[0] / 1e6:.2f} MB."]
    writer = [r["writer"] for r in results.get("diffckpt", [])]
    if writer:
        w = {k: statistics.median(x[k] for x in writer) for k in writer[0]}
        lines += ["", f"diffckpt writer (median per run): {w['records']:.0f} records in {w['segments']:.0f} "
                      f"segments ({w['seg_bytes'] / w['records'] / 1e6:.2f} MB a step record), {w['bases']:.0f} "
                      f"base(s) ({w['base_bytes'] / 1e6:.2f} MB), write time {w['write']:.2f} s, training stalled on "
                      f"a full queue {w['stall']:.2f} s."]
    lines += ["", "Per run, in round order (s/step):", ""]
    lines += [f"- {c}: " + " ".join(f"{r['step']:.3f}" for r in runs) for c, runs in results.items()]
    return lines


NOTES = (
    "`median s/step`: per run, the mean wall clock between consecutive `on_step_end` events over "
    "the timed steps (so periodic saves count, amortized); the median over rounds. `median step "
    "interval`: the median of those intervals within a run (the typical step: it hides a save "
    "every 50 steps), median over rounds. `vs none, per round`: the median over rounds of the run's "
    "s/step over the same round's `none` (less sensitive to load that drifts between rounds). "
    "`in checkpoint calls`: the training thread's time in diffckpt's `on_step_begin` (the commit), "
    "the DCP callback's `on_step_end` (waiting for the previous save, staging, `async_save`) or "
    "the Trainer's `_save_checkpoint`, over the timed steps, per step. "
    "`CPU s/step`: the process's CPU time (every thread: training, writer threads) over the same "
    "window, per step. `tail`: last `on_step_end` to `train()` returning, not "
    "in s/step; the Trainer's variants save at `max_steps` there too. `bytes/step`: diffckpt: the "
    "bytes in the run root / steps; Trainer: one `checkpoint-N` folder / `save_steps`; DCP: the "
    "bytes of all saves / saves."
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=55, help="optimizer steps per run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of every run")
    ap.add_argument("--save-steps", type=int, default=50, help="save_steps of the sparse Trainer variant")
    ap.add_argument("--batch", type=int, default=4, help="rows per step")
    ap.add_argument("--ctx", type=int, default=64, help="tokens per row")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a core for writers)")
    ap.add_argument("--configs", help="comma-separated subset (default: all, 'none' required)")
    ap.add_argument("--tmp", help="parent of the temp run dirs (default: the system temp dir; use local disk)")
    ap.add_argument("--out", help="Markdown report path")
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 steps, 3 untimed, 1 round, no warm-up runs")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup, args.rounds = 8, 3, 1
    every = configs(args.save_steps)
    chosen = args.configs.split(",") if args.configs else every
    if set(chosen) - set(every) or "none" not in chosen:
        sys.exit(f"--configs must include 'none' and only use {every}")
    if args.warmup < 1 or args.steps <= args.warmup:
        sys.exit("--warmup must be at least 1 and below --steps")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # save_pretrained's "Writing model shards"
    for name in ("diffckpt", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)

    n_params = sum(p.numel() for p in GPT2LMHeadModel(GPT2Config(**SIZE)).parameters())
    tmp = args.tmp or tempfile.gettempdir()
    for config in [] if args.quick else chosen:  # warm the process up: imports, allocator, first saves
        run_once(config, args, args.warmup + 2)
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in chosen}
    for rnd in range(args.rounds):
        for config in chosen if rnd % 2 == 0 else list(reversed(chosen)):
            r = run_once(config, args, args.steps)
            results[config].append(r)
            print(f"round {rnd + 1}/{args.rounds} {config:18s} {r['step']:.3f} s/step  median interval "
                  f"{r['median_gap']:.3f} s  in ckpt {r['blocked']:.3f} s  CPU {r['cpu']:.3f} s/step  tail {r['tail']:.2f} s  {r['bytes_step'] / 1e6:8.2f} MB/step", flush=True)
    first = results["none"][0]
    info = [*header(f"transformers {transformers.__version__}"),
            (f"- model: `GPT2LMHeadModel` from a config ({', '.join(f'{k}={v}' for k, v in SIZE.items())}), "
             f"{n_params / 1e6:.2f}M parameters (fp32), dropout on; batch {args.batch} x {args.ctx} tokens; "
             f"the Trainer's AdamW (`optim={first['optim']}`), linear schedule, clipping; `use_cpu=True`, one "
             f"process, torch threads in training {first['threads']}"),
            (f"- {args.steps} optimizer steps per run, first {args.warmup} untimed; {args.rounds} interleaved "
             f"rounds; temp dirs under {'the system temp dir' if args.tmp is None else tmp}")]
    table = render(results, args)
    print("\n" + "\n".join(table))
    out = report_path(args.out, "transformers", args.quick)
    again = " ".join(sys.argv[1:])
    write_report(out, ["# Checkpointing a transformers Trainer run", "", *info, "", *table, "", NOTES, "",
                       f"Reproduce: `.venv/bin/python bench/transformers_trainer.py{' ' + again if again else ''}` "
                       "(`make bench` runs it with `--threads 1`).", ""])
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
