"""An Accelerate training loop for the tests, with or without DiffCheckpointer.

Without ``--dirpath`` it never imports diffckpt: the reference the checkpointed runs are compared
with. Prints ``STEP n`` after each optimizer step (for ``helpers.run_script``'s ``kill -9``) and
saves the final model, optimizer, scheduler and RNG state to ``out``.

    python accel_script.py OUT [--dirpath RUN] [--resume last|N] [--accum 2] [--clip 1.0]
                               [--mp bf16] [--codec topk] [--epochs 3]
"""

from __future__ import annotations

import argparse
import os
import random
import signal

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from helpers import print_step
from torch.utils.data import DataLoader, TensorDataset


class Net(torch.nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.BatchNorm1d(width), torch.nn.ReLU(),
                                        torch.nn.Dropout(0.2), torch.nn.Linear(width, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--dirpath")
    p.add_argument("--resume")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--mp", default="no")
    p.add_argument("--codec")
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--base-every", type=int, default=10)
    p.add_argument("--write-batch", type=int, default=2)
    p.add_argument("--no-track", action="store_true", help="iterate the loader directly (fallback commit)")
    p.add_argument("--save-state-at", type=int, help="call accelerator.save_state at this step")
    p.add_argument("--save-dir")
    p.add_argument("--load-state", help="accelerator.load_state(DIR) instead of restore()")
    p.add_argument("--stop-at", type=int, help="stop the loop after this many optimizer steps")
    p.add_argument("--dump-steps", help="save model, optimizer and scheduler state after each step here")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--auto", action="store_true", help='every_n_steps, write_batch, base_every_n_steps="auto"')
    p.add_argument("--stateful", action="store_true", help="use_stateful_dataloader=True")
    p.add_argument("--log-samples", help="append 'epoch step id ...' per batch to PATH.rank<r>")
    p.add_argument("--compact", action="store_true",
                   help="no bases from training: background compaction every 4 steps, keep the last 2 bases")
    p.add_argument("--scaler", action="store_true",
                   help="fp16 loss scaling on CPU (Accelerate gives CPU no GradScaler): a real GradScaler "
                        "whose large initial scale makes the first steps find infs and skip")
    args = p.parse_args()
    signal.signal(signal.SIGINT, signal.default_int_handler)

    loaders = DataLoaderConfiguration(use_stateful_dataloader=args.stateful)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accum, mixed_precision=args.mp,
                              dataloader_config=loaders)
    set_seed(0)
    data = TensorDataset(torch.randn(args.samples, 16), torch.randint(0, 4, (args.samples,)),
                         torch.arange(args.samples))
    dl = DataLoader(data, batch_size=args.batch, shuffle=True)
    if args.scaler:
        accelerator.scaler, accelerator.native_amp = torch.amp.GradScaler("cpu", init_scale=2.0**30), True
    model = Net(args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)

    ckpt = None
    loader = dl
    start_epoch = 0
    if args.codec and not args.dirpath:

        from accelerate_ckpt import GradientCompression
        GradientCompression(accelerator, make_codec(args.codec), model=model)
    if args.dirpath:
        from accelerate_ckpt import DiffCheckpointer
        knobs: dict = {"every_n_steps": args.every, "write_batch": args.write_batch,
                       "base_every_n_steps": args.base_every}
        # resumes from any step of the run (every step kept and durable), unless --compact
        options: dict = {"retention": None, "durability": "every_step"}
        if args.auto:  # reviewed often, with a short MTBF so that the choice is not trivial
            from diffckpt import TuningOptions
            knobs = dict.fromkeys(knobs, "auto")
            options["tuning"] = TuningOptions(mtbf_s=30, max_overhead=0.5, retune_every_n_steps=5)
        if args.compact:
            from diffckpt import RetentionPolicy
            knobs.update(base_every_n_steps=None)
            options.update(compact_every_n_steps=4, retention=RetentionPolicy(keep_last_bases=2))
        from diffckpt import CheckpointOptions
        ckpt = DiffCheckpointer(accelerator, args.dirpath, model=model, options=CheckpointOptions(**options),
                                codec=make_codec(args.codec) if args.codec else None, **knobs)
        if not args.no_track:
            loader = ckpt.dataloader(dl)
        if args.load_state:
            accelerator.load_state(args.load_state)
            print(f"RESUMED {ckpt.step} rank {accelerator.process_index}", flush=True)
        elif args.resume:
            start = ckpt.restore("last" if args.resume == "last" else int(args.resume))
            print(f"RESUMED {start} rank {accelerator.process_index}", flush=True)
        start_epoch = ckpt.epoch
    steps = ckpt.step if ckpt else 0
    try:
        for epoch in range(start_epoch, args.epochs):
            for x, y, ids in loader:
                if args.log_samples:
                    with open(f"{args.log_samples}.rank{accelerator.process_index}", "a") as f:
                        f.write(" ".join(map(str, [epoch, steps + 1, *ids.tolist()])) + "\n")
                with accelerator.accumulate(model):
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                    accelerator.backward(loss)
                    if args.clip and accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), args.clip)
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                if accelerator.sync_gradients:
                    steps += 1
                    if args.dump_steps and accelerator.is_main_process:
                        torch.save(final_state(accelerator, model, opt, sched, steps),
                                   os.path.join(args.dump_steps, f"step{steps}.pt"))
                    if args.save_state_at == steps:
                        accelerator.save_state(args.save_dir)
                    if accelerator.is_main_process:
                        print_step(steps)
                    if args.stop_at == steps:
                        raise StopTraining
    except StopTraining:
        pass
    if ckpt is not None:
        ckpt.close()
    rank = accelerator.process_index
    state = dict(final_state(accelerator, model, opt, sched, steps), torch_rng=torch.get_rng_state(),
                 numpy_rng=np.random.get_state()[1], python_rng=random.getstate()[1])
    torch.save(state, args.out if rank == 0 else f"{args.out}.rank{rank}")
    accelerator.wait_for_everyone()
    print("DONE", flush=True)
    accelerator.end_training()  # destroys the process group


def final_state(accelerator, model, opt, sched, steps: int) -> dict:
    return {"model": accelerator.unwrap_model(model).state_dict(), "optimizer": opt.optimizer.state_dict(),
            "scheduler": sched.state_dict(), "steps": steps, "accelerator_step": accelerator.step}


class StopTraining(Exception):
    pass


def make_codec(name: str):
    from diffckpt.codecs import LowPrecision, PowerSGD, TopK
    return {"topk": lambda: TopK(0.05), "powersgd": lambda: PowerSGD(2, error_feedback=False),
            "bf16": lambda: LowPrecision("bf16")}[name]()


if __name__ == "__main__":
    from helpers import finish_process

    main()
    finish_process()
