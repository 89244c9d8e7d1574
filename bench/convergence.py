"""Convergence of compressed training: loss curves of uncompressed (dense) training and each codec.

The GPT of ``examples/gpt.py`` (AdamW + OneCycleLR over the run, gradient clipping) is trained
once per codec, single process, with the same seed, initial weights, data order and dropout
masks, through the compressed-training baseline callback of ``bench/compressed.py`` (the codec
applied where ``DiffCheckpoint(codec=...)`` applies it, no checkpointing): ``dense`` (no codec),
``TopK(0.01)``, ``TopK(0.01, error_feedback=True)``, ``PowerSGD(rank=4)``,
``LowPrecision("bf16")``. The synthetic data set of ``make_dataset`` is split: its last
``--val-samples`` sequences are held out and never trained on.

Recorded: the training loss of every step (raw) and the held-out validation loss (eval mode, no
dropout, mean cross-entropy over all held-out tokens) before training, every ``--val-every``
steps and at the end. The final training loss is the mean of the last ``--smooth`` steps.

    python bench/convergence.py [--steps 300] [--size bench] [--quick]

Writes a Markdown summary to ``bench/results/convergence.md``, the raw losses to
``bench/results/convergence.csv`` and the plot (training loss smoothed over ``--smooth`` steps,
validation loss) to ``docs/compression-loss.png``. With --quick (demo model, 30 steps) the files
are ``bench/results/convergence-quick.{md,csv}`` and ``bench/results/compression-loss-quick.png``.
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import statistics
import sys
import time
import warnings
from typing import Any

import lightning as L
import torch
from torch.nn import functional as F
from torchdata.stateful_dataloader import StatefulDataLoader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

from compressed import CODECS, LABELS
from gpt import GPT, SIZES, make_dataset
from provenance import header, report_path, write_report

from lightning_ckpt.compression import GradientCompression


class LossRecorder(L.Callback):
    """Training loss of every step; held-out loss at the start, every ``every`` steps, the end."""

    def __init__(self, val: torch.Tensor, every: int) -> None:
        self.val, self.every = val, every
        self.train: list[float] = []
        self.evals: dict[int, float] = {}

    @torch.no_grad()
    def evaluate(self, module: GPT) -> float:
        was_training = module.training
        module.eval()  # no dropout: draws nothing from the RNG, so training is unaffected
        total = tokens = 0.0
        for batch in self.val.split(64):
            x, y = batch[:, :-1], batch[:, 1:]
            logits = module(x).reshape(-1, module.cfg.vocab)
            total += F.cross_entropy(logits, y.reshape(-1), reduction="sum").item()
            tokens += y.numel()
        module.train(was_training)
        return total / tokens

    def on_train_start(self, trainer, pl_module) -> None:
        self.evals[0] = self.evaluate(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.train.append(float(outputs["loss"]))
        step = trainer.global_step
        if step % self.every == 0 or step == trainer.max_steps:
            self.evals[step] = self.evaluate(pl_module)


def split_data(size: str, val_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = make_dataset(size, seed=0)
    return data[:-val_samples], data[-val_samples:]


def train(codec: str, args: argparse.Namespace) -> dict[str, Any]:
    train_data, val_data = split_data(args.size, args.val_samples)
    L.seed_everything(0, verbose=False)
    model = GPT(args.size, total_steps=args.steps)
    recorder = LossRecorder(val_data, args.val_every)
    callbacks: list[Any] = [recorder]
    if codec != "dense":
        callbacks.insert(0, GradientCompression(CODECS[codec]()))
    trainer = L.Trainer(
        max_steps=args.steps, accelerator="cpu", devices=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        num_sanity_val_steps=0, callbacks=callbacks,
    )
    loader = StatefulDataLoader(train_data, batch_size=SIZES[args.size].batch_size, shuffle=True)
    t0 = time.perf_counter()
    trainer.fit(model, train_dataloaders=loader)
    return {"train": recorder.train, "evals": recorder.evals, "seconds": time.perf_counter() - t0}


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


# ------------------------------------------------------------------------------- outputs
STYLES = {  # dense underneath, wide; bf16 dashed on top of it (the two nearly coincide)
    "dense": {"color": "black", "lw": 2.6, "alpha": 0.6},
    "topk": {"color": "tab:orange", "lw": 1.4},
    "topk-ef": {"color": "tab:green", "lw": 1.4},
    "powersgd": {"color": "tab:red", "lw": 1.4},
    "bf16": {"color": "tab:purple", "lw": 1.4, "ls": "--"},
}


def write_csv(path: str, results: dict[str, dict[str, Any]]) -> None:
    """One row per codec and step: the raw training loss, the validation loss where evaluated."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["codec", "step", "train_loss", "val_loss"])
        for codec, r in results.items():
            w.writerow([codec, 0, "", f"{r['evals'][0]:.6f}"])
            for i, loss in enumerate(r["train"], start=1):
                val = r["evals"].get(i)
                w.writerow([codec, i, f"{loss:.6f}", "" if val is None else f"{val:.6f}"])


