"""Time to the first training step after a restart: what a user waits for when a job comes back.

GPT-2 124M or 350M shapes (``bench/gpu_scale.py``'s models from a ``GPT2Config``, no download),
AdamW, bf16 autocast, on the CPU. Each configuration runs in a fresh process and is timed from
the moment the process is started (the parent's clock, taken just before) until its first
training step is done, with the phases on the way: imports, model built, state restored, step.

- ``plain-torch``: a plain loop that resumes with ``torch.load`` of the full state (model and
  AdamW) saved at the run's last step, ``load_state_dict`` of both, then one step;
- ``plain-diffckpt``: the same loop with ``CheckpointEngine(root).resume`` and ``begin`` at the
  restored step (a session that continues it, writing no base there), then one step recorded
  with ``commit``;
- ``lightning-torch``: ``Trainer.fit(ckpt_path=...)`` of the ``last.ckpt`` a Lightning run
  without diffckpt saved (``ModelCheckpoint(save_last=True)``), one more step;
- ``lightning-diffckpt``: ``Trainer.fit(ckpt_path="last")`` with ``DiffCheckpoint`` and
  ``DiffCheckpointIO`` at their defaults, one more step.

Set-up (not timed): a plain diffckpt run of ``--steps`` steps that also ``torch.save``s its final
state, a Lightning run with ``DiffCheckpoint`` and one without it. The configurations then run in
``--rounds`` interleaved rounds; the report gives medians and each diffckpt configuration's ratio
to its ``torch.load`` counterpart of the same round (the issue's target: at most 1.3x).

    python bench/first_step.py [--size 124m] [--steps 12] [--rounds 3] [--threads 1] [--tokens N] [--fp32]
                               [--out JSON]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

CONFIGS = ["plain-torch", "plain-diffckpt", "lightning-torch", "lightning-diffckpt"]
PAIRS = {"plain-diffckpt": "plain-torch", "lightning-diffckpt": "lightning-torch"}
TARGET = 1.3


class Clock:
    """Seconds since the parent started this process, at each phase."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        self.phases[phase] = round(time.time() - self.started, 3)


def quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")  # num_workers, the infinite data set: not what is measured
    for name in ("lightning.pytorch", "lightning.fabric", "diffckpt"):
        logging.getLogger(name).setLevel(logging.WARNING)


# ------------------------------------------------------------------------------ children
def setup_child(args: argparse.Namespace) -> dict[str, Any]:
    """The three runs the configurations resume from (one process each, by ``args.config``)."""
    import torch
    from gpu_scale import batches, build, step_fn
    from scale import DiffSave, NoSave, RssSampler

    torch.set_num_threads(args.threads)
    quiet()
    model, opt = build(args)
    if args.config == "plain":
        root = os.path.join(args.rundir, "plain")
        saver = DiffSave(root, model, opt, RssSampler())
        data, step = batches(args, 1), step_fn(args, model, opt)
        for n in range(1, args.steps + 1):
            step(next(data))
            saver.after_step(n)
        saver.final(args.steps)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, os.path.join(args.rundir, "full.pt"))
        return {"written": NoSave(root).written()}
    trainer = lightning_trainer(args, args.config == "lightning-diffckpt", args.steps)
    trainer.fit(lightning_module(model, opt), train_dataloaders=loader(args))
    return {}


def lightning_module(model: Any, opt: Any) -> Any:
    from scale import lightning_module as module

    return module(model, opt)


def loader(args: argparse.Namespace) -> Any:
    import torch
    from gpu_scale import batches

    class Data(torch.utils.data.IterableDataset):
        def __iter__(self) -> Any:
            return batches(args, 1)

    return torch.utils.data.DataLoader(Data(), batch_size=None)


