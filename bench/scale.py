"""Checkpointing at real model sizes on the CPU: step time, memory and restore of GPT-2 124M and
350M shapes (``bench/gpu_scale.py``'s models: a ``GPT2Config``, no download), bf16 autocast,
AdamW, one training thread, every run a fresh process.

Configurations, each trained for ``--warmup`` untimed steps and then ``--steps`` timed ones:

- ``none``: the plain loop of ``gpu_scale.py``, no checkpointing (the baseline);
- ``diffckpt``: the same loop with ``CheckpointEngine``'s default options, a diff every step;
  ``diffckpt-nolocal`` (optional): the same without the node-local tier (``local_dir=None``);
- ``lightning``: a Lightning ``Trainer`` (CPU, 1 device, ``precision="bf16-mixed"``) with
  ``DiffCheckpoint`` and ``DiffCheckpointIO`` at their defaults; ``lightning-none`` (optional) is
  the same Trainer without checkpointing, to tell Lightning's own cost from diffckpt's;
- ``torch-save-N``: ``torch.save`` of the model and optimizer state on the training thread every
  N steps and after the last one, the previous file deleted once the next one is written;
- ``dcp-N``: ``torch.distributed.checkpoint.async_save`` every N steps and after the last one,
  the previous save awaited first (``gpu_scale.py``'s ``dcp-N``).

The configurations run in interleaved rounds: in round r each one runs once, the order rotated
by r, after one untimed one-step ``none`` run that fills the page cache. Per run: seconds per
timed step and its ratio to the ``none`` run of the same round; the peak RSS (``ru_maxrss``) and
an RSS curve (``VmRSS`` of ``/proc/self/status`` every 0.25 s and at every phase change, labelled
``setup``, ``train``, ``flush``, ``restore``, ``check``); bytes written per step (the run root after
the run plus what was deleted on the way, over all steps); the final flush or save; the steps not
durable when the loop ended; diffckpt's ``max_pending_bytes`` and the most its queue held.

After a ``diffckpt`` or ``lightning`` run, the newest durable step is restored in a fresh process
onto a freshly built model and optimizer and checked bitwise against the trained state, and
``limit`` (``gpu_scale.py``'s restore limit: ``torch.load`` of the full state diffckpt's base
held, with or without AdamW's moments as the base had them, plus one bare ``optimizer.step()``
per step replay took from its base, on gradients already in memory) runs in another.

Targets (the issue's), printed as pass/miss: training at most 1.03x no checkpointing; peak RSS at
most none's peak + ``max_pending_bytes`` + one step's fp32 gradients (parameters x 4 bytes);
restore's peak RSS at most the peak of the training run it restores; restore at most 1.5x limit.

    python bench/scale.py [--size 124m] [--steps 12] [--warmup 2] [--rounds 1] [--batch 1]
                          [--configs none,diffckpt,lightning,torch-save-10,dcp-10]
                          [--workdir DIR] [--plot PATH] [--out JSON] [--no-restore]
    python bench/scale.py --from-json bench/results/scale-124m.json [--plot PATH]  # redraw

Writes ``bench/results/scale-<size>.json`` (every run, RSS curves included) and prints a Markdown
report. ``--plot`` draws the RSS curves of the last round (training: none, diffckpt, torch-save;
restore: diffckpt and limit) as a PNG with matplotlib, or, without it, as an SVG drawn here next
to the path given. Run directories live under ``--workdir`` (default: a temp dir) and each is
deleted once its configuration and restores are done: at 124M a run writes gigabytes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

# gpu_scale puts tests/ on the path too (its bitwise check uses tests/helpers.py).
from gpu_scale import (
    SIZES,
    batches,
    build,
    dir_bytes,
    limit_state,
    load_and_step,
    rss_peak,
    same,
    step_fn,
)

CONFIGS = ["none", "diffckpt", "lightning", "torch-save-10", "dcp-10"]
CONFIG_RE = re.compile(r"none|diffckpt|diffckpt-nolocal|lightning|lightning-none|torch-save-\d+|dcp-\d+")
RESTORED = ("diffckpt", "lightning")  # the configurations whose run is restored
BASELINE = {"lightning": "lightning-none"}  # also compared with this one when it ran
RATIO_TARGET, RESTORE_TARGET = 1.03, 1.5
SAMPLE_EVERY = 0.25


# ------------------------------------------------------------------------ RSS sampling
def vm_rss() -> int:
    """This process's resident set size now, in bytes (``/proc/self/status`` gives kB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class RssSampler(threading.Thread):
    """Samples VmRSS every ``SAMPLE_EVERY`` s on its own thread, plus once at every phase change
    (a short run would otherwise fall between two samples). ``probe``, when set, is read at each
    sample too, and its largest value is kept (diffckpt's queued bytes)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.t0 = time.perf_counter()
        self.phase = "setup"
        self.samples: list[tuple[float, int, str]] = []
        self.probe: Any = None
        self.probe_max: int | None = None  # stays None when the probe never answered
        self._stop_event = threading.Event()
        self.sample()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def sample(self) -> None:
        self.samples.append((round(self.now(), 3), vm_rss(), self.phase))
        if self.probe is not None:
            try:
                self.probe_max = max(self.probe_max or 0, int(self.probe()))
            except Exception:  # a writer between sessions, or one whose internals changed: no figure
                pass

    def mark(self, phase: str) -> None:
        self.sample()  # the end of the previous phase
        self.phase = phase
        self.sample()

    def run(self) -> None:
        while not self._stop_event.wait(SAMPLE_EVERY):
            self.sample()

    def stop(self) -> list[tuple[float, int, str]]:
        self._stop_event.set()
        self.join()
        self.sample()
        return self.samples


def peak_in(samples: list[tuple[float, int, str]], phases: tuple[str, ...]) -> int:
    return max((rss for _, rss, phase in samples if phase in phases), default=0)


# ---------------------------------------------------------------------- training savers
class NoSave:
    """No checkpointing; the interface the loop calls after every step and at the end."""

    engine: Any = None

    def __init__(self, root: str) -> None:
        self.root, self.removed, self.saved = root, 0, None

    def after_step(self, n: int) -> None:
        pass

    def durable(self) -> int | None:
        return self.saved

    def final(self, last: int) -> None:
        pass

    def written(self) -> int:
        return dir_bytes(self.root) + self.removed


class DiffSave(NoSave):
    def __init__(self, root: str, model: Any, opt: Any, sampler: RssSampler, local: bool = True) -> None:
        from diffckpt import CheckpointEngine, CheckpointOptions

        super().__init__(root)

        class Source:  # nothing beyond model and optimizer: the data depend on the step alone
            def rank_state(self) -> Any:
                return None

            def state(self, ranks: list[Any]) -> Any:
                return {}

        options = CheckpointOptions() if local else CheckpointOptions(local_dir=None)
        self.engine, self.source = CheckpointEngine(root, options), Source()
        self.engine.begin(model, [opt], 0, self.source)
        sampler.probe = lambda: self.engine.recorder.writer.queued_bytes

    def after_step(self, n: int) -> None:
        self.engine.commit(n, self.source)

    def durable(self) -> int | None:
        return durable_of(self.engine)

    def final(self, last: int) -> None:
        self.engine.end()


class TorchSave(NoSave):
    def __init__(self, root: str, model: Any, opt: Any, every: int) -> None:
        super().__init__(root)
        self.model, self.opt, self.every, self.path = model, opt, every, None

    def after_step(self, n: int) -> None:
        if n % self.every == 0:
            self.save(n)

    def save(self, n: int) -> None:
        import torch

        path = os.path.join(self.root, f"step{n}.pt")
        torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}, path)
        if self.path is not None:  # the newest checkpoint kept, as a job with little disk would
            self.removed += os.path.getsize(self.path)
            os.remove(self.path)
        self.path, self.saved = path, n

    def final(self, last: int) -> None:
        if self.saved != last:
            self.save(last)


class DcpSave(NoSave):
    """``gpu_scale.py``'s ``dcp-N``: the previous save awaited before the next one starts, the
    newest completed save and the one in flight kept."""

    def __init__(self, root: str, model: Any, opt: Any, every: int) -> None:
        super().__init__(root)
        self.model, self.opt, self.every = model, opt, every
        self.pending: Any = None
        self.pending_step: int | None = None
        self.kept: list[str] = []

    def after_step(self, n: int) -> None:
        if n % self.every == 0:
            self.save(n)

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.saved, self.pending = self.pending_step, None

    def save(self, n: int) -> None:
        import torch.distributed.checkpoint as dcp

        self.wait()
        while len(self.kept) > 1:
            old = self.kept.pop(0)
            self.removed += dir_bytes(old)
            shutil.rmtree(old, ignore_errors=True)
        path = os.path.join(self.root, f"step{n}")
        self.kept.append(path)
        sd = {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}
        self.pending, self.pending_step = dcp.async_save(sd, checkpoint_id=path), n

    def durable(self) -> int | None:
        if self.pending is not None and self.pending.done():
            return self.pending_step
        return self.saved

    def final(self, last: int) -> None:
        if self.pending_step != last:
            self.save(last)
        self.wait()


def durable_of(engine: Any) -> int | None:
    """The engine's newest durable step: its property, else the metrics it gives loggers."""
    try:
        return engine.durable_step
    except AttributeError:  # the writer is being reworked: its metrics name the same figure
        value = engine.metrics().get("diffckpt/durable_step")
        return None if value is None else int(value)


