"""A Lightning DDP run that logs the samples each rank trains on, for the data order tests.

    order_script.py RUN SAMPLES [--devices N] [--stop-at STEP] [--resume] [--workers W]

96 samples in batches of 4 from a shuffled ``StatefulDataLoader`` (Lightning deals it over the
ranks through ``DistributedSamplerWrapper``), 3 epochs, one optimizer step per batch, checkpointed
by ``DiffCheckpoint`` into RUN. Each rank appends ``epoch step id ...`` to ``SAMPLES.rank<r>``
for every batch it trains; ``--stop-at`` stops the fit after that optimizer step (mid-epoch);
``--resume`` fits with ``ckpt_path="last"``; ``--workers`` loads with worker processes.
"""

from __future__ import annotations

import argparse
import sys

import lightning as L
import torch
from torchdata.stateful_dataloader import StatefulDataLoader


class Net(L.LightningModule):
    def __init__(self, samples: str, stop_at: int | None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.samples, self.stop_at = samples, stop_at

    def training_step(self, batch, batch_idx):
        x, ids = batch
        with open(f"{self.samples}.rank{self.global_rank}", "a") as f:
            f.write(" ".join(map(str, [self.current_epoch, self.global_step + 1, *ids.tolist()])) + "\n")
        return self.layer(x).pow(2).mean()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.trainer.is_global_zero:
            print(f"STEP {self.global_step}", flush=True)
        if self.global_step == self.stop_at:
            self.trainer.should_stop = True

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("samples")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--stop-at", type=int)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--workers", type=int, default=0)
    args = ap.parse_args(argv)

    from lightning_ckpt import DiffCheckpoint, DiffCheckpointIO

    L.seed_everything(7, verbose=False)
    data = list(zip(torch.randn(96, 4, generator=torch.Generator().manual_seed(1)), torch.arange(96)))
    loader = StatefulDataLoader(data, batch_size=4, shuffle=True, num_workers=args.workers,
                                persistent_workers=args.workers > 0)
    trainer = L.Trainer(max_epochs=3, accelerator="cpu", devices=args.devices,
                        strategy="ddp" if args.devices > 1 else "auto", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[DiffCheckpoint(args.run, write_batch=2, base_every_n_steps=8)],
                        plugins=[DiffCheckpointIO()])
    trainer.fit(Net(args.samples, args.stop_at), train_dataloaders=loader,
                ckpt_path="last" if args.resume else None)


if __name__ == "__main__":
    from helpers import finish_process, log_to_stdout

    log_to_stdout()

    main(sys.argv[1:])
    finish_process()
