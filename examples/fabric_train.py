"""Differential checkpoints in a Lightning Fabric loop: run it, interrupt it (Ctrl-C or kill -9),
run it again and it continues from the newest durable step, bit for bit.

    python examples/fabric_train.py runs/fabric-demo              # one process
    python examples/fabric_train.py runs/fabric-demo --devices 2  # DDP on the CPU (gloo)
"""

from __future__ import annotations

import argparse

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt import FabricCheckpointer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dirpath", help="run root: a local path or an fsspec URL")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--epochs", type=int, default=5)
    args = p.parse_args()

    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto")
    fabric.launch()
    fabric.seed_everything(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    model, opt = fabric.setup(model, opt)
    data = TensorDataset(torch.randn(512, 32), torch.randint(0, 4, (512,)))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=16, shuffle=True))

    with FabricCheckpointer(fabric, args.dirpath, model=model, optimizers=opt, schedulers=sched,
                            every_n_steps=1, write_batch=8, base_every_n_steps=200) as ckpt:
        start = ckpt.restore("last")  # 0 on a fresh run root
        fabric.print(f"starting at step {start}, epoch {ckpt.epoch}")
        for epoch in range(ckpt.epoch, args.epochs):
            for x, y in ckpt.dataloader(loader):  # each batch request commits the previous step
                loss = torch.nn.functional.cross_entropy(model(x), y)
                fabric.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            fabric.print(f"epoch {epoch}: step {ckpt.step}")
    fabric.print(f"durable up to step {ckpt.durable_step} in {args.dirpath}")


if __name__ == "__main__":
    main()
