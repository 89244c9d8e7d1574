"""Restore time versus chain length: diffckpt's replay against loading a full Lightning checkpoint.

A plain PyTorch loop trains the GPT of ``examples/gpt.py`` (AdamW + OneCycleLR, gradient
clipping) for ``--steps`` steps through the core ``CheckpointEngine`` on local disk (a temp dir),
every step recorded and restorable, ``write_batch`` 8, ``base_every_n_steps=None``: one base at
step 0 and only diffs after it. Restoring step N then replays N diffs. At each step measured
(chain lengths 0, 10, 100 and 1000), the loop also keeps a copy of the true model and optimizer
state and writes a Lightning checkpoint of it: Lightning's own dict (``state_dict``,
``optimizer_states``, ``lr_schedulers``, loops, hyperparameters) saved by ``TorchCheckpointIO``,
which is what ``Trainer.save_checkpoint`` does on one device.

Timed, each into a fresh model and optimizer built beforehand:

- ``diffckpt``: ``CheckpointEngine(run).restore(model, [optimizer], step=N)``: listing, plan, base
  read and checksum, replay of N steps (fingerprints checked every 50 steps, as recorded). The
  restored tensors are compared with the kept truth (``torch.equal``) after the clock stops.
- ``lightning``: ``TorchCheckpointIO().load_checkpoint(path)`` (``torch.load``) +
  ``model.load_state_dict`` + ``optimizer.load_state_dict``, what a Lightning resume does for
  those tensors.
- ``limit``: what replay cannot go below, for the same step, model, optimizer and thread count:
  one full-state load plus N bare ``optimizer.step()`` calls on gradients already in memory.
  The base's model and optimizer states are saved with ``torch.save`` next to the run, untimed.
  Timed: ``torch.load`` of that file (the page cache warm, as for the restores) +
  ``model.load_state_dict`` + ``optimizer.load_state_dict``, then per step the param groups'
  hyperparameters set, every ``.grad`` pointed at a gradient already in memory, and ``step()``.
  The gradients are the run's recorded ones as replay installs them (for the TopK run, the
  dense gradients the codec decoded to, clipped as in training), with the hyperparameters in
  force at each step: a restore in another thread clones them in a step pre-hook,
  ``--limit-chunk`` steps at a time, while the limit's clock is stopped and waits between
  chunks. The limit's parameters and moments are checked bitwise against the state trained: it
  is the same computation as the restore, step for step.

Every measurement is repeated ``--repeats`` times, interleaved (the order reverses every other
repeat), and the median is reported. The page cache is warm unless a row says ``cold``: then every
file of the run (or the Lightning checkpoint) is dropped from the page cache first
(``posix_fadvise(DONTNEED)``; the disk's own cache, if the machine is virtual, stays). For the
longest chain, prefetching (segments read and decoded ahead of replay, ``diffckpt.recordreads.
PREFETCH_SEGMENTS``, 4 by default) is compared with none (0). Unless ``--no-codec``, a second run
trains with ``TopK(0.01)`` compressed gradients (the payloads are the diffs) and its longest chain
is restored for every chain length too (prefetch on). Every restore is compared with the limit
of its step, measured in the same process and interleaved with it.

    python bench/restore.py [--steps 1000] [--repeats 3] [--size bench] [--threads 1]
                            [--limit-chunk 100] [--no-codec] [--before REV] [--quick]

``--before REV`` first runs the restores and limits of the last table with the package as
committed at ``REV`` (a ``git archive``, first on a child process's ``sys.path``; the child trains
its own runs, in that commit's format), then everything with the package as it is, and reports
both ratios side by side.

Writes ``bench/results/restore.md`` (``restore-quick.md`` with ``--quick``: the tiny model, 30
steps, one repeat).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch.nn import functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# ``--tree DIR`` (a ``--before`` child): the package from DIR, so it must come first on the path
# before anything imports it.
TREE = next((sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "--tree"), None)
sys.path[:0] = [*([TREE] if TREE else []), ROOT, os.path.join(ROOT, "examples")]

from gpt import GPT, SIZES, make_loader
from provenance import checkout, header, report_path, write_report

import diffckpt.recordreads
from diffckpt import CheckpointEngine, CheckpointOptions, GradientCompressor
from diffckpt.capture import clone_tree
from diffckpt.codecs import TopK
from diffckpt.runstore import RunStore

try:
    from diffckpt.planning import plan as plan_step
except ImportError:  # a --before child runs the package as committed before planning.py existed
    def plan_step(store: RunStore, step: int, inv: Any) -> Any:
        return store.plan(step, inv)

CHAINS = (0, 10, 100, 1000)
WRITE_BATCH = 8
LIMIT_CHUNK = 100


@dataclass
class Run:
    """A trained run root, what was true at each measured step, and the Lightning checkpoints."""

    root: str
    codec: bool
    steps: int
    train_s: float = 0.0
    truth: dict[int, dict[str, Any]] = field(default_factory=dict)
    lightning: dict[int, str] = field(default_factory=dict)  # step -> .ckpt path
    base_file: str | None = None  # the base's full state, saved with torch.save (the limit's load)


def chains(steps: int) -> list[int]:
    """Chain lengths measured: those of :data:`CHAINS` below ``steps``, and ``steps``."""
    return [n for n in CHAINS if n < steps] + [steps]


def new_model(args: argparse.Namespace, codec: bool) -> tuple[GPT, Any, Any, Any]:
    """A fresh model, its AdamW and OneCycleLR, and (for the codec run) a TopK compressor."""
    model = GPT(args.size, total_steps=args.steps)
    conf = model.configure_optimizers()
    compressor = None
    if codec:
        compressor = GradientCompressor(TopK(0.01), model)
        compressor.set_clipping("norm", model.hparams.clip)
    return model, conf["optimizer"], conf["lr_scheduler"]["scheduler"], compressor


def batches(size: str) -> Iterator[torch.Tensor]:
    loader = make_loader(size)
    while True:
        yield from loader


def train_step(model: GPT, opt: Any, sched: Any, batch: torch.Tensor,
               compressor: GradientCompressor | None) -> None:
    """``gpt.plain_step``, with the codec applied between backward and clipping when given.

    Clipping goes over the optimizer's parameters in param-group order, as Lightning clips and
    as replay re-applies a compressed step's recorded clipping: the total norm is a float sum,
    and over ``model.parameters()`` (another order here) it differs in the last bits."""
    x, y = batch[:, :-1], batch[:, 1:]
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x).reshape(-1, model.cfg.vocab), y.reshape(-1)).backward()
    if compressor is not None:
        compressor.compress_(model.parameters())
    params = [p for group in opt.param_groups for p in group["params"]]
    torch.nn.utils.clip_grad_norm_(params, model.hparams.clip)
    opt.step()
    sched.step()


def lightning_checkpoint(model: GPT, opt: Any, sched: Any, step: int) -> dict[str, Any]:
    """The dict Lightning's checkpoint connector dumps for this state on one device."""
    return {
        "epoch": 0, "global_step": step, "pytorch-lightning_version": L.__version__,
        "state_dict": model.state_dict(), "loops": {}, "callbacks": {},
        "optimizer_states": [opt.state_dict()], "lr_schedulers": [sched.state_dict()],
        "hparams_name": "kwargs", "hyper_parameters": dict(model.hparams),
    }