def lightning_trainer(args: argparse.Namespace, diffckpt: bool, max_steps: int, callbacks: list[Any] = (),
                      save: bool = True) -> Any:
    """``save``: the torch configuration's ModelCheckpoint (its timed run resumes and saves
    nothing, as the job would save only at its next interval)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_ckpt import DiffCheckpoint, DiffCheckpointIO

    root = os.path.join(args.rundir, "lightning-diffckpt" if diffckpt else "lightning-torch")
    ckpt = [DiffCheckpoint(root)] if diffckpt else [ModelCheckpoint(root, save_last=True, save_top_k=0)] if save else []
    return L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, precision="32" if args.fp32 else "bf16-mixed",
                     logger=False, enable_checkpointing=bool(ckpt),
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     callbacks=[*callbacks, *ckpt], plugins=[DiffCheckpointIO()] if diffckpt else [])


def timed_child(args: argparse.Namespace) -> dict[str, Any]:
    clock = Clock(args.started)
    import torch
    from gpu_scale import batches, build, step_fn

    import diffckpt  # noqa: F401  (what each configuration imports before it works)

    if args.config.startswith("lightning"):
        import lightning  # noqa: F401
    torch.set_num_threads(args.threads)
    quiet()
    clock.mark("imports")
    model, opt = build(args)
    clock.mark("built")
    if args.config == "plain-torch":
        full = torch.load(os.path.join(args.rundir, "full.pt"), map_location="cpu", weights_only=True)
        model.load_state_dict(full["model"])
        opt.load_state_dict(full["optimizer"])
        del full
        clock.mark("restored")
        step_fn(args, model, opt)(next(batches(args, 1)))
        clock.mark("first step")
    elif args.config == "plain-diffckpt":
        from diffckpt import CheckpointEngine

        engine = CheckpointEngine(os.path.join(args.rundir, "plain"))
        result = engine.resume(model, [opt])
        assert result is not None and result.step == args.steps, result
        clock.mark("resumed")

        class Source:
            def rank_state(self) -> Any:
                return None

            def state(self, ranks: list[Any]) -> Any:
                return {}

        engine.begin(model, [opt], result.step, Source())  # continues the restored step: no base
        clock.mark("restored")
        step_fn(args, model, opt)(next(batches(args, 1)))
        engine.commit(result.step + 1, Source())
        clock.mark("first step")
        engine.end()
    else:
        import lightning as L

        class Timer(L.Callback):
            def on_train_start(self, trainer: Any, *_: Any) -> None:
                assert trainer.global_step == args.steps, trainer.global_step
                clock.mark("restored")

            def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
                if "first step" not in clock.phases:
                    clock.mark("first step")

        diff = args.config == "lightning-diffckpt"
        trainer = lightning_trainer(args, diff, args.steps + 1, [Timer()], save=False)
        last = "last" if diff else os.path.join(args.rundir, "lightning-torch", "last.ckpt")
        trainer.fit(lightning_module(model, opt), train_dataloaders=loader(args), ckpt_path=last)
    return {"config": args.config, "phases": clock.phases}


@contextlib.contextmanager
def fresh_copy(rundir: str, config: str) -> Iterator[None]:
    """A diffckpt configuration writes on after its resume (a new session, its base, the next
    step): each round resumes a copy of the run set up, which is put back afterwards."""
    if not config.endswith("diffckpt"):
        yield
        return
    root = os.path.join(rundir, "plain" if config == "plain-diffckpt" else config)
    shutil.copytree(root, root + ".kept")
    try:
        yield
    finally:
        shutil.rmtree(root, ignore_errors=True)
        os.replace(root + ".kept", root)


def run_child(what: str, config: str, rundir: str, args: argparse.Namespace) -> dict[str, Any]:
    result = os.path.join(rundir, f"result-{what}-{config}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", what, "--config", config, "--rundir", rundir,
           "--result", result, "--size", args.size, "--steps", str(args.steps), "--threads", str(args.threads),
           *(["--tokens", str(args.tokens)] if args.tokens else []), *(["--fp32"] if args.fp32 else []),
           "--started", repr(time.time())]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"--- {what} {config} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    with open(result) as f:
        return json.load(f)


# -------------------------------------------------------------------------------- driver
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from gpu_scale import SIZES

    ap.add_argument("--size", default="124m", choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=12, help="steps trained before the restart")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every process")
    ap.add_argument("--tokens", type=int, help="tokens per sequence (default: the size's context, 1024)")
    ap.add_argument("--fp32", action="store_true", help="no bf16 autocast (a CPU without bfloat16 kernels)")
    ap.add_argument("--workdir", help="parent of the run directory (default: a new temp dir, removed after)")
    ap.add_argument("--out", help="JSON path (default bench/results/first-step-<size>.json)")
    ap.add_argument("--child", choices=["setup", "timed"], help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--rundir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--started", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.device = "cpu"  # what gpu_scale's helpers read
    if args.child:
        out = setup_child(args) if args.child == "setup" else timed_child(args)
        with open(args.result, "w") as f:
            json.dump(out, f)
        return
    rundir = tempfile.mkdtemp(prefix="first-step-", dir=args.workdir)
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    try:
        for config in ("plain", "lightning-diffckpt", "lightning-torch"):
            run_child("setup", config, rundir, args)
        for rnd in range(args.rounds):
            for config in CONFIGS[rnd % 4:] + CONFIGS[: rnd % 4]:
                with fresh_copy(rundir, config):
                    r = run_child("timed", config, rundir, args)
                r["round"] = rnd
                runs[config].append(r)
                print(f"round {rnd + 1}/{args.rounds} {config:18s} " +
                      "  ".join(f"{k} {v:6.2f} s" for k, v in r["phases"].items()), flush=True)
    finally:
        shutil.rmtree(rundir, ignore_errors=True)
    lines = [f"# Time to the first step after a restart, GPT-2 {args.size}, CPU, {args.threads} thread(s)", "",
             "| configuration | imports s | built s | restored s | first step s | vs torch.load |",
             "|---|---:|---:|---:|---:|---:|"]
    # plain-diffckpt also marks "resumed" (resume done), before begin() opens its session
    summary: dict[str, Any] = {}
    for config, rs in runs.items():
        med = {k: statistics.median(r["phases"][k] for r in rs) for k in rs[0]["phases"]}
        base = {r["round"]: r for r in runs.get(PAIRS.get(config, ""), [])}
        ratio = (statistics.median(r["phases"]["first step"] / base[r["round"]]["phases"]["first step"] for r in rs)
                 if base else None)
        summary[config] = {**med, "ratio": ratio}
        lines.append(f"| {config} | {med['imports']:.2f} | {med['built']:.2f} | {med['restored']:.2f} | "
                     f"{med['first step']:.2f} | {'-' if ratio is None else f'{ratio:.2f}×'} |")
    for config in PAIRS:
        ratio = summary[config]["ratio"]
        lines.append(f"\n{config}: {ratio:.2f}× its torch.load counterpart, target ≤ {TARGET}×: "
                     f"{'**pass**' if ratio <= TARGET else '**miss**'}")
    print("\n".join(lines))
    out = args.out or os.path.join(ROOT, "bench", "results", f"first-step-{args.size}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"size": args.size, "steps": args.steps, "threads": args.threads, "runs": runs,
                   "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