def max_pending_of(engine: Any) -> int:
    """The queue bound the writing session runs with (the options it was opened with)."""
    writer = getattr(engine.recorder, "writer", None)
    return (getattr(writer, "options", None) or engine.options).max_pending_bytes


def lightning_module(model: Any, opt: Any) -> Any:
    """The GPT-2 model as a LightningModule; the optimizer is ``build``'s, so that both loops
    train the same model with the same AdamW."""
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, ids: Any, batch_idx: int) -> Any:
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self) -> Any:
            return opt

    return Module()


# ------------------------------------------------------------------------------ children
def train_loop(args: argparse.Namespace, model: Any, opt: Any, root: str, sampler: RssSampler) -> dict[str, Any]:
    config = args.config
    saver: NoSave
    if config in ("diffckpt", "diffckpt-nolocal"):
        saver = DiffSave(root, model, opt, sampler, local=config == "diffckpt")
    elif config.startswith("torch-save-"):
        saver = TorchSave(root, model, opt, int(config.rsplit("-", 1)[1]))
    elif config.startswith("dcp-"):
        saver = DcpSave(root, model, opt, int(config.rsplit("-", 1)[1]))
    else:
        saver = NoSave(root)
    max_pending = max_pending_of(saver.engine) if saver.engine is not None else None
    data, step = batches(args, args.batch), step_fn(args, model, opt)
    last = args.warmup + args.steps
    sampler.mark("train")
    t0 = t_timed = 0.0
    for n in range(1, last + 1):
        if n == args.warmup + 1:
            t0, t_timed = time.perf_counter(), sampler.now()
        step(next(data))
        saver.after_step(n)
    t_loop = time.perf_counter()
    durable = saver.durable()
    sampler.mark("flush")
    saver.final(last)
    t_end = time.perf_counter()
    return {"loop_s": t_loop - t0, "flush_s": t_end - t_loop, "t_timed": t_timed, "last": last,
            "durable_at_loop_end": durable, "max_pending_bytes": max_pending, "written": saver.written(),
            "checkpointing": config != "none"}