def train(args: argparse.Namespace, workdir: str, codec: bool) -> Run:
    """Train ``args.steps`` steps into a new run root under ``workdir``, keeping the truth (and,
    for the dense run, a Lightning checkpoint) at each step of :func:`chains`."""
    run = Run(os.path.join(workdir, "topk" if codec else "dense"), codec, args.steps)
    torch.manual_seed(0)
    model, opt, sched, compressor = new_model(args, codec)
    engine = CheckpointEngine(run.root, CheckpointOptions(
        every_n_steps=1, write_batch=WRITE_BATCH, base_every_n_steps=None))
    engine.start(model, [opt], 0, compressor=compressor)
    measured = set(chains(args.steps))
    data = batches(args.size)
    start = time.perf_counter()
    for step in range(args.steps + 1):
        if step:
            train_step(model, opt, sched, next(data), compressor)
        state = {"step": step, "scheduler": sched.state_dict(), "rng": torch.get_rng_state()}
        if step:
            engine.record_step(step, state)
        else:
            codec_states = [compressor.state_dict()] if compressor is not None else None
            engine.write_base(0, model.state_dict(), [opt.state_dict()], state, codec_states)
        if step in measured:
            run.truth[step] = {"model": clone_tree(model.state_dict()),
                               "optimizer": clone_tree(opt.state_dict())}
            if not codec:
                path = os.path.join(workdir, "lightning", f"step={step}.ckpt")
                ckpt = lightning_checkpoint(model, opt, sched, step)
                TorchCheckpointIO().save_checkpoint(ckpt, path)
                run.lightning[step] = path
    engine.close()
    run.train_s = time.perf_counter() - start
    return run


