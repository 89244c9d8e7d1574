"""A Lightning Fabric training loop for the tests, with or without FabricCheckpointer.

Without ``--dirpath`` it never imports diffckpt: the reference the checkpointed runs are compared
with. Prints ``STEP n`` after each optimizer step (for ``helpers.run_script``'s ``kill -9``) and
saves every rank's final model, optimizer, scheduler and RNG state to ``out`` (``out.rank<r>``).
With ``--devices 2`` Fabric's launcher starts the second process itself (DDP over gloo).

    python fabric_script.py OUT [--dirpath RUN] [--resume last] [--devices 2] [--accum 2] [--clip 1.0]
                                [--batch 8] [--stop-at STEP] [--log-samples PATH]

``--log-samples PATH`` appends ``epoch step id ...`` to ``PATH.rank<r>`` for each batch trained
(the samples' indices), for the tests that count samples.
"""

from __future__ import annotations

import argparse
import random

import numpy as np
import torch
from helpers import print_step
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                        torch.nn.Dropout(0.2), torch.nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--dirpath")
    p.add_argument("--resume")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--write-batch", type=int, default=2)
    p.add_argument("--base-every", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--stop-at", type=int, help="close and stop after this many optimizer steps")
    p.add_argument("--log-samples")
    args = p.parse_args()

    strategy = "ddp" if args.devices > 1 else "auto"
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    data = TensorDataset(torch.randn(96, 16), torch.randint(0, 4, (96,)), torch.arange(96))
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=args.batch, shuffle=True))

    ckpt = None
    start_epoch = 0
    if args.dirpath:
        from diffckpt import CheckpointOptions
        from lightning_ckpt import FabricCheckpointer
        ckpt = FabricCheckpointer(fabric, args.dirpath, model=model, optimizers=opt, schedulers=sched,
                                  every_n_steps=args.every, write_batch=args.write_batch,
                                  base_every_n_steps=args.base_every,
                                  options=CheckpointOptions(retention=None))  # resumes from any step
        if args.resume:
            print(f"RESUMED {ckpt.restore(args.resume if args.resume == 'last' else int(args.resume))} "
                  f"rank {fabric.global_rank}", flush=True)
        loader = ckpt.dataloader(loader)
        start_epoch = ckpt.epoch
    steps = ckpt.step if ckpt else 0
    batches = 0
    for epoch in range(start_epoch, args.epochs):
        for x, y, ids in loader:
            if args.log_samples:
                log_samples(args.log_samples, fabric.global_rank, epoch, steps + 1, ids)
            batches += 1
            last = batches % args.accum == 0
            with fabric.no_backward_sync(model, enabled=not last):
                fabric.backward(torch.nn.functional.cross_entropy(model(x), y) / args.accum)
            if not last:
                continue
            if args.clip:
                fabric.clip_gradients(model, opt, max_norm=args.clip)
            opt.step()
            sched.step()
            opt.zero_grad()
            steps += 1
            if fabric.is_global_zero:
                print_step(steps)
            if args.stop_at == steps:
                break
        if args.stop_at == steps:
            break
    if ckpt is not None:
        ckpt.close()
    rank = fabric.global_rank
    state = {"model": model.module.state_dict(), "optimizer": opt.optimizer.state_dict(),
             "scheduler": sched.state_dict(), "steps": steps, "torch_rng": torch.get_rng_state(),
             "numpy_rng": np.random.get_state()[1], "python_rng": random.getstate()[1]}
    torch.save(state, args.out if rank == 0 else f"{args.out}.rank{rank}")
    fabric.barrier()
    print("DONE", flush=True)


def log_samples(path: str, rank: int, epoch: int, step: int, ids: torch.Tensor) -> None:
    with open(f"{path}.rank{rank}", "a") as f:
        f.write(" ".join(map(str, [epoch, step, *ids.tolist()])) + "\n")


if __name__ == "__main__":
    from helpers import finish_process

    main()
    finish_process()