def train_lightning(args: argparse.Namespace, model: Any, opt: Any, root: str, sampler: RssSampler) -> dict[str, Any]:
    import logging
    import warnings

    import lightning as L
    import torch

    from lightning_ckpt import DiffCheckpoint, DiffCheckpointIO

    warnings.filterwarnings("ignore")  # num_workers, the infinite data set: not what is measured
    for name in ("lightning.pytorch", "lightning.fabric", "diffckpt"):
        logging.getLogger(name).setLevel(logging.WARNING)
    ckpt = DiffCheckpoint(root) if args.config == "lightning" else None
    last = args.warmup + args.steps
    seen: dict[str, Any] = {}

    class Timer(L.Callback):
        # Checkpoint callbacks run after the others, so on_train_end here comes before
        # DiffCheckpoint's final flush: the flush is timed from it, as in the plain loop.
        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
            if "t0" not in seen and trainer.global_step == args.warmup:
                seen["t0"], seen["t_timed"] = time.perf_counter(), sampler.now()

        def on_train_end(self, trainer: Any, *_: Any) -> None:
            seen["t_loop"], seen["last"] = time.perf_counter(), trainer.global_step
            seen["threads"] = torch.get_num_threads()
            if ckpt is not None:
                seen["durable"] = durable_of(ckpt.engine)
                seen["max_pending"] = max_pending_of(ckpt.engine)
            sampler.mark("flush")

    class Data(torch.utils.data.IterableDataset):
        def __iter__(self) -> Any:
            return batches(args, args.batch)

    if ckpt is not None:
        sampler.probe = lambda: ckpt.engine.recorder.writer.queued_bytes
    trainer = L.Trainer(max_steps=last, accelerator="cpu", devices=1, precision="32" if args.fp32 else "bf16-mixed",
                        logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        enable_checkpointing=ckpt is not None,  # DiffCheckpoint is a ModelCheckpoint
                        callbacks=[Timer(), *([ckpt] if ckpt else [])],
                        plugins=[DiffCheckpointIO()] if ckpt else [])
    module = lightning_module(model, opt)
    sampler.mark("train")
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(Data(), batch_size=None))
    t_end = time.perf_counter()
    return {"loop_s": seen["t_loop"] - seen["t0"], "flush_s": t_end - seen["t_loop"], "t_timed": seen["t_timed"],
            "last": seen["last"], "durable_at_loop_end": seen.get("durable"),
            "max_pending_bytes": seen.get("max_pending"), "written": dir_bytes(root),
            "checkpointing": ckpt is not None, "lightning_threads": seen["threads"], "module": module}


def train_child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    sampler = RssSampler()
    sampler.start()
    model, opt = build(args)
    root = os.path.join(args.rundir, "run")
    os.makedirs(root, exist_ok=True)
    run = (train_lightning if args.config.startswith("lightning") else train_loop)(args, model, opt, root, sampler)
    module = run.pop("module", model)
    rss = rss_peak()
    sampler.mark("check")
    if args.config in RESTORED:  # the trained state, for the restore's bitwise check (not measured)
        torch.save({"model": module.state_dict(), "optimizer": opt.state_dict()}, os.path.join(args.rundir, "final.pt"))
    samples = sampler.stop()
    timed, last, durable = args.steps, run.pop("last"), run.pop("durable_at_loop_end")
    params = sum(p.numel() for p in model.parameters())
    return {
        "config": args.config, "batch": args.batch, "steps": timed, "params": params,
        "s_per_step": run["loop_s"] / timed, "rss_peak": rss, "rss_sampled_peak": peak_in(samples, ("train", "flush")),
        "bytes_written": run["written"], "bytes_per_step": run["written"] / last,
        "not_durable_at_loop_end": None if not run["checkpointing"] else last - (durable if durable is not None else 0),
        "queued_peak": sampler.probe_max,
        "threads": torch.get_num_threads(), "rss_curve": samples,
        **{k: v for k, v in run.items() if k not in ("written", "checkpointing")},
    }