def plot(path: str, results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    for codec, r in results.items():
        style = STYLES.get(codec, {})
        steps = range(1, len(r["train"]) + 1)
        ax_train.plot(steps, smooth(r["train"], args.smooth), label=LABELS[codec], **style)
        evals = sorted(r["evals"].items())
        ax_val.plot([s for s, _ in evals], [v for _, v in evals], marker="o", ms=3,
                    label=LABELS[codec], **style)
    ax_train.set_title(f"training loss (trailing mean of {args.smooth} steps)")
    ax_val.set_title(f"held-out loss ({args.val_samples} sequences)")
    for ax in (ax_train, ax_val):
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross-entropy")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(ScalarFormatter())
        ax.grid(True, which="both", alpha=0.3)
    ax_val.legend()
    n_params = sum(p.numel() for p in GPT(args.size).parameters())
    fig.suptitle(f"Compressed training, GPT '{args.size}' ({n_params / 1e6:.2f}M parameters), "
                 f"AdamW + OneCycleLR, {args.steps} steps, seed 0")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[str]:
    def final_train(codec: str) -> float:
        return statistics.fmean(results[codec]["train"][-args.smooth:])

    def final_val(codec: str) -> float:
        return results[codec]["evals"][args.steps]

    def best_val(codec: str) -> float:
        return min(results[codec]["evals"].values())

    lines = [
        f"| codec | final train loss (mean of last {args.smooth}) | vs dense | final val loss | "
        "vs dense | best val loss | s/run |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for codec in results:
        cells = [
            LABELS[codec], f"{final_train(codec):.4f}",
            f"{final_train(codec) / final_train('dense'):.3f}x", f"{final_val(codec):.4f}",
            f"{final_val(codec) / final_val('dense'):.3f}x", f"{best_val(codec):.4f}",
            f"{results[codec]['seconds']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Held-out loss by step:", "",
              "| step | " + " | ".join(LABELS[c] for c in results) + " |",
              "|---:|" + "---:|" * len(results)]
    for step in sorted(results["dense"]["evals"]):
        vals = [f"{results[c]['evals'][step]:.4f}" for c in results]
        lines.append(f"| {step} | " + " | ".join(vals) + " |")
    return lines


def machine_info(args: argparse.Namespace) -> list[str]:
    cfg = SIZES[args.size]
    n_params = sum(p.numel() for p in GPT(args.size).parameters())
    return [
        *header(f"lightning {L.__version__}"),
        f"- model: GPT '{args.size}', {n_params / 1e6:.2f}M parameters (fp32), "
        f"batch {cfg.batch_size} x {cfg.ctx} tokens, AdamW + OneCycleLR over the run, "
        "gradient clipping (norm 1); seed 0 for every codec",
        f"- {args.steps} optimizer steps per codec, single process; data: `make_dataset('{args.size}')`, "
        f"{cfg.samples - args.val_samples} sequences trained on, the last {args.val_samples} held out",
    ]


# ------------------------------------------------------------------------------------ main
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--size", default="bench", choices=sorted(SIZES))
    ap.add_argument("--val-every", type=int, default=25, help="held-out loss every this many steps")
    ap.add_argument("--val-samples", type=int, default=256, help="sequences held out")
    ap.add_argument("--smooth", type=int, default=20, help="steps in the trailing mean")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--codecs", default=",".join(CODECS),
                    help="comma-separated subset of " + ",".join(CODECS) + " (dense is required)")
    ap.add_argument("--out", help="Markdown report path")
    ap.add_argument("--csv", help="raw losses (CSV) path")
    ap.add_argument("--plot", help="PNG path")
    ap.add_argument("--quick", action="store_true", help="smoke run: demo size, 30 steps")
    args = ap.parse_args()
    if args.quick:
        args.size, args.steps, args.val_every, args.smooth = "demo", 30, 10, 5
    args.codecs = args.codecs.split(",")
    if "dense" not in args.codecs or set(args.codecs) - set(CODECS):
        sys.exit(f"--codecs must include 'dense' and only use {list(CODECS)}")
    suffix = "-quick" if args.quick else ""
    results_dir = os.path.join(ROOT, "bench", "results")
    args.out = report_path(args.out, "convergence", args.quick)
    args.csv = args.csv or os.path.join(results_dir, f"convergence{suffix}.csv")
    args.plot = args.plot or (os.path.join(results_dir, "compression-loss-quick.png") if args.quick
                              else os.path.join(ROOT, "docs", "compression-loss.png"))
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")  # Lightning's and torch's deprecation chatter
    for name in ("lightning.pytorch", "lightning.fabric", "diffckpt"):
        logging.getLogger(name).setLevel(logging.ERROR)
    info = machine_info(args)
    t_start = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for codec in args.codecs:
        results[codec] = r = train(codec, args)
        print(f"{codec:9s} {r['seconds']:6.0f} s  final train "
              f"{statistics.fmean(r['train'][-args.smooth:]):.4f}  val {r['evals'][args.steps]:.4f}",
              flush=True)
    wall = time.perf_counter() - t_start
    for path in (args.csv, args.plot):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_csv(args.csv, results)
    plot(args.plot, results, args)
    table = summary(results, args)
    rel = lambda p: os.path.relpath(os.path.abspath(p), ROOT)  # noqa: E731
    report = ["# Convergence of compressed training", "", *info,
              f"- bench wall time: {wall / 60:.1f} min", "", *table, "",
              f"Raw losses: `{rel(args.csv)}`; plot: `{rel(args.plot)}`.", ""]
    write_report(args.out, report)
    print("\n" + "\n".join(table))
    print(f"\nwritten to {args.out}, {args.csv}, {args.plot} ({wall:.0f} s)")


if __name__ == "__main__":
    main()
