"""A small but complete Lightning training run, configurable for the exactness tests.

Run as a subprocess: ``python train_script.py CONFIG OUT [--dirpath D] [--resume] [--no-lib]``
(``--storage-options``, ``--flush-timeout`` and ``--retry-budget`` configure the storage side;
``--codec`` trains with compressed gradients, with or without the library; ``--auto`` and
``--tuning`` leave the settings to the auto-tuner).
It prints ``STEP n`` after every optimizer step (the parent kills it with SIGKILL on a chosen
step) and, when training ends, saves every tensor of the final model, optimizer, scheduler and
RNG state to ``OUT`` for a bitwise comparison.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import time

import lightning as L
import numpy as np
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

VOCAB, CTX = 61, 16


class TinyGPT(nn.Module):
    def __init__(self, dim: int = 32, layers: int = 2, dropout: float = 0.1, batchnorm: bool = False):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.randn(CTX, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, 4, dim * 2, dropout=dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.BatchNorm1d(dim) if batchnorm else nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)
        self.register_buffer("mask", torch.triu(torch.full((CTX, CTX), float("-inf")), 1), persistent=False)

    def forward(self, x):
        h = self.tok(x) + self.pos[: x.shape[1]]
        h = self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        if isinstance(self.norm, nn.BatchNorm1d):
            h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        else:
            h = self.norm(h)
        return self.head(h)


def make_data(n: int = 96, seed: int = 1234) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, CTX + 1), generator=g)


class LM(L.LightningModule):
    def __init__(self, cfg: str, total_steps: int, dim: int = 32):
        super().__init__()
        self.cfg = cfg
        self.total_steps = total_steps
        self.net = TinyGPT(dim, batchnorm=cfg == "sgd_bn")
        self.save_hyperparameters()
        if cfg == "manual2":
            self.automatic_optimization = False
            self.head2 = nn.Linear(32, VOCAB)

    def loss(self, batch):
        x, y = batch[:, :-1], batch[:, 1:]
        logits = self.net(x)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if self.cfg == "scaler_skip" and self.global_step in (5, 11):
            loss = loss * float("inf")  # GradScaler finds inf gradients and skips this step
        if self.cfg != "manual2":
            self.log("train_loss", loss)
            return loss
        opt1, opt2 = self.optimizers()
        opt1.zero_grad()
        self.manual_backward(loss)
        opt1.step()
        h = self.net.tok(batch[:, :-1]).detach()
        loss2 = nn.functional.cross_entropy(self.head2(h).reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        opt2.zero_grad()
        self.manual_backward(loss2 + 0.0 * torch.rand(()))
        opt2.step()
        return None

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.cfg == "clip_hook":  # clipping chosen by the module, not the Trainer
            self.clip_gradients(optimizer, gradient_clip_val=0.02, gradient_clip_algorithm="value")
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self):
        if self.cfg == "sgd_bn":
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}
        if self.cfg == "manual2":
            return [torch.optim.AdamW(self.net.parameters(), lr=3e-3),
                    torch.optim.SGD(self.head2.parameters(), lr=0.1, momentum=0.5)]
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.05)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-3, total_steps=self.total_steps + 5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class StepPrinter(L.Callback):
    def __init__(self, sleep: float = 0.0, dump: str | None = None):
        self.sleep = sleep
        self.dump = dump

    def _dump(self, trainer):
        if self.dump and trainer.is_global_zero:  # model and optimizer as they are at this step
            torch.save({"model": trainer.lightning_module.state_dict(),
                        "optimizers": [o.state_dict() for o in trainer.optimizers]},
                       f"{self.dump}/step{trainer.global_step}.pt")

    def on_train_start(self, trainer, *args):
        self._dump(trainer)

    def on_train_batch_end(self, trainer, *args):
        self._dump(trainer)
        if trainer.is_global_zero:
            print(f"STEP {trainer.global_step}", flush=True)
        if self.sleep:  # slower training, so a test can act between steps (outages, signals)
            time.sleep(self.sleep)


def make_codec(spec: str):
    """``topk:0.05``, ``topk-ef:0.05``, ``powersgd:2``, ``powersgd-warm:2`` or ``bf16``."""
    from diffckpt.codecs import LowPrecision, PowerSGD, TopK

    name, _, arg = spec.partition(":")
    return {"topk": lambda: TopK(float(arg)), "topk-ef": lambda: TopK(float(arg), error_feedback=True),
            "powersgd": lambda: PowerSGD(int(arg)),
            "powersgd-warm": lambda: PowerSGD(int(arg), error_feedback=False),
            "bf16": lambda: LowPrecision("bf16")}[name]()


CONFIGS = {
    # name: (trainer kwargs, steps)
    "adamw": ({"precision": "32-true", "gradient_clip_val": 0.5, "accumulate_grad_batches": 2,
               "val_check_interval": 5, "limit_val_batches": 2}, 30),
    "adamw_bf16": ({"precision": "bf16-mixed", "gradient_clip_val": 0.5, "accumulate_grad_batches": 2}, 24),
    "clip_hook": ({"precision": "32-true", "accumulate_grad_batches": 2}, 20),
    "sgd_bn": ({"precision": "32-true", "limit_val_batches": 2}, 30),
    "manual2": ({"precision": "32-true"}, 40),
    # Lightning maps "16-mixed" to bf16 on CPU; the plugin forces fp16 autocast with a GradScaler.
    "scaler_skip": ({"gradient_clip_val": 1.0}, 20),
}


def final_state(trainer: L.Trainer) -> dict:
    module = trainer.lightning_module
    return {
        "model": {k: v.clone() for k, v in module.state_dict().items()},
        "optimizers": [o.state_dict() for o in trainer.optimizers],
        "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "precision": trainer.precision_plugin.state_dict(),  # GradScaler scale and growth tracker
        "batches_total": trainer.fit_loop.epoch_loop.batch_progress.total.completed,
        "rng": torch.get_rng_state(),
        "np_rng": torch.from_numpy(np.random.get_state()[1].copy()),
        "py_rng": torch.tensor(random.getstate()[1]),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", choices=sorted(CONFIGS))
    ap.add_argument("out")
    ap.add_argument("--dirpath")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--ckpt-path")
    ap.add_argument("--no-lib", action="store_true")
    ap.add_argument("--write-batch", type=int, default=4)
    ap.add_argument("--base-every", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--model-checkpoint", help="also save ModelCheckpoints (through DiffCheckpointIO) here")
    ap.add_argument("--mc-every", type=int, default=5)
    ap.add_argument("--mc-first", action="store_true", help="list ModelCheckpoint before DiffCheckpoint")
    ap.add_argument("--storage-options", type=json.loads, help="JSON dict: DiffCheckpoint(storage_options=...)")
    ap.add_argument("--flush-timeout", type=float, help="DiffCheckpoint(flush_timeout_s=...)")
    ap.add_argument("--retry-budget", type=float,
                    help="DiffCheckpoint(retry=RetryPolicy(budget_s=..., short backoffs))")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep after every batch")
    ap.add_argument("--codec", help="compressed training, see make_codec (with --no-lib: no checkpoints)")
    ap.add_argument("--dim", type=int, default=32, help="model width")
    ap.add_argument("--steps", type=int, help="max_steps instead of the config's")
    ap.add_argument("--csv-logger", help="log metrics with a CSVLogger into this directory")
    ap.add_argument("--auto", action="store_true", help='every_n_steps, write_batch, base_every_n_steps="auto"')
    ap.add_argument("--tuning", type=json.loads, help="JSON dict: DiffCheckpoint(tuning=TuningOptions(...))")
    ap.add_argument("--dump-steps", help="save model and optimizer state at every step into this directory")
    ap.add_argument("--options", type=json.loads, default={},
                    help='JSON dict of further DiffCheckpoint options; "retention" is a RetentionPolicy dict')
    args = ap.parse_args(argv)

    kwargs, steps = CONFIGS[args.config]
    steps = args.steps or steps
    torch.set_num_threads(1)  # same kernels and reduction order in every process
    L.seed_everything(7, verbose=False)
    torch.use_deterministic_algorithms(True)
    model = LM(args.config, steps, args.dim)
    loader = StatefulDataLoader(make_data(), batch_size=args.batch_size, shuffle=True)
    callbacks: list = [StepPrinter(args.step_sleep, args.dump_steps)]
    if args.codec and args.no_lib:
        from lightning_ckpt.compression import (
            GradientCompression,  # the same training, no checkpoints
        )

        callbacks.append(GradientCompression(make_codec(args.codec)))
    plugins: list = []
    if args.config == "scaler_skip":
        from lightning.pytorch.plugins import MixedPrecision

        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")))
    if not args.no_lib:
        from diffckpt import CheckpointOptions
        from lightning_ckpt import DiffCheckpoint, DiffCheckpointIO

        extra: dict = {}
        if args.flush_timeout is not None:
            extra["flush_timeout_s"] = args.flush_timeout
        if args.retry_budget is not None:
            from diffckpt import RetryPolicy

            extra["retry"] = RetryPolicy(budget_s=args.retry_budget, initial_backoff_s=0.05, max_backoff_s=0.2)
        if args.tuning is not None:
            from diffckpt import TuningOptions

            extra["tuning"] = TuningOptions(**args.tuning)
        if args.auto:
            extra["every_n_steps"] = args.write_batch = args.base_every = "auto"
        # retention=None unless given: the tests resume from any step of a run, which the default
        # retention (the two newest bases' chains) would not keep.
        extra.update({"retention": None, **args.options})
        if extra["retention"] is not None:
            from diffckpt import RetentionPolicy

            extra["retention"] = RetentionPolicy(**extra["retention"])
        if "base_every_n_steps" in extra:
            args.base_every = extra.pop("base_every_n_steps")
        knobs = {k: extra.pop(k) for k in ("every_n_steps", "write_batch") if k in extra}
        diff = DiffCheckpoint(args.dirpath, **{"write_batch": args.write_batch, **knobs},
                              base_every_n_steps=args.base_every,
                              options=CheckpointOptions(fingerprint_every_n_steps=5, **extra),
                              storage_options=args.storage_options,
                              codec=make_codec(args.codec) if args.codec else None)
        plugins.append(DiffCheckpointIO())
        callbacks.append(diff)
        if args.model_checkpoint:
            from lightning.pytorch.callbacks import ModelCheckpoint

            mc = ModelCheckpoint(dirpath=args.model_checkpoint, every_n_train_steps=args.mc_every,
                                 save_top_k=2, monitor="train_loss", save_last=True)
            callbacks.insert(callbacks.index(diff) + (0 if args.mc_first else 1), mc)
    ddp = {"strategy": "ddp", "devices": args.devices} if args.devices > 1 else {"devices": 1}
    logger = L.pytorch.loggers.CSVLogger(args.csv_logger, name="", version="") if args.csv_logger else False
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=logger, **ddp,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=not args.no_lib, num_sanity_val_steps=2,
                        callbacks=callbacks, plugins=plugins, deterministic=True, **kwargs)
    ckpt = args.ckpt_path or ("last" if args.resume else None)
    val_loader = StatefulDataLoader(make_data(32, seed=99), batch_size=8)
    trainer.fit(model, train_dataloaders=loader, val_dataloaders=val_loader, ckpt_path=ckpt)
    out = args.out if trainer.global_rank == 0 else f"{args.out}.rank{trainer.global_rank}"
    torch.save(final_state(trainer), out)


if __name__ == "__main__":
    # A shell starts background jobs with SIGINT ignored, and Python then raises no
    # KeyboardInterrupt on Ctrl-C: behave as a run started from a terminal, whoever started us.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # diffckpt's INFO lines (restored step, durable step at close) and its warnings, on stdout with
    # the STEP lines; only when run as a script, so that in-process runs leave pytest's logging alone.
    from helpers import finish_process, log_to_stdout

    log_to_stdout()

    main(sys.argv[1:])
    finish_process()