def restore_child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from diffckpt import CheckpointEngine
    from diffckpt.tree import portable

    torch.set_num_threads(args.threads)
    sampler = RssSampler()
    sampler.start()
    model, opt = build(args)
    exact = None
    if args.config == "limit":
        steps = replayed = args.steps_replayed
        path = limit_state(args.rundir, args.base_step, model, opt)
        grads = [torch.randn_like(p) for p in model.parameters()]
        sampler.mark("restore")
        t0 = time.perf_counter()
        load_and_step(model, opt, path, "cpu", grads, steps)
        seconds, rss = time.perf_counter() - t0, rss_peak()
        sampler.mark("check")
    else:
        module = lightning_module(model, opt) if args.config == "lightning" else model
        sampler.mark("restore")
        t0 = time.perf_counter()
        result = CheckpointEngine(os.path.join(args.rundir, "run")).resume(module, [opt])
        seconds, steps, rss = time.perf_counter() - t0, result.step, rss_peak()  # before the check's load
        replayed, base_step = result.replayed, result.base_step
        sampler.mark("check")
        truth = torch.load(os.path.join(args.rundir, "final.pt"), map_location="cpu", weights_only=True)
        exact = same(portable({"model": module.state_dict(), "optimizer": opt.state_dict()}), truth)
    samples = sampler.stop()
    return {"config": args.config, "seconds": seconds, "steps": steps, "replayed": replayed,
            "base_step": args.base_step if args.config == "limit" else base_step, "exact": exact,
            "rss_peak": rss,
            "rss_sampled_peak": peak_in(samples, ("restore",)), "rss_curve": samples}


# -------------------------------------------------------------------------------- driver
def run_child(what: str, config: str, rundir: str, args: argparse.Namespace, replayed: int = 0,
              base_step: int = 0) -> dict[str, Any]:
    """One fresh process; its output is shown only when it fails (Lightning's banner would
    otherwise break up the report)."""
    result = os.path.join(rundir, f"result-{what}-{config}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", what, "--config", config, "--rundir", rundir,
           "--result", result, "--size", args.size, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--batch", str(args.batch), "--threads", str(args.threads), "--steps-replayed", str(replayed),
           "--base-step", str(base_step), *(["--tokens", str(args.tokens)] if args.tokens else []),
           *(["--fp32"] if args.fp32 else [])]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    if proc.returncode != 0:
        tail = proc.stdout[-3000:]
        print(f"--- {what} {config} failed (exit {proc.returncode}):\n{tail}", flush=True)
        last_line = (tail.strip().splitlines() or [""])[-1]
        return {"config": config, "error": f"exit {proc.returncode}: {last_line}"}
    with open(result) as f:
        return json.load(f)


