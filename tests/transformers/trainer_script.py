"""A real transformers ``Trainer`` run on CPU for the tests: a 2-layer GPT-2 built from a config
(no downloads), synthetic token rows, dropout on, a shuffling sampler, a warm-up/cosine schedule.

Prints ``STEP n`` after each optimizer step (for ``helpers.run_script``'s ``kill -9``) and, when
resumed, ``RESUMED n``; writes the final state of every rank (model, optimizer, scheduler, RNG,
log history) to ``OUT`` (rank r > 0: ``OUT.rank<r>``). Without ``--dirpath`` it never imports
diffckpt: that is the reference run.
"""

from __future__ import annotations

import argparse
import json
import os
import random

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class Progress(TrainerCallback):
    def __init__(self, raise_at: int | None = None) -> None:
        self.raise_at = raise_at
        self.began_at: int | None = None  # the step training began from (a resume's step)

    def on_train_begin(self, args, state, control, **kw):
        self.began_at = state.global_step

    def on_step_end(self, args, state, control, **kw):
        if state.is_world_process_zero:
            print(f"STEP {state.global_step}", flush=True)
        if state.global_step == self.raise_at:
            raise RuntimeError(f"user code failed at step {state.global_step}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--dirpath", help="run root of DiffCheckpointCallback (none: the reference run)")
    p.add_argument("--resume", help="true (resume_from_checkpoint=True), last or a step (callback.checkpoint), "
                                    "or a checkpoint folder")
    p.add_argument("--rows", type=int, default=24)
    p.add_argument("--epochs", type=float, default=3)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--unseeded-sampler", action="store_true", help="use_seedable_sampler=False")
    p.add_argument("--eval-epoch", action="store_true", help="evaluate at every epoch's end")
    p.add_argument("--save-steps", type=int, default=0, help="the Trainer's own saves too")
    p.add_argument("--every", default="1")
    p.add_argument("--batch", default="2", help="write_batch")
    p.add_argument("--base-every", default="8")
    p.add_argument("--optim", default="adamw_torch_fused")
    p.add_argument("--raise-at", type=int, help="raise an exception at this step's end")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per step (to land kills mid-run)")
    a = p.parse_args()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    save = {"save_strategy": "steps", "save_steps": a.save_steps} if a.save_steps else {"save_strategy": "no"}
    args = TrainingArguments(
        output_dir=a.output_dir, use_cpu=True, per_device_train_batch_size=4, num_train_epochs=a.epochs,
        learning_rate=1e-3, max_grad_norm=a.clip, lr_scheduler_type="cosine", warmup_steps=2,
        gradient_accumulation_steps=a.accum, logging_steps=3, seed=42, report_to="none", bf16=a.bf16,
        optim=a.optim, disable_tqdm=True, dataloader_num_workers=0,
        eval_strategy="epoch" if a.eval_epoch else "no", per_device_eval_batch_size=4,
        accelerator_config={"use_seedable_sampler": not a.unseeded_sampler}, **save)
    progress = Progress(a.raise_at)
    callbacks: list = [progress]
    cb = None
    if a.dirpath:
        from diffckpt import CheckpointOptions
        from transformers_ckpt import DiffCheckpointCallback

        def knob(v: str):
            return v if v == "auto" else None if v == "none" else int(v)
        cb = DiffCheckpointCallback(a.dirpath, every_n_steps=knob(a.every), write_batch=knob(a.batch),
                                    base_every_n_steps=knob(a.base_every),
                                    options=CheckpointOptions(retention=None, durability="every_step"))  # any step
        callbacks.append(cb)
    if a.sleep:
        class Slow(TrainerCallback):
            def on_step_end(self, *args, **kw):
                import time
                time.sleep(a.sleep)
        callbacks.append(Slow())
    trainer = Trainer(model=model, args=args, train_dataset=Rows(a.rows),
                      eval_dataset=Rows(8) if a.eval_epoch else None, callbacks=callbacks)
    resume = None
    if a.resume == "true":
        resume = True
    elif a.resume is not None:
        assert cb is not None or os.path.isdir(a.resume)
        resume = a.resume if os.path.isdir(a.resume) else cb.checkpoint("last" if a.resume == "last" else int(a.resume))
    trainer.train(resume_from_checkpoint=resume)
    if resume is not None and trainer.args.process_index == 0:
        print(f"RESUMED {progress.began_at if cb is None else cb.resumed_step}", flush=True)
    rank = trainer.args.process_index
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    final = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizer": opt.state_dict(),
             "scheduler": trainer.lr_scheduler.state_dict(), "torch_rng": torch.get_rng_state(),
             "numpy_rng": np.random.get_state()[1].copy(), "python_rng": random.getstate()[1],
             "global_step": trainer.state.global_step,
             "log": json.dumps([{k: v for k, v in e.items() if k not in ("train_runtime", "train_samples_per_second",
                                                                          "train_steps_per_second", "eval_runtime",
                                                                          "eval_samples_per_second",
                                                                          "eval_steps_per_second")}
                                for e in trainer.state.log_history], sort_keys=True)}
    torch.save(final, a.out if rank == 0 else f"{a.out}.rank{rank}")


if __name__ == "__main__":
    from helpers import finish_process

    main()
    finish_process()
