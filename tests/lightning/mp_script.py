"""A Lightning run under ``ModelParallelStrategy`` (FSDP2 via ``configure_model``), 2 CPU processes
(``--tp 2``: FSDP x tensor parallelism, 4 processes).

Run as a subprocess (Lightning starts the second process by running this script again):

    mp_script.py OUT --steps N [--dirpath D] [--resume | --ckpt-path P] [--no-lib] [--full]
                 [--tp 2] [--model-checkpoint DIR]

Without ``--dirpath`` nothing of diffckpt is used (the reference run). The module has dropout
(the RNG matters), two batches accumulate per optimizer step, gradients are clipped by norm (a
collective on DTensors) and a StepLR scheduler steps every optimizer step; an epoch is 3 steps.
Rank 0 prints ``STEP n`` after every batch. At the end each rank saves its pieces of every
parameter and optimizer state tensor (``to_local()``), the scheduler, the loop position and its
RNG to ``OUT.rank<r>``; ``--full`` also saves every step's full tensors (``full_tensor()``, a
collective) to ``OUT.full``.
"""

from __future__ import annotations

import argparse
import random
import sys

import lightning as L
import numpy as np
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def tensors(module: nn.Module, optimizer: torch.optim.Optimizer, fn) -> dict:
    sd = optimizer.state_dict()
    return {"model": {k: fn(v).detach().clone() for k, v in module.state_dict().items()},
            "optimizer": {i: {k: fn(v).clone() for k, v in s.items()} for i, s in sd["state"].items()}}


class Net(L.LightningModule):
    def __init__(self, tp: int) -> None:
        super().__init__()
        self.tp = tp
        if tp == 1:  # dim 0 sizes 5, 3 and 1: every split over 2 ranks is uneven and rank 1 holds empty pieces
            self.net = nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.2), nn.ReLU(), nn.Linear(5, 3), nn.ReLU(),
                                     nn.Linear(3, 1))
        else:  # sizes the tensor-parallel plan splits evenly; the last layer, outside it, is replicated over tp
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.ReLU(), nn.Linear(8, 4), nn.ReLU(),
                                     nn.Linear(4, 1))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if self.tp > 1:  # the MLP over the tensor-parallel mesh first, as torchtitan does
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )

            parallelize_module(self.net, self.device_mesh["tensor_parallel"],
                               {"0": ColwiseParallel(), "3": RowwiseParallel()})
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def on_before_optimizer_step(self, optimizer) -> None:
        # Under FSDP x TP, Lightning's gradient_clip_val fails (clip_grad_norm_ cannot stack norms of
        # two meshes): clipped per mesh here, as torchtitan does; diffckpt records what the step consumed.
        if self.tp > 1:
            groups: dict = {}
            for p in self.parameters():
                groups.setdefault(p.device_mesh, []).append(p)
            for params in groups.values():
                torch.nn.utils.clip_grad_norm_(params, 0.05)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Recorder(L.Callback):
    """Prints ``STEP n``; with ``full``, gathers the full tensors after every optimizer step."""

    def __init__(self, full: bool) -> None:
        self.full = full
        self.steps: dict[int, dict] = {}

    def _gather(self, trainer, pl_module) -> None:
        step = trainer.global_step
        if self.full and step not in self.steps:  # every rank takes part in the gathers
            self.steps[step] = tensors(pl_module, trainer.optimizers[0], full)

    def on_train_start(self, trainer, pl_module):
        self._gather(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, *args):
        self._gather(trainer, pl_module)
        if trainer.is_global_zero:
            print(f"STEP {trainer.global_step}", flush=True)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dirpath")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--ckpt-path")
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (2 x tp processes)")
    ap.add_argument("--model-checkpoint", help="also a ModelCheckpoint (every 2 steps) into this directory")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    L.seed_everything(7, verbose=False)
    torch.use_deterministic_algorithms(True)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(48, 4, generator=g)
    data = list(zip(x, x.sum(-1) + 0.1 * torch.randn(48, generator=g)))
    loader = StatefulDataLoader(data, batch_size=4, shuffle=True)  # 6 batches per rank and epoch
    recorder = Recorder(args.full)
    callbacks: list = [recorder]
    plugins: list = []
    if args.dirpath:
        from diffckpt import CheckpointOptions
        from lightning_ckpt import DiffCheckpoint, DiffCheckpointIO

        callbacks.append(DiffCheckpoint(args.dirpath, write_batch=2, base_every_n_steps=4,
                                        # retention=None and every step durable: resumes from any step of the run
                                        options=CheckpointOptions(fingerprint_every_n_steps=3, retention=None,
                                                                  durability="every_step")))
        plugins.append(DiffCheckpointIO())
        if args.model_checkpoint:
            from lightning.pytorch.callbacks import ModelCheckpoint

            callbacks.append(ModelCheckpoint(dirpath=args.model_checkpoint, every_n_train_steps=2, save_top_k=-1,
                                             save_last=True))
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=args.tp)
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=2 * args.tp, strategy=strategy, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=bool(args.dirpath), callbacks=callbacks, plugins=plugins,
                        deterministic=True, accumulate_grad_batches=2,
                        gradient_clip_val=0.05 if args.tp == 1 else None, gradient_clip_algorithm="norm",
                        limit_val_batches=0)
    ckpt = args.ckpt_path or ("last" if args.resume else None)
    model = Net(args.tp)
    trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt)
    # DiffCheckpoint's teardown took its methods off the strategy object again.
    assert not {"load_checkpoint", "save_checkpoint", "_diffckpt_glue"} & set(vars(strategy))
    rank = trainer.global_rank
    state = tensors(model, trainer.optimizers[0], local)
    state.update(schedulers=[c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
                 global_step=trainer.global_step, epoch=trainer.current_epoch,
                 batches=trainer.fit_loop.epoch_loop.batch_progress.total.completed,
                 rng=torch.get_rng_state(), np_rng=torch.from_numpy(np.random.get_state()[1].copy()),
                 py_rng=torch.tensor(random.getstate()[1]))
    torch.save(state, f"{args.out}.rank{rank}")
    if args.full and rank == 0:
        torch.save(recorder.steps, f"{args.out}.full")


if __name__ == "__main__":
    from helpers import finish_process, log_to_stdout

    log_to_stdout()

    main(sys.argv[1:])
    finish_process()