def param_count(size: str) -> int:
    """Parameters of the model of ``size``, built on the meta device (no memory, no time)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, dim, heads, vocab, ctx = SIZES[size]
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab,
                                           n_positions=ctx, bos_token_id=vocab - 1, eos_token_id=vocab - 1))
    return sum(p.numel() for p in model.parameters())


def run_all(args: argparse.Namespace, configs: list[str], workdir: str) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    restores: dict[str, list[dict[str, Any]]] = {c: [] for c in configs if c in RESTORED}
    limits: list[dict[str, Any]] = []
    prime = tempfile.mkdtemp(prefix="scale-prime-", dir=workdir)
    try:  # untimed: the imports and the model's first allocation come from a warm page cache after it
        run_child("train", "none", prime, argparse.Namespace(**{**vars(args), "steps": 1, "warmup": 0}))
    finally:
        shutil.rmtree(prime, ignore_errors=True)
    for rnd in range(args.rounds):
        shift = rnd % len(configs)
        round_limits: dict[int, dict[str, Any]] = {}  # steps replayed -> the limit measured this round
        for config in configs[shift:] + configs[:shift]:
            rundir = tempfile.mkdtemp(prefix=f"scale-{config}-", dir=workdir)
            try:
                r = run_child("train", config, rundir, args)
                r["round"] = rnd
                runs[config].append(r)
                print(f"round {rnd + 1}/{args.rounds} {config:15s} " + (
                    r["error"] if "error" in r else
                    f"{r['s_per_step']:8.3f} s/step  peak RSS {r['rss_peak'] / 1e6:8.0f} MB  "
                    f"flush {r['flush_s']:6.2f} s  {r['bytes_per_step'] / 1e6:9.2f} MB/step"), flush=True)
                if config in restores and "error" not in r and not args.no_restore:
                    x = run_child("restore", config, rundir, args)
                    x["round"] = rnd
                    restores[config].append(x)
                    key = (x.get("replayed"), x.get("base_step", 0) > 0)  # what the limit loads and steps
                    if "error" not in x and key not in round_limits:
                        lim = run_child("restore", "limit", rundir, args, replayed=x["replayed"],
                                        base_step=x["base_step"])
                        lim["round"] = rnd
                        limits.append(lim)
                        round_limits[key] = lim
                    lim = round_limits.get(key, {})
                    x["limit_s"] = lim.get("seconds")
                    print(f"round {rnd + 1}/{args.rounds} restore {config:7s} " + (
                        x["error"] if "error" in x else
                        f"{x['seconds']:8.3f} s (step {x['steps']}, {x['replayed']} replayed)  limit {fmt(x['limit_s'], '.3f')} s  "
                        f"peak RSS {x['rss_peak'] / 1e6:8.0f} MB  bitwise {x['exact']}"), flush=True)
            finally:
                shutil.rmtree(rundir, ignore_errors=True)
    return {"runs": runs, "restores": restores, "limits": limits}


# -------------------------------------------------------------------------------- report
def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def med(values: list[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:,.0f} MB"


def verdict(ok: bool) -> str:
    return "**pass**" if ok else "**miss**"


def summarise(data: dict[str, Any]) -> dict[str, Any]:
    """Per configuration, medians over rounds; ratios are taken within a round first."""
    runs, params = data["runs"], data["params"]
    good = {c: [r for r in rs if "error" not in r] for c, rs in runs.items()}
    by_round = {c: {r["round"]: r for r in rs} for c, rs in good.items()}
    rows: dict[str, dict[str, Any]] = {}
    for config, rs in good.items():
        if not rs:
            rows[config] = {"failed": True}
            continue
        row: dict[str, Any] = {}
        for key in ("s_per_step", "rss_peak", "rss_sampled_peak", "bytes_per_step", "flush_s",
                    "not_durable_at_loop_end", "max_pending_bytes", "queued_peak"):
            row[key] = med([r.get(key) for r in rs])
        for name, base in (("ratio", "none"), ("ratio_own", BASELINE.get(config))):
            if base in by_round and base != config:
                row[name] = med([r["s_per_step"] / by_round[base][r["round"]]["s_per_step"]
                                 for r in rs if r["round"] in by_round[base]])
        row["rounds"] = [round(r["s_per_step"], 4) for r in rs]
        rows[config] = row
    restores = {}
    for config, xs in data["restores"].items():
        xs = [x for x in xs if "error" not in x]
        if not xs:
            continue
        trained = by_round.get(config, {})
        restores[config] = {
            "seconds": med([x["seconds"] for x in xs]), "limit_s": med([x.get("limit_s") for x in xs]),
            "ratio": med([x["seconds"] / x["limit_s"] for x in xs if x.get("limit_s")]),
            "steps": xs[0]["steps"], "replayed": xs[0].get("replayed"), "rss_peak": med([x["rss_peak"] for x in xs]),
            "train_rss_peak": med([trained[x["round"]]["rss_peak"] for x in xs if x["round"] in trained]),
            "exact": all(x["exact"] for x in xs),
        }
    limit_rss = med([x["rss_peak"] for x in data["limits"] if "error" not in x])
    grads = params * 4
    targets = []
    none_peak = rows.get("none", {}).get("rss_peak")
    for config in RESTORED:
        row = rows.get(config)
        if not row or row.get("failed"):
            continue
        if row.get("ratio") is not None:
            targets.append((f"{config}: s/step ≤ {RATIO_TARGET:.2f}× none", row["ratio"] <= RATIO_TARGET,
                            f"{row['ratio']:.3f}×"))
        if none_peak is not None and row.get("max_pending_bytes") is not None:
            bound = none_peak + row["max_pending_bytes"] + grads
            targets.append((f"{config}: peak RSS ≤ none's peak + max_pending_bytes + one step's gradients",
                            row["rss_peak"] <= bound,
                            f"{mb(row['rss_peak'])} against {mb(none_peak)} + {mb(row['max_pending_bytes'])} + "
                            f"{mb(grads)} = {mb(bound)}"))
    for config, x in restores.items():
        if x["train_rss_peak"] is not None:
            targets.append((f"{config} restore: peak RSS ≤ its training run's peak", x["rss_peak"] <= x["train_rss_peak"],
                            f"{mb(x['rss_peak'])} against {mb(x['train_rss_peak'])}"))
        if x["ratio"] is not None:
            targets.append((f"{config} restore: time ≤ {RESTORE_TARGET:.1f}× limit", x["ratio"] <= RESTORE_TARGET,
                            f"{x['seconds']:.2f} s against {x['limit_s']:.2f} s: {x['ratio']:.2f}×"))
    return {"rows": rows, "restores": restores, "limit_rss_peak": limit_rss, "targets": targets}


def render(data: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    rows, grads = summary["rows"], data["params"] * 4
    none_peak = rows.get("none", {}).get("rss_peak")
    lines = ["| config | s/step | vs none | peak RSS | over none | sampled peak | bytes/step | final flush s "
             "| not durable at loop end | max_pending_bytes | queue peak |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for config, r in rows.items():
        if r.get("failed"):
            lines.append(f"| {config} | failed | | | | | | | | | |")
            continue
        ratio = "1.000×" if config == "none" else fmt(r.get("ratio"), ".3f") + "×"
        if r.get("ratio_own") is not None:
            ratio += f" ({r['ratio_own']:.3f}× {BASELINE[config]})"
        over = None if none_peak is None else r["rss_peak"] - none_peak
        nd = r["not_durable_at_loop_end"]
        cells = [config, f"{r['s_per_step']:.3f}", ratio, mb(r["rss_peak"]),
                 "-" if over is None else f"{round(over / 1e6):+,d} MB", mb(r["rss_sampled_peak"]),
                 f"{r['bytes_per_step'] / 1e6:,.1f} MB", f"{r['flush_s']:.2f}",
                 "-" if nd is None else f"{nd:.0f} steps", mb(r["max_pending_bytes"]), mb(r["queued_peak"])]
        lines.append("| " + " | ".join(cells) + " |")
    if summary["restores"]:
        lines += ["", "| restore | s | limit s | vs limit | step (replayed from its base) | peak RSS | training run's peak "
                  "| bitwise equal |", "|---|---:|---:|---:|---:|---:|---:|---|"]
        for config, x in summary["restores"].items():
            lines.append(f"| {config} | {x['seconds']:.2f} | {fmt(x['limit_s'], '.2f')} | {fmt(x['ratio'], '.2f')}× "
                         f"| {x['steps']} ({x.get('replayed')}) | {mb(x['rss_peak'])} | {mb(x['train_rss_peak'])} "
                         f"| {'yes' if x['exact'] else '**no**'} |")
        lines += ["", f"Limit (full load + bare steps) peak RSS: {mb(summary['limit_rss_peak'])}."]
    if summary["targets"]:
        lines += ["", "Targets:", ""]
        lines += [f"- {verdict(ok)} {name}: {figure}" for name, ok, figure in summary["targets"]]
    lines += ["", "Per round s/step: " + "; ".join(f"{c} {' '.join(map(str, r.get('rounds', [])))}"
                                                     for c, r in rows.items()),
              "", f"One step's fp32 gradients: {mb(grads)}."]
    return lines


NOTES = (
    "`s/step`: the timed steps (after the warm-up) up to the end of the loop; the final flush or "
    "save is `final flush s`. `vs none`: against the `none` run of the same round, median over "
    "rounds. `peak RSS`: `ru_maxrss` of the training process up to the end of the flush (model "
    "build included); `sampled peak`: the largest VmRSS sampled in the train and flush phases. "
    "`bytes/step`: the run root after the run plus what was deleted on the way, over all steps "
    "(warm-up included; diffckpt's base at step 0 included). `not durable at loop end`: the last "
    "step minus the newest durable (or, for torch.save, written) step when the loop ended. "
    "`queue peak`: the most bytes diffckpt's writer queue held at a sample. Restore: a fresh "
    "process, the newest durable step onto a freshly built model and optimizer, its peak RSS "
    "taken before the bitwise check loads the truth; `limit`: torch.load of the full state the "
    "restored base held (step 0's has no AdamW moments yet) plus one bare AdamW step per step replay "
    "took from that base, on random gradients built before the clock starts."
)


# ---------------------------------------------------------------------------------- plot
def plot_series(data: dict[str, Any]) -> tuple[list[tuple[str, list[Any]]], list[tuple[str, list[Any]]], float | None]:
    """The last round's curves: training (none, diffckpt, torch-save-N) and restore (diffckpt,
    limit), and the RSS target line of diffckpt's training run. The bitwise check after a run is
    left out: it loads a second copy of the state that neither training nor restore holds."""
    def last_ok(items: list[dict[str, Any]]) -> dict[str, Any] | None:
        ok = [dict(x, rss_curve=[s for s in x["rss_curve"] if s[2] != "check"]) for x in items if "error" not in x]
        return ok[-1] if ok else None

    train = []
    for config, rs in data["runs"].items():
        r = last_ok(rs)
        if r is not None and (config in ("none", "diffckpt") or config.startswith("torch-save-")):
            train.append((config, r["rss_curve"]))
    restore = []
    x = last_ok(data["restores"].get("diffckpt", []))
    if x is not None:
        restore.append(("diffckpt restore", x["rss_curve"]))
    lim = last_ok(data["limits"])
    if lim is not None:
        restore.append(("limit (torch.load + bare steps)", lim["rss_curve"]))
    none, diff = last_ok(data["runs"].get("none", [])), last_ok(data["runs"].get("diffckpt", []))
    bound = None
    if none and diff and diff.get("max_pending_bytes") is not None:
        bound = none["rss_peak"] + diff["max_pending_bytes"] + data["params"] * 4
    return train, restore, bound


COLOURS = {"none": "#1f77b4", "diffckpt": "#d62728", "torch-save": "#2ca02c", "limit": "#7f7f7f"}
EXTRA = ["#9467bd", "#ff7f0e", "#8c564b", "#e377c2"]
MARKED = ("train", "flush", "restore")  # phases whose start is marked on the curves


def colour(label: str, i: int) -> str:
    """The same colour for a configuration in both panels."""
    return next((c for key, c in COLOURS.items() if label.startswith(key)), EXTRA[i % len(EXTRA)])


def phase_starts(curve: list[Any]) -> list[tuple[float, int, str]]:
    """The first sample of each marked phase: where training, the flush and the restore begin."""
    starts, seen = [], set()
    for t, rss, phase in curve:
        if phase in MARKED and phase not in seen:
            seen.add(phase)
            starts.append((t, rss, phase))
    return starts


def plot(path: str, data: dict[str, Any]) -> str:
    """Write the RSS plot; returns the path written (``.svg`` when matplotlib is missing)."""
    train, restore, bound = plot_series(data)
    title = f"GPT-2 {data['size']} on the CPU, bf16 autocast, batch {data['args']['batch']}"
    panels = [("training: RSS over time", train, bound), ("restore: RSS over time", restore, None)]
    try:
        import matplotlib
    except ImportError:
        path = os.path.splitext(path)[0] + ".svg"
        write_svg(path, title, panels)
        return path
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (name, series, line) in zip(axes, panels):
        for i, (label, curve) in enumerate(series):
            ax.plot([t for t, _, _ in curve], [rss / 1e9 for _, rss, _ in curve], label=label,
                    color=colour(label, i), lw=1.4)
            starts = phase_starts(curve)
            ax.plot([t for t, _, _ in starts], [rss / 1e9 for _, rss, _ in starts], "o", ms=4,
                    color=colour(label, i))
        if line is not None:
            ax.axhline(line / 1e9, color="grey", ls="--", lw=1, label="target: none + max_pending + grads")
        ax.set_title(name)
        ax.set_xlabel("seconds since the process started (dots: train, flush, restore begin)")
        ax.set_ylabel("RSS (GB)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def nice_ticks(top: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to at least ``top``: 1, 2 or 5 times a power of ten apart."""
    import math

    if top <= 0:
        return [0.0, 1.0]
    raw = top / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [i * step for i in range(math.ceil(top / step - 1e-9) + 1)]


