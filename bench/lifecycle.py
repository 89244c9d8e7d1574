"""Retention and compaction over a run's life: step times, storage and restore, in one run.

A plain PyTorch loop trains the GPT of ``examples/gpt.py`` (AdamW + OneCycleLR, gradient
clipping, one torch thread so that a core is left for the writer and the maintenance thread)
for ``--steps`` steps through the core ``CheckpointEngine`` on local disk (a fresh temp dir per
run), as an adapter drives it: ``start`` and the starting base at step 0, then after every
optimizer step ``record_step`` (with the small state when ``wants_state``) and ``write_base``
when ``wants_base``; ``close()`` at the end. Every step is restorable, ``write_batch`` 8.
Configurations, each from the same seed and data:

1. ``no checkpointing``: the same loop without an engine, the baseline;
2. ``training bases``: ``base_every_n_steps=--every`` (the training thread copies a full base);
3. ``compacted bases``: ``base_every_n_steps=None, compact_every_n_steps=--every`` (after the
   starting base, bases come from the background thread replaying stored diffs);
4. 2 + ``retention=RetentionPolicy(keep_last_bases=2)``;
5. 3 + ``retention=RetentionPolicy(keep_last_bases=2)``.

Measured per run, over the steps after ``--warmup``: the wall time of every step (batch,
forward, backward, optimizer, engine calls), its mean, p50, p99 and max (a full base copied on
the training thread shows in the max); ``close()`` apart (the final flush and the last
retention pass). At the end: bytes on storage (the sum of the run root's file sizes) and the
file count; bases written by training and by compaction (the writer's count, and the
maintenance thread's), and bases left on storage by kind (a ``COMMIT`` marker with a
``compacted`` key was written by compaction); the background thread's compaction seconds; and
the restore of the newest step (``CheckpointEngine(root).restore`` into a fresh model and
optimizer, median of 3, steps replayed, checked bit-exact against the trained model).

``--rounds`` rounds, the order reversed every other round; step times are pooled over the
rounds, and ``vs baseline`` is the pooled mean step time / the baseline's. Storage, bases and
restore come from the last round (compaction targets depend on thread timing; all runs are
listed under the table).

    python bench/lifecycle.py [--steps 300] [--every 50] [--rounds 2] [--threads 1] [--quick]

Writes ``bench/results/lifecycle.md`` (``lifecycle-quick.md`` with ``--quick``: the tiny model,
60 steps, bases every 20, one round).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

from gpt import GPT, SIZES, make_loader, plain_step
from provenance import dir_usage, header, report_path, write_report

from diffckpt import CheckpointEngine, CheckpointOptions, FsspecStorage, RetentionPolicy
from diffckpt.format import decode_commit
from diffckpt.runstore import RunStore

WRITE_BATCH = 8
RESTORES = 3
KEEP = RetentionPolicy(keep_last_bases=2)


@dataclass(frozen=True)
class Config:
    """One configuration: a label and the engine options (``None``: no checkpointing)."""

    name: str
    options: CheckpointOptions | None
    without_retention: str | None = None  # the configuration this one adds retention to


def configs(every: int) -> list[Config]:
    """The five configurations of the module docstring, bases every ``every`` steps."""
    trained = CheckpointOptions(write_batch=WRITE_BATCH, base_every_n_steps=every)
    compacted = CheckpointOptions(write_batch=WRITE_BATCH, base_every_n_steps=None,
                                  compact_every_n_steps=every)
    return [
        Config("no checkpointing", None),
        Config(f"training bases (base_every_n_steps={every})", trained),
        Config(f"compacted bases (compact_every_n_steps={every})", compacted),
        Config("training bases + keep_last_bases=2", _with_retention(trained),
               f"training bases (base_every_n_steps={every})"),
        Config("compacted bases + keep_last_bases=2", _with_retention(compacted),
               f"compacted bases (compact_every_n_steps={every})"),
    ]


def _with_retention(options: CheckpointOptions) -> CheckpointOptions:
    return dataclasses.replace(options, retention=KEEP)


# ------------------------------------------------------------------------------ one run
def batches(size: str) -> Iterator[torch.Tensor]:
    loader = make_loader(size)
    while True:
        yield from loader


def new_model(args: argparse.Namespace) -> tuple[GPT, Any, Any]:
    model = GPT(args.size, total_steps=args.steps)
    conf = model.configure_optimizers()
    return model, conf["optimizer"], conf["lr_scheduler"]["scheduler"]


def state_of(step: int, sched: Any) -> dict[str, Any]:
    """The small framework state of a restorable step: counter, scheduler, torch RNG."""
    return {"step": step, "scheduler": sched.state_dict(), "rng": torch.get_rng_state()}


def checkpointed_step(engine: CheckpointEngine, step: int, model: GPT, opt: Any,
                      sched: Any) -> None:
    """What an adapter does after ``optimizer.step()``: record the step, and queue a base when
    the engine wants one (the full copy that training-written bases cost)."""
    if engine.recorder.review_due(step):
        engine.recorder.review(step)
    wants_base = engine.wants_base(step)
    state = state_of(step, sched) if wants_base or engine.wants_state(step) else None
    engine.record_step(step, state)
    if wants_base:
        engine.write_base(step, model.state_dict(), [opt.state_dict()], state)


def run_once(config: Config, args: argparse.Namespace) -> dict[str, Any]:
    """Train ``args.steps`` steps under ``config`` into a fresh temp dir (deleted afterwards) and
    measure what the module docstring lists."""
    torch.manual_seed(0)
    model, opt, sched = new_model(args)
    data = batches(args.size)
    root = tempfile.mkdtemp(prefix="bench-lifecycle-", dir=args.tmp)
    engine = maintenance = writer = None
    try:
        if config.options is not None:
            engine = CheckpointEngine(FsspecStorage(root), config.options)
            engine.start(model, [opt], 0)
            writer, maintenance = engine.recorder.writer, engine.recorder.maintenance  # readable after close()
            engine.write_base(0, model.state_dict(), [opt.state_dict()], state_of(0, sched))
        times, cpu = [], 0.0
        for step in range(1, args.steps + 1):
            start, cpu_start = time.perf_counter(), time.thread_time()
            plain_step(model, opt, sched, next(data))
            if engine is not None:
                checkpointed_step(engine, step, model, opt, sched)
            if step > args.warmup:
                times.append(time.perf_counter() - start)
                cpu += time.thread_time() - cpu_start
        start = time.perf_counter()
        if engine is not None:
            engine.close()
        out: dict[str, Any] = {"times": times, "cpu_s": cpu, "close_s": time.perf_counter() - start}
        if engine is None or writer is None:
            return out
        compactions = maintenance.compactions if maintenance else []
        out.update(dict(zip(("bytes", "files"), dir_usage(root))), on_storage=bases_on_storage(root),
                   by_training=writer.stats.bases,
                   by_compaction=sum(1 for c in compactions if c["written"]),
                   compaction_s=sum(c["seconds"] for c in compactions),
                   deleted=sum(c["objects"] for c in maintenance.collections) if maintenance else 0,
                   errors=list(maintenance.errors) if maintenance else [],
                   **time_restore(root, args, model, opt))
        return out
    finally:
        if engine is not None and engine.recorder.writer is not None:
            engine.close()
        shutil.rmtree(root, ignore_errors=True)
        del model, opt, sched, engine, maintenance, writer
        gc.collect()


def bases_on_storage(root: str) -> dict[str, int]:
    """Committed bases left in the run root, by who wrote them: a ``COMMIT`` marker with a
    ``compacted`` key comes from compaction, any other from training."""
    store = RunStore(FsspecStorage(root))
    out = {"training": 0, "compaction": 0}
    for base in store.inventory().bases:
        info = decode_commit(store.storage.read(base.commit_path), base.commit_path)
        out["compaction" if "compacted" in info else "training"] += 1
    return out


def time_restore(root: str, args: argparse.Namespace, model: GPT, opt: Any) -> dict[str, Any]:
    """Restore the newest step into a fresh model and optimizer ``RESTORES`` times (median),
    and check the last one against the trained ``model`` and ``opt`` (the newest step is the
    last one trained, so they must match bit for bit)."""
    seconds, result, fresh = [], None, None
    for _ in range(RESTORES):
        fresh = new_model(args)
        start = time.perf_counter()
        result = CheckpointEngine(root).restore(fresh[0], [fresh[1]])
        seconds.append(time.perf_counter() - start)
    assert result is not None and fresh is not None
    return {"restore_s": statistics.median(seconds), "restore_step": result.step,
            "restore_base": result.base_step, "replayed": result.replayed,
            "exact": same_state(model, opt, fresh[0], fresh[1])}


def same_state(model: GPT, opt: Any, other: GPT, other_opt: Any) -> bool:
    """Whether two models and their optimizers hold equal tensors."""
    if any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  other.state_dict().values(), strict=True)):
        return False
    mine, theirs = opt.state_dict()["state"], other_opt.state_dict()["state"]
    return mine.keys() == theirs.keys() and all(
        torch.equal(torch.as_tensor(v), torch.as_tensor(theirs[k][name]))
        for k in mine for name, v in mine[k].items())


# ------------------------------------------------------------------------------ report
def step_stats(times: list[float]) -> dict[str, float]:
    """Mean, p50, p99 and max of step times (nearest-rank percentiles)."""
    ordered = sorted(times)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]

    return {"mean": statistics.fmean(ordered), "p50": pct(0.5), "p99": pct(0.99),
            "max": ordered[-1]}


def render(cfgs: list[Config], results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The Markdown table: one row per configuration."""
    base = step_stats([t for r in results[cfgs[0].name] for t in r["times"]])["mean"]
    cpu_base = _cpu_per_step(results[cfgs[0].name])
    lines = ["| configuration | mean step ms | vs baseline | training-thread CPU ms | vs baseline "
             "| p50 ms | p99 ms | max ms | close s "
             "| bytes on storage | files | vs no retention | bases by training / compaction "
             "(on storage at the end) | compaction s (background) | restore newest s | replayed "
             "(from base) | bit-exact |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for c in cfgs:
        runs = results[c.name]
        s = step_stats([t for r in runs for t in r["times"]])
        last = runs[-1]
        cpu = _cpu_per_step(runs)
        cells = [c.name, f"{1e3 * s['mean']:.1f}", f"{s['mean'] / base:.3f}x", f"{1e3 * cpu:.1f}",
                 f"{cpu / cpu_base:.3f}x", f"{1e3 * s['p50']:.1f}",
                 f"{1e3 * s['p99']:.1f}", f"{1e3 * s['max']:.1f}", f"{last['close_s']:.2f}"]
        if c.options is None:
            cells += ["-"] * 8
        else:
            ratio = "-"
            if c.without_retention is not None:
                ratio = f"{last['bytes'] / results[c.without_retention][-1]['bytes']:.2f}x"
            kept = last["on_storage"]
            cells += [f"{last['bytes'] / 1e6:.1f} MB", str(last["files"]), ratio,
                      f"{last['by_training']} / {last['by_compaction']} "
                      f"({kept['training']} / {kept['compaction']})",
                      f"{last['compaction_s']:.2f}", f"{last['restore_s']:.3f}",
                      f"{last['replayed']} (step {last['restore_base']})",
                      "yes" if last["exact"] else "**no**"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _cpu_per_step(runs: list[dict[str, Any]]) -> float:
    """Training-thread CPU seconds per timed step, pooled over runs: unlike wall time, it leaves
    out time the thread waited for a core or the GIL (other processes, the writer, compaction)."""
    return sum(r["cpu_s"] for r in runs) / sum(len(r["times"]) for r in runs)


def all_runs(cfgs: list[Config], results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """One line per configuration listing every run: mean step ms, and for checkpointed runs
    the storage and bases, which may differ by round (compaction targets follow thread timing)."""
    lines = []
    for c in cfgs:
        parts = []
        for r in results[c.name]:
            text = (f"{1e3 * statistics.fmean(r['times']):.1f} ms "
                    f"({1e3 * r['cpu_s'] / len(r['times']):.1f} ms CPU)")
            if c.options is not None:
                text += (f" / {r['bytes'] / 1e6:.1f} MB"
                         f" / bases {r['by_training']}+{r['by_compaction']}"
                         f" / {r['deleted']} objects deleted")
                if r["errors"]:
                    text += f" / maintenance errors: {r['errors']}"
            parts.append(text)
        lines.append(f"- {c.name}: " + "; ".join(parts))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=50,
                    help="base_every_n_steps / compact_every_n_steps")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of every run")
    ap.add_argument("--size", default="demo", choices=sorted(SIZES))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--tmp", help="parent of the temp run dirs (default: the system temp dir)")
    ap.add_argument("--out", help="Markdown report path")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tiny model, 60 steps, bases every 20")
    args = ap.parse_args()
    if args.quick:
        args.size, args.steps, args.every, args.rounds = "tiny", 60, 20, 1
    out = report_path(args.out, "lifecycle", args.quick)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("diffckpt").setLevel(logging.ERROR)

    cfgs = configs(args.every)
    n_params = sum(p.numel() for p in GPT(args.size).parameters())
    cfg = SIZES[args.size]
    info = [
        *header("core engine, plain PyTorch loop"),
        f"- model: GPT '{args.size}', {n_params / 1e6:.2f}M parameters (fp32), "
        f"batch {cfg.batch_size} x {cfg.ctx} tokens, AdamW + OneCycleLR, gradient clipping",
        f"- {args.steps} optimizer steps per run, first {args.warmup} untimed; "
        f"every step restorable, write_batch {WRITE_BATCH}; {args.rounds} round(s), order "
        "reversed every other round; "
        "storage: local disk (a temp dir per run)",
    ]
    t_start = time.perf_counter()
    run_once(cfgs[1], argparse.Namespace(**{**vars(args), "steps": 10}))  # warm the process up
    results: dict[str, list[dict[str, Any]]] = {c.name: [] for c in cfgs}
    for rnd in range(args.rounds):
        for c in cfgs if rnd % 2 == 0 else list(reversed(cfgs)):
            r = run_once(c, args)
            results[c.name].append(r)
            extra = "" if c.options is None else (
                f", {r['bytes'] / 1e6:.1f} MB, bases {r['by_training']}+{r['by_compaction']}, "
                f"restore {r['restore_s']:.3f} s ({r['replayed']} replayed, exact {r['exact']})")
            mean = 1e3 * statistics.fmean(r["times"])
            print(f"round {rnd + 1}/{args.rounds} {c.name:48s} mean {mean:6.1f} ms, "
                  f"max {1e3 * max(r['times']):6.1f} ms{extra}", flush=True)
    table = render(cfgs, results)
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    info.append(f"- whole benchmark {time.perf_counter() - t_start:.0f} s; "
                f"load average after it {load}")
    notes = [
        "",
        "Step times are wall seconds of each timed step (batch, forward, backward, optimizer, "
        "engine calls), pooled over the rounds; `vs baseline`: mean / the mean without "
        "checkpointing. `training-thread CPU ms`: `time.thread_time()` of the training thread "
        "per timed step, pooled; the gap to wall time is time it waited for a core or for the "
        "GIL (other processes, the writer thread, the maintenance thread). `close s`: "
        "`engine.close()` (the final flush, then the maintenance "
        "thread finishes the job under way and runs a last retention pass). Bytes and files: "
        "everything under the run root after `close()`. Bases: written during the run by the "
        "training thread (the starting base at step 0 included) / by background compaction; in "
        "parentheses those still on storage, told apart by the `compacted` key of their "
        "`COMMIT` markers. `vs no retention`: bytes / the same configuration's without retention. "
        "`compaction s`: seconds the background thread spent compacting (replay + base write), "
        "on the same cores as training. `restore newest s`: `CheckpointEngine(root).restore"
        f"(model, [optimizer])` of the newest step into a fresh model, median of {RESTORES}; "
        "`bit-exact`: the restored model and AdamW state equal the trained ones (`torch.equal`). "
        "Storage, bases and restore are from the last round.",
        "",
        "All runs (mean step (training-thread CPU) / bytes on storage / bases by "
        "training+compaction / objects deleted "
        "by retention), in round order:",
        "",
        *all_runs(cfgs, results),
    ]
    report = ["# Retention and compaction: step times, storage and restore", "", *info, "", *table,
              *notes, ""]
    print("\n" + "\n".join(table))
    write_report(out, report)
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