# ------------------------------------------------------------------------------ measuring
def evict(paths: list[str]) -> None:
    """Drop ``paths`` from the page cache (clean pages only; the files were fsynced or closed)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(root: str) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names]


@contextlib.contextmanager
def prefetching(depth: int) -> Iterator[None]:
    """Replay with ``depth`` segments read ahead (0: each read when replay reaches it)."""
    saved = diffckpt.recordreads.PREFETCH_SEGMENTS
    diffckpt.recordreads.PREFETCH_SEGMENTS = depth
    try:
        yield
    finally:
        diffckpt.recordreads.PREFETCH_SEGMENTS = saved


def full_state(model: GPT, opt: Any) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def assert_bitwise(truth: dict[str, Any], restored: dict[str, Any], what: str) -> None:
    """The restored state is the true one, tensor for tensor."""
    def flat(obj: Any) -> Iterator[Any]:
        if isinstance(obj, dict):
            for k in sorted(obj, key=str):
                yield from flat(obj[k])
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from flat(v)
        else:
            yield obj

    got = list(flat(restored))
    want = list(flat(truth))
    same = len(got) == len(want) and all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(got, want))
    if not same:
        sys.exit(f"{what}: the restored state differs from the state trained")


def time_diffckpt(args: argparse.Namespace, run: Run, step: int, cold: bool,
                  depth: int) -> dict[str, float]:
    model, opt, _, compressor = new_model(args, run.codec)
    if cold:
        evict(files_under(run.root))
    gc.collect()
    engine = CheckpointEngine(run.root)
    with prefetching(depth):
        start, cpu = time.perf_counter(), time.process_time()
        result = engine.restore(model, [opt], step, compressor=compressor)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert_bitwise(run.truth[step], full_state(model, opt), f"restore of step {step}")
    return {"s": seconds, "cpu_s": cpu, "replay_s": result.replay_s,
            "steps_per_s": result.steps_per_s,
            "mib_per_s": result.read_mib_per_s, "wait_s": result.read_wait_s,
            "read_bytes": result.read_bytes, "replayed": result.replayed}


def time_lightning(args: argparse.Namespace, run: Run, step: int, cold: bool) -> dict[str, float]:
    model, opt, _, _ = new_model(args, False)
    path = run.lightning[step]
    if cold:
        evict([path])
    gc.collect()
    start = time.perf_counter()
    ckpt = TorchCheckpointIO().load_checkpoint(path)
    model.load_state_dict(ckpt["state_dict"])
    opt.load_state_dict(ckpt["optimizer_states"][0])
    seconds = time.perf_counter() - start
    assert_bitwise(run.truth[step], full_state(model, opt), f"Lightning checkpoint of step {step}")
    return {"s": seconds}


def save_base(args: argparse.Namespace, run: Run, workdir: str) -> str:
    """Untimed: the base's model and optimizer states, restored and saved with ``torch.save``
    next to the run: the file the limit's full-state load reads."""
    model, opt, _, compressor = new_model(args, run.codec)
    CheckpointEngine(run.root).restore(model, [opt], 0, compressor=compressor)
    path = os.path.join(workdir, f"{os.path.basename(run.root)}-base.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return path


class GradientFeed:
    """The gradients and hyperparameters replay installs at steps 1..``last`` (the TopK run's
    decoded and clipped ones), handed over ``chunk`` steps at a time: a restore in another
    thread clones them in a step pre-hook and waits between chunks, without reading ahead, so
    nothing of it runs while the limit's clock does."""

    def __init__(self, args: argparse.Namespace, run: Run, last: int, chunk: int) -> None:
        self.cond = threading.Condition()
        self.items: list[tuple[list[torch.Tensor | None], list[dict[str, Any]]]] = []
        self.allowed = 0  # steps the restore may hand over before waiting
        self.error: BaseException | None = None
        self.chunk = chunk
        model, opt, _, compressor = new_model(args, run.codec)
        opt.register_step_pre_hook(self._keep)

        def produce() -> None:
            try:
                with prefetching(0):  # its reads stay on its thread, which waits between chunks
                    CheckpointEngine(run.root).restore(model, [opt], last, compressor=compressor)
            except BaseException as exc:  # reported to the limit, which waits for it
                with self.cond:
                    self.error = exc
                    self.cond.notify_all()

        self.thread = threading.Thread(target=produce, daemon=True)
        self.thread.start()

    def _keep(self, optimizer: Any, *_: Any) -> None:
        with self.cond:
            while self.allowed == 0:
                self.cond.wait()
            self.allowed -= 1
        item = ([None if p.grad is None else p.grad.clone()
                 for group in optimizer.param_groups for p in group["params"]],
                [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups])
        with self.cond:
            self.items.append(item)
            self.cond.notify_all()

    def take(self, n: int) -> list[tuple[list[torch.Tensor | None], list[dict[str, Any]]]]:
        """The next ``n`` steps' gradients and hyperparameters, waiting for them."""
        with self.cond:
            self.allowed += n
            self.cond.notify_all()
            while len(self.items) < n and self.error is None:
                self.cond.wait()
            if self.error is not None:
                raise self.error
            items, self.items = self.items, []
        return items


def time_limit(args: argparse.Namespace, run: Run, step: int) -> dict[str, float]:
    """One full-state load and ``step`` bare optimizer steps on gradients in memory; the clock
    stops while the next ``--limit-chunk`` steps' gradients are fetched."""
    assert run.base_file is not None
    model, opt, _, _ = new_model(args, run.codec)
    params = [p for group in opt.param_groups for p in group["params"]]
    feed = GradientFeed(args, run, step, args.limit_chunk) if step else None
    gc.collect()
    start = time.perf_counter()
    state = torch.load(run.base_file, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    seconds = load_s = time.perf_counter() - start
    done = 0
    while feed is not None and done < step:
        chunk = feed.take(min(args.limit_chunk, step - done))
        start = time.perf_counter()
        for grads, hypers in chunk:
            for group, hyper in zip(opt.param_groups, hypers):
                group.update(hyper)
            for p, g in zip(params, grads):
                p.grad = g
            opt.step()
        seconds += time.perf_counter() - start
        done += len(chunk)
        del chunk
    for p in params:
        p.grad = None
    if feed is not None:
        feed.thread.join()
    # Tensors only: the truth has the param groups as the scheduler left them after the step.
    truth = run.truth[step]
    assert_bitwise({"model": truth["model"], "state": truth["optimizer"]["state"]},
                   {"model": model.state_dict(), "state": opt.state_dict()["state"]},
                   f"limit of step {step}")
    return {"s": seconds, "load_s": load_s}


def chain_bytes(run: Run, step: int) -> int:
    """Bytes on storage that a restore of ``step`` reads: the base and its segments up to the
    one holding ``step`` (read whole)."""
    store = RunStore(CheckpointEngine(run.root).storage)
    inv = store.inventory()
    plan = plan_step(store, step, inv)
    base = [p for p in inv.sizes if p.startswith(os.path.dirname(plan.base.commit_path) + "/")]
    return sum(inv.sizes[p] for p in base) + sum(plan.sizes.values())


Case = tuple[str, ...]
Measure = Callable[[argparse.Namespace], dict[str, float]]


def cases(dense: Run, topk: Run | None) -> dict[Case, Measure]:
    """Every measurement, by name: (kind, chain length, page cache, prefetch)."""
    out: dict[Case, Measure] = {}
    for n in chains(dense.steps):
        out["diffckpt", str(n), "warm", "on"] = lambda a, n=n: time_diffckpt(a, dense, n, False, 4)
        out["lightning", str(n), "warm", ""] = lambda a, n=n: time_lightning(a, dense, n, False)
    last = dense.steps
    out["diffckpt", str(last), "warm", "off"] = lambda a: time_diffckpt(a, dense, last, False, 0)
    out["diffckpt", str(last), "cold", "on"] = lambda a: time_diffckpt(a, dense, last, True, 4)
    out["diffckpt", str(last), "cold", "off"] = lambda a: time_diffckpt(a, dense, last, True, 0)
    out["lightning", str(last), "cold", ""] = lambda a: time_lightning(a, dense, last, True)
    for n in chains(dense.steps):
        out["limit", str(n), "warm", ""] = lambda a, n=n: time_limit(a, dense, n)
    if topk is not None:
        for n in chains(topk.steps):
            out["topk", str(n), "warm", "on"] = lambda a, n=n: time_diffckpt(a, topk, n, False, 4)
            out["topk-limit", str(n), "warm", ""] = lambda a, n=n: time_limit(a, topk, n)
    return out


def in_limit_table(case: Case) -> bool:
    """Whether ``case`` is in the limit table: restores (warm, prefetch on) and their limits."""
    return case[0] in ("limit", "topk-limit") or (case[0] in ("diffckpt", "topk") and case[2:] == ("warm", "on"))


def measure(args: argparse.Namespace, todo: dict[Case, Measure]
            ) -> dict[Case, list[dict[str, float]]]:
    results: dict[Case, list[dict[str, float]]] = {c: [] for c in todo}
    names = list(todo)
    for rep in range(args.repeats):
        for case in names if rep % 2 == 0 else reversed(names):
            r = todo[case](args)
            results[case].append(r)
            print(f"repeat {rep + 1}/{args.repeats} {' '.join(c for c in case if c):28s} "
                  f"{r['s']:7.3f} s", flush=True)
    return results


# ---------------------------------------------------------------------------------- report
def med(runs: list[dict[str, float]], key: str = "s") -> float:
    return statistics.median(r[key] for r in runs)


def mb(n: float) -> str:
    if n < 1e6:
        return f"{n / 1e3:.0f} kB"
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def chain_table(results: dict[Case, list[dict[str, float]]], dense: Run, topk: Run | None
                ) -> list[str]:
    lines = [
        "| chain (diffs replayed) | diffckpt restore s | base + plan s | replay s | steps/s "
        "| MiB/s read | read wait s | bytes on storage (chain) | Lightning load s "
        "| diffckpt / Lightning |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = [(str(n), dense, ("diffckpt", str(n), "warm", "on")) for n in chains(dense.steps)]
    if topk is not None:
        rows.append((f"{topk.steps}, TopK(0.01)", topk, ("topk", str(topk.steps), "warm", "on")))
    for label, run, case in rows:
        runs = results[case]
        n = int(case[1])
        light = med(results["lightning", str(n), "warm", ""])
        t = med(runs)
        replay = med(runs, "replay_s")
        lines.append("| " + " | ".join([
            label, f"{t:.3f}", f"{t - replay:.3f}", f"{replay:.3f}",
            f"{med(runs, 'steps_per_s'):.0f}" if n else "-",
            f"{med(runs, 'mib_per_s'):.0f}" if n else "-",
            f"{med(runs, 'wait_s'):.3f}", mb(chain_bytes(run, n)), f"{light:.3f}",
            f"{t / light:.1f}x"]) + " |")
    return lines


def prefetch_table(results: dict[Case, list[dict[str, float]]], dense: Run) -> list[str]:
    n = str(dense.steps)
    lines = [
        f"| chain {n}, page cache | prefetch | restore s | CPU s (all threads) | replay s "
        "| steps/s | MiB/s read | read wait s | on / off | Lightning load s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cache in ("warm", "cold"):
        off = med(results["diffckpt", n, cache, "off"])
        light = med(results["lightning", n, cache, ""])
        for name in ("on", "off"):
            runs = results["diffckpt", n, cache, name]
            t = med(runs)
            lines.append("| " + " | ".join([
                cache, "4 segments, 2 threads" if name == "on" else "none", f"{t:.3f}",
                f"{med(runs, 'cpu_s'):.2f}", f"{med(runs, 'replay_s'):.3f}",
                f"{med(runs, 'steps_per_s'):.0f}", f"{med(runs, 'mib_per_s'):.0f}",
                f"{med(runs, 'wait_s'):.3f}", f"{t / off:.2f}x" if name == "on" else "1.00x",
                f"{light:.3f}"]) + " |")
    return lines


def limit_table(results: dict[Case, list[dict[str, float]]], dense: Run, topk: Run | None
                ) -> list[str]:
    lines = [
        "| chain (steps replayed) | run | diffckpt restore s | limit s | of it, full-state load s "
        "| restore / limit | restore - limit, ms per step |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    runs = [("dense", "diffckpt", "limit", dense)]
    if topk is not None:
        runs.append(("TopK(0.01)", "topk", "topk-limit", topk))
    for n in chains(dense.steps):
        for label, kind, limit_kind, _ in runs:
            restore, limit = results[kind, str(n), "warm", "on"], results[limit_kind, str(n), "warm", ""]
            t, bound = med(restore), med(limit)
            lines.append("| " + " | ".join([
                str(n), label, f"{t:.3f}", f"{bound:.3f}", f"{med(limit, 'load_s'):.3f}",
                f"{t / bound:.2f}x", f"{(t - bound) / n * 1e3:.2f}" if n else "-"]) + " |")
    return lines


Medians = dict[str, dict[str, float]]  # "kind chain" -> {"s": median s, "load_s": ...}


def medians(results: dict[Case, list[dict[str, float]]]) -> Medians:
    """The limit table's medians, by case, as a ``--before`` child hands them to its parent."""
    return {f"{c[0]} {c[1]}": {"s": med(r)} for c, r in results.items() if in_limit_table(c)}


def before_table(before: Medians, after: Medians, rev: str, steps: int, codec: bool) -> list[str]:
    """Restore / limit with the package at ``rev`` and as it is now, each measured in its own
    process (trained, restored and limited there), one after the other."""
    lines = [
        f"| chain (steps replayed) | run | restore s @{rev} | limit s @{rev} | restore / limit @{rev} "
        "| restore s now | limit s now | restore / limit now |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    runs = [("dense", "diffckpt", "limit")] + ([("TopK(0.01)", "topk", "topk-limit")] if codec else [])
    for n in chains(steps):
        for label, kind, limit_kind in runs:
            row = [str(n), label]
            for got in (before, after):
                t, bound = got[f"{kind} {n}"]["s"], got[f"{limit_kind} {n}"]["s"]
                row += [f"{t:.3f}", f"{bound:.3f}", f"{t / bound:.2f}x"]
            lines.append("| " + " | ".join(row) + " |")
    return lines


LIMIT_NOTES = (
    "`limit`: one full-state load (`torch.load` of the base's model and optimizer states saved "
    "with `torch.save` beside the run, page cache warm, + `load_state_dict` of both) and N bare "
    "`optimizer.step()` calls, each after the param groups' hyperparameters are set and every "
    "`.grad` points at a gradient already in memory: what replay would cost if reading, "
    "checking and decoding the records were free. Same model, optimizer and thread count as "
    "the restore, measured in the same process, interleaved with it; medians of the repeats. The "
    "gradients are the ones replay installs: the recorded ones for the dense run, the dense "
    "gradients the codec decoded to (clipped as recorded) for the TopK run, fetched "
    f"{LIMIT_CHUNK} steps at a time by a restore in another thread while the limit's clock is "
    "stopped. The limit's parameters and moments are checked bitwise against the state trained. "
    "The TopK run's steps cost more than the dense run's, and more the longer the chain: its "
    "sparse updates leave ever more subnormal second moments, on which AdamW's `sqrt` is slow, "
    "in training as in replay."
)


NOTES = (
    "`diffckpt restore s`: `CheckpointEngine.restore` into a fresh model and AdamW, median of the "
    "repeats. `base + plan s`: of that, everything before replay (listing, plan, base read, "
    "checksum and load into the model); `replay s`, `steps/s`, `MiB/s read` and `read wait s` "
    "come from the `ReplayResult` (`replay_s`, `steps_per_s`, `read_mib_per_s`, `read_wait_s`: "
    "the time replay waited for records read and prepared, what prefetching did not hide). "
    "`bytes on storage (chain)`: the base and every segment up to the one holding the step "
    "(segments hold "
    f"{WRITE_BATCH} steps and are read whole). `Lightning load s`: `TorchCheckpointIO."
    "load_checkpoint` + `model.load_state_dict` + `optimizer.load_state_dict` of a checkpoint of "
    "the same step (at step 0, AdamW has no moments yet on either side). `cold`: the files "
    "dropped from the page cache before each restore. `CPU s (all threads)`: process CPU time "
    "during the restore; above the restore's wall time only when reads and decoding overlapped "
    "replay on another core. Every restore is checked bitwise against the state trained."
)


def machine_info(args: argparse.Namespace, dense: Run, topk: Run | None) -> list[str]:
    cfg = SIZES[args.size]
    n_params = sum(p.numel() for p in GPT(args.size).parameters())
    full = os.path.getsize(dense.lightning[dense.steps])
    diffs = sum(os.path.getsize(p) for p in files_under(os.path.join(dense.root, "diffs")))
    lines = [
        *header(f"lightning {L.__version__}; core engine, plain PyTorch loop",
                " (`--threads`; prefetch threads and replay share the cores)"),
        f"- model: GPT '{args.size}', {n_params / 1e6:.2f}M parameters (fp32), batch "
        f"{cfg.batch_size} x {cfg.ctx} tokens, AdamW + OneCycleLR, gradient clipping",
        f"- run: {args.steps} steps, every step restorable, write_batch {WRITE_BATCH}, one base "
        f"(step 0), fingerprints every 50 steps; local disk (a temp dir); trained in "
        f"{dense.train_s:.0f} s; diffs {mb(diffs)} ({mb(diffs / args.steps)} per step); Lightning "
        f"checkpoint at step {args.steps}: {mb(full)}",
    ]
    if topk is not None:
        tdiffs = sum(os.path.getsize(p) for p in files_under(os.path.join(topk.root, "diffs")))
        lines.append(f"- TopK(0.01) run: the same loop with compressed gradients (the payloads are "
                     f"the diffs); trained in {topk.train_s:.0f} s; diffs {mb(tdiffs)} "
                     f"({mb(tdiffs / args.steps)} per step)")
    lines.append(f"- {args.repeats} repeats of every measurement, interleaved; medians")
    return lines


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000, help="steps trained: the longest chain")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--size", default="bench", choices=sorted(SIZES))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--codec", action=argparse.BooleanOptionalAction, default=True,
                    help="also train and restore a TopK(0.01) run (default: yes)")
    ap.add_argument("--limit-chunk", type=int, default=LIMIT_CHUNK,
                    help="steps whose gradients the limit holds in memory at once (default 100)")
    ap.add_argument("--tmp", help="parent of the temp run dir (default: the system temp dir)")
    ap.add_argument("--out", help="Markdown report path")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tiny model, 30 steps, 1 repeat")
    ap.add_argument("--before", metavar="REV",
                    help="first measure restores and limits with the package at commit REV, in a "
                         "process of its own (same arguments), and report both")
    ap.add_argument("--tree", help=argparse.SUPPRESS)  # read before the imports (TREE)
    ap.add_argument("--result", help=argparse.SUPPRESS)  # a --before child's medians (JSON)
    args = ap.parse_args()
    if args.quick:
        args.size, args.steps, args.repeats = "tiny", 30, 1
    if args.steps < 1:
        sys.exit("--steps must be at least 1")
    return args


def measure_before(args: argparse.Namespace) -> Medians:
    """The limit table's medians with the package at ``--before``: this script in a process of
    its own with the same arguments, the package from a ``git archive`` of that commit."""
    tree = checkout(args.before, args.tmp)
    fd, result = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        cmd = [sys.executable, os.path.abspath(__file__), "--steps", str(args.steps),
               "--repeats", str(args.repeats), "--size", args.size, "--threads", str(args.threads),
               "--limit-chunk", str(args.limit_chunk), "--codec" if args.codec else "--no-codec",
               "--tree", tree, "--result", result, *(["--tmp", args.tmp] if args.tmp else [])]
        subprocess.run(cmd, check=True)
        with open(result) as f:
            return json.load(f)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
        os.unlink(result)


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("diffckpt").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    if args.before:
        before = measure_before(args)
        print(f"measured @{args.before}", flush=True)
    out = report_path(args.out, "restore", args.quick)
    workdir = tempfile.mkdtemp(prefix="bench-restore-", dir=args.tmp)
    t_start = time.perf_counter()
    try:
        dense = train(args, workdir, codec=False)
        print(f"trained {args.steps} dense steps in {dense.train_s:.1f} s", flush=True)
        topk = train(args, workdir, codec=True) if args.codec else None
        if topk is not None:
            print(f"trained {args.steps} TopK steps in {topk.train_s:.1f} s", flush=True)
        for run in (dense, topk):
            if run is not None:
                run.base_file = save_base(args, run, workdir)
        time_diffckpt(args, dense, min(10, args.steps), False, 4)  # warm the process up
        time_lightning(args, dense, args.steps, False)
        time_limit(args, dense, min(10, args.steps))
        todo = cases(dense, topk)
        if args.result:  # a --before child: the limit table only, handed to the parent
            with open(args.result, "w") as f:
                json.dump(medians(measure(args, {c: m for c, m in todo.items() if in_limit_table(c)})), f)
            return
        results = measure(args, todo)
        wall = time.perf_counter() - t_start
        load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
        sections = [
            "## Restore time versus chain length (warm page cache, prefetch on)", "",
            *chain_table(results, dense, topk), "",
            f"## Prefetching, chain {args.steps} (dense)", "", *prefetch_table(results, dense), "",
            NOTES, "",
            "## Restore versus the limit (warm page cache, prefetch on)", "",
            *limit_table(results, dense, topk), "",
            LIMIT_NOTES,
        ]
        if args.before:
            sections += [
                "", f"## Before and after: the package at {args.before} and now", "",
                *before_table(before, medians(results), args.before, args.steps, args.codec), "",
                f"`@{args.before}`: this script with the package as committed at {args.before} "
                "(`--before`), in a process of its own run first: trained, restored and limited "
                "there, the same arguments. `now`: the rows of the table above. Compare the "
                "ratios: each is measured within one process, restores and limits interleaved.",
            ]
        report = ["# Restore time versus chain length", "", *machine_info(args, dense, topk),
                  f"- bench wall time {wall:.0f} s; load average after it {load}", "",
                  *sections, ""]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("\n" + "\n".join(sections))
    write_report(out, report)
    print(f"\nwritten to {out} ({wall:.0f} s)")


if __name__ == "__main__":
    main()