def write_svg(path: str, title: str, panels: list[tuple[str, list[tuple[str, list[Any]]], float | None]]) -> None:
    """The same two panels as the matplotlib plot, as polylines (no dependency for a picture)."""
    from xml.sax.saxutils import escape

    width, height, pw, ph = 1100, 420, 440, 280  # canvas, then each panel's plot area
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>']
    for k, (name, series, line) in enumerate(panels):
        x0, y0 = 70 + k * (pw + 110), 50  # top-left corner of the plot area
        t_max = max((t for _, curve in series for t, _, _ in curve), default=1.0)
        r_max = max([rss for _, curve in series for _, rss, _ in curve] + [line or 0]) / 1e9
        xt, yt = nice_ticks(t_max), nice_ticks(r_max * 1.05)

        def sx(t: float, xt: list[float] = xt, x0: int = x0) -> float:
            return x0 + pw * t / xt[-1]

        def sy(gb: float, yt: list[float] = yt, y0: int = y0) -> float:
            return y0 + ph - ph * gb / yt[-1]

        out.append(f'<text x="{x0 + pw / 2}" y="{y0 - 8}" text-anchor="middle" font-size="13">{escape(name)}</text>')
        for t in xt:
            out.append(f'<line x1="{sx(t):.1f}" y1="{y0}" x2="{sx(t):.1f}" y2="{y0 + ph}" stroke="#eee"/>')
            out.append(f'<text x="{sx(t):.1f}" y="{y0 + ph + 15}" text-anchor="middle">{t:g}</text>')
        for g in yt:
            out.append(f'<line x1="{x0}" y1="{sy(g):.1f}" x2="{x0 + pw}" y2="{sy(g):.1f}" stroke="#eee"/>')
            out.append(f'<text x="{x0 - 6}" y="{sy(g) + 4:.1f}" text-anchor="end">{g:g}</text>')
        out.append(f'<rect x="{x0}" y="{y0}" width="{pw}" height="{ph}" fill="none" stroke="black"/>')
        out.append(f'<text x="{x0 + pw / 2}" y="{y0 + ph + 32}" text-anchor="middle">seconds since the process '
                   f'started (dots: train, flush, restore begin)</text>')
        out.append(f'<text transform="translate({x0 - 45},{y0 + ph / 2}) rotate(-90)" text-anchor="middle">'
                   f'RSS (GB)</text>')
        legend = [(label, colour(label, i), "") for i, (label, _) in enumerate(series)]
        for i, (_, curve) in enumerate(series):
            points = " ".join(f"{sx(t):.1f},{sy(rss / 1e9):.1f}" for t, rss, _ in curve)
            out.append(f'<polyline points="{points}" fill="none" stroke="{legend[i][1]}" stroke-width="1.5"/>')
            out += [f'<circle cx="{sx(t):.1f}" cy="{sy(rss / 1e9):.1f}" r="3" fill="{legend[i][1]}"/>'
                    for t, rss, _ in phase_starts(curve)]
        if line is not None:
            out.append(f'<line x1="{x0}" y1="{sy(line / 1e9):.1f}" x2="{x0 + pw}" y2="{sy(line / 1e9):.1f}" '
                       f'stroke="grey" stroke-dasharray="5,4"/>')
            legend.append(("target: none + max_pending + grads", "grey", ' stroke-dasharray="5,4"'))
        for i, (label, stroke, dash) in enumerate(legend):
            ly = y0 + ph - 12 - 15 * (len(legend) - 1 - i)
            out.append(f'<line x1="{x0 + pw - 220}" y1="{ly}" x2="{x0 + pw - 200}" y2="{ly}" stroke="{stroke}" '
                       f'stroke-width="2"{dash}/>')
            out.append(f'<text x="{x0 + pw - 195}" y="{ly + 4}">{escape(label)}</text>')
    out.append("</svg>")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


# ---------------------------------------------------------------------------------- main
def shown(path: str) -> str:
    """``path`` relative to the checkout when inside it (reports are read on other machines)."""
    rel = os.path.relpath(os.path.abspath(path), ROOT)
    return path if rel.startswith("..") else rel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="124m", choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=12, help="timed steps per run, after the warm-up")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of every run")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1, help="sequences per step (of the size's context length)")
    ap.add_argument("--fp32", action="store_true", help="train without bf16 autocast (a CPU without bfloat16 "
                    "kernels); Lightning runs use precision 32 then")
    ap.add_argument("--tokens", type=int, help="tokens per sequence (default: the size's context, 1024). Fewer "
                    "make steps cheaper on a slow CPU while the model, its records and its restores keep their size")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the training process")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="comma-separated; none, diffckpt, diffckpt-nolocal, lightning, lightning-none, torch-save-N, dcp-N")
    ap.add_argument("--workdir", help="parent of the run directories (default: a new temp dir, removed after)")
    ap.add_argument("--out", help="JSON path (default bench/results/scale-<size>.json)")
    ap.add_argument("--plot", help="PNG of the RSS curves (an .svg beside it without matplotlib)")
    ap.add_argument("--no-restore", action="store_true", help="skip the restores")
    ap.add_argument("--from-json", metavar="JSON", help="report and plot a finished run's JSON, run nothing")
    ap.add_argument("--child", choices=["train", "restore"], help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--rundir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--steps-replayed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--base-step", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.device = "cpu"  # what gpu_scale's helpers read
    if args.child:
        out = train_child(args) if args.child == "train" else restore_child(args)
        with open(args.result, "w") as f:
            json.dump(out, f)
        return
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
    else:
        data = measure(args)
    summary = summarise(data)
    lines = ["# Checkpointing at GPT-2 " + data["size"] + " size on the CPU", "", *data["info"], "",
             *render(data, summary), "", NOTES]
    if args.plot:
        written = plot(args.plot, data)
        lines += ["", f"RSS plot: `{shown(written)}`."]
    if not args.from_json:
        out = args.out or os.path.join(ROOT, "bench", "results", f"scale-{args.size}.json")
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump({**data, "summary": summary, "report": lines}, f)
        lines += ["", f"Every run, RSS curves included: `{shown(out)}`."]
    print("\n" + "\n".join(lines))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import transformers
    from provenance import header

    configs = args.configs.split(",")
    bad = [c for c in configs if not CONFIG_RE.fullmatch(c)]
    if bad or "none" not in configs or len(set(configs)) != len(configs):
        sys.exit(f"--configs: {bad or configs}: give 'none' and each configuration once, among none, diffckpt, diffckpt-nolocal, "
                 "lightning, lightning-none, torch-save-N, dcp-N")
    if args.steps < 1 or args.warmup < 0:
        sys.exit("--steps must be at least 1 and --warmup at least 0")
    params = param_count(args.size)
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench-scale-")
    os.makedirs(workdir, exist_ok=True)
    # The largest run directory: diffckpt's base, one fp32 gradient per step, the trained state
    # for the check (parameters and two moments) and the limit's copy of the base.
    need = params * 4 * (args.warmup + args.steps + 5)
    free = shutil.disk_usage(workdir).free
    if free < need * 1.2:
        sys.exit(f"{workdir}: {free / 1e9:.1f} GB free, a run needs about {need / 1e9:.1f} GB; give --workdir")
    layers, dim, _, _, ctx = SIZES[args.size]
    started = time.perf_counter()
    info = [*header(f"lightning {L.__version__}, transformers {transformers.__version__}",
                    f" (training processes: {args.threads})"),
            f"- model: GPT-2 {args.size} shapes ({layers} layers, width {dim}), {params / 1e6:.1f}M parameters "
            f"(fp32), {'no autocast (--fp32)' if args.fp32 else 'bf16 autocast'}, AdamW; batch {args.batch} x "
            f"{args.tokens or ctx} tokens",
            f"- {args.warmup} untimed + {args.steps} timed steps per run; {args.rounds} interleaved round(s), "
            f"order rotated, a fresh process per run; run directories under {'--workdir' if args.workdir else 'a temp dir'}"]
    try:
        data = run_all(args, configs, workdir)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    info.append(f"- bench wall time {(time.perf_counter() - started) / 60:.1f} min; load average after it {load}")
    return {"size": args.size, "params": params, "info": info,
            "args": {k: getattr(args, k) for k in ("size", "steps", "warmup", "rounds", "batch", "threads", "configs")},
            **data}


if __name__ == "__main__":
    main()
