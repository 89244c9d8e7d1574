"""The training runs of ``make gpu-check``'s kill/resume part (``bench/gpu_check.py``): one run per
process, on ``--device`` (``cuda``, or ``cpu`` for the check's dry run).

    python bench/gpu_runs.py SCENARIO --device cuda --steps 40 --out final.pt [--run-dir DIR]

Without ``--run-dir`` the run never imports diffckpt: it is the reference. With it, the run
checkpoints every step through the scenario's integration, resumes from ``last`` when the run
root holds a durable step, and prints ``START <step>`` and ``STEP <n>`` lines (the parent kills it
with SIGKILL at a step it chose). Either way it saves its final state to ``--out``.

Scenarios: ``plain-single`` / ``plain-foreach`` / ``plain-fused`` (a hand-written loop over
``CheckpointEngine``, AdamW's single-tensor, foreach and fused implementations; its default is
foreach on CUDA and single-tensor on the CPU),
``lightning-bf16`` / ``lightning-16`` (``Trainer`` with ``bf16-mixed``, and ``16-mixed`` with its
gradient scaler), ``accelerate`` (``Accelerator(mixed_precision="bf16")`` and
``accelerate_ckpt.DiffCheckpointer``). ``gpt2`` (not among the tiny scenarios: ``make gpu-check``'s
``kill-124m`` part) is the plain loop over GPT-2 at ``--size`` (``bench/gpu_scale.py``'s sizes,
``124m`` on the GPU, a ``GPT2Config`` with eager attention, no download) with bf16 autocast and
AdamW's default implementation. The plain loops print each step's durable and node-local steps
after it: ``STEP <n> durable <d> local <l>``.

Every run sets ``torch.use_deterministic_algorithms(True)`` (with ``CUBLAS_WORKSPACE_CONFIG``),
the settings under which two plain runs on one device are bitwise identical.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples"), os.path.join(ROOT, "bench")]
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: cuBLAS is deterministic

SCENARIOS = ["plain-single", "plain-foreach", "plain-fused", "lightning-bf16", "lightning-16", "accelerate"]
CUDA_ONLY = {"lightning-16": "16-mixed (fp16 with a gradient scaler) runs only on CUDA"}
LARGE = ["gpt2"]  # a scenario of its own part: GPT-2 at --size
SIZE = "tiny"  # gpt.py's preset: the check is about exactness, not speed
WRITE_BATCH = 4
GPT2_BATCH = 2  # sequences per step of the gpt2 scenario: exactness at the model's size, not speed


def to_cpu(tree: Any) -> Any:
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_cpu(v) for v in tree)
    return tree


def rng_states() -> dict[str, Any]:
    """The generators training draws from next (dropout, shuffling): equal only if resume restored them."""
    import torch

    return {"cpu": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})}


# --------------------------------------------------------------------------------- plain loop
def plain(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from gpt import GPT
    from torch.nn import functional as F

    impl = args.scenario.split("-")[1]
    model = GPT(SIZE, total_steps=args.steps).to(args.device)
    flags = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[impl]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, **flags)
    cfg = model.cfg

    def batch(step: int) -> torch.Tensor:  # the data of a step depends on the step alone
        g = torch.Generator().manual_seed(1000 + step)
        return torch.randint(0, cfg.vocab, (cfg.batch_size, cfg.ctx + 1), generator=g).to(args.device)

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x[:, :-1]).reshape(-1, cfg.vocab), x[:, 1:].reshape(-1))

    return loop(args, model, opt, batch, loss_of)


def gpt2(args: argparse.Namespace) -> dict[str, Any]:
    """GPT-2 at ``--size`` (eager attention: every kernel of it has a deterministic implementation
    on CUDA), bf16 autocast, AdamW's default implementation (foreach on CUDA)."""
    import torch
    from gpu_scale import SIZES
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    layers, dim, heads, vocab, ctx = SIZES[args.size]
    cfg = GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab, n_positions=ctx,
                     bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    cfg._attn_implementation = "eager"
    model = GPT2LMHeadModel(cfg).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    def batch(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + step)
        return torch.randint(0, vocab, (GPT2_BATCH, ctx), generator=g).to(args.device)

    def loss_of(ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast(args.device, dtype=torch.bfloat16):
            return model(input_ids=ids, labels=ids).loss

    return loop(args, model, opt, batch, loss_of)


def loop(args: argparse.Namespace, model: Any, opt: Any, batch: Any, loss_of: Any) -> dict[str, Any]:
    """The hand-written loop over ``CheckpointEngine`` (with ``--run-dir``): clipping, a warm-up
    schedule, a diff every step; the state a resume restores besides model and optimizer is the
    scheduler and the RNG."""
    import torch

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    engine, source, step = None, None, 0
    if args.run_dir:
        from diffckpt import CheckpointEngine, CheckpointOptions
        from diffckpt.rng import get_rng_state, set_rng_state

        class Loop:  # the FrameworkState of this loop: the scheduler and the RNG
            def rank_state(self) -> Any:
                return {"rng": get_rng_state()}

            def state(self, ranks: list[Any]) -> Any:
                return {"scheduler": sched.state_dict(), "ranks": ranks}

        source = Loop()
        engine = CheckpointEngine(args.run_dir, CheckpointOptions(write_batch=WRITE_BATCH, base_every_n_steps=25))
        restored = engine.resume(model, [opt]) if args.resume else None
        if restored is not None:
            step = restored.step
            sched.load_state_dict(restored.state["scheduler"])
            set_rng_state(restored.state["ranks"][0]["rng"])
        print(f"START {step}", flush=True)
        engine.begin(model, [opt], step, source)
    model.train()
    while step < args.steps:
        step += 1
        x = batch(step)
        opt.zero_grad(set_to_none=True)
        loss = loss_of(x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if engine is not None:
            engine.commit(step, source)
            keep_up(engine, step, args)
            tiers = engine.metrics()
            print(f"STEP {step} durable {tiers.get('diffckpt/durable_step', -1):.0f} "
                  f"local {tiers.get('diffckpt/local_step', -1):.0f}", flush=True)
    if engine is not None:
        engine.end()
    return {"model": model.state_dict(), "optimizers": [opt.state_dict()], "schedulers": [sched.state_dict()],
            "rng": rng_states()}


# ---------------------------------------------------------------------------------- Lightning
def lightning(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    from gpt import GPT, make_loader

    class Progress(L.Callback):
        def on_train_start(self, trainer: Any, *_: Any) -> None:
            print(f"START {trainer.global_step}", flush=True)

        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            keep_up(callbacks[1].engine, trainer.global_step, args)
            print(f"STEP {trainer.global_step}", flush=True)

    L.seed_everything(0, verbose=False)
    model = GPT(SIZE, total_steps=args.steps)
    callbacks: list[Any] = []
    plugins: list[Any] = []
    if args.run_dir:
        from lightning_ckpt import DiffCheckpoint, DiffCheckpointIO

        callbacks += [Progress(), DiffCheckpoint(args.run_dir, every_n_steps=1, write_batch=WRITE_BATCH, base_every_n_steps=25)]
        plugins.append(DiffCheckpointIO())
    precision = {"lightning-bf16": "bf16-mixed", "lightning-16": "16-mixed"}[args.scenario]
    trainer = L.Trainer(max_steps=args.steps, accelerator="gpu" if args.device == "cuda" else "cpu", devices=1,
                        precision=precision, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True,
                        enable_checkpointing=bool(args.run_dir), callbacks=callbacks, plugins=plugins)
    trainer.fit(model, train_dataloaders=make_loader(SIZE), ckpt_path="last" if args.resume else None)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return {"model": trainer.lightning_module.state_dict(),
            "optimizers": [o.state_dict() for o in trainer.optimizers],
            "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "scaler": scaler.state_dict() if scaler is not None else None,
            "global_step": trainer.global_step, "rng": rng_states()}


def keep_up(engine: Any, step: int, args: argparse.Namespace) -> None:
    """On the CPU (the check's dry run), wait until the writer is at most one segment behind
    before a step is announced: a tiny model's steps take milliseconds, and on a loaded machine
    the parent's kill could otherwise land before any segment is durable, which tests nothing.
    (On CUDA the writer is not waited for: what a kill finds durable there is part of the figure;
    a short pause per step leaves the parent time to kill at its step before the run ends.)"""
    if args.device != "cpu":
        time.sleep(0.02)
        return
    deadline = time.monotonic() + 30
    while engine.metrics().get("diffckpt/durable_step", step) < step - WRITE_BATCH and time.monotonic() < deadline:
        time.sleep(0.01)


# --------------------------------------------------------------------------------- Accelerate
def accelerate(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from gpt import GPT, make_dataset
    from torch.nn import functional as F

    accelerator = Accelerator(cpu=args.device == "cpu", mixed_precision="bf16")
    set_seed(0)
    model = GPT(SIZE, total_steps=args.steps)
    loader = torch.utils.data.DataLoader(make_dataset(SIZE), batch_size=model.cfg.batch_size, shuffle=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    vocab = accelerator.unwrap_model(model).cfg.vocab
    ckpt, batches, epoch, step = None, loader, 0, 0
    if args.run_dir:
        from accelerate_ckpt import DiffCheckpointer

        ckpt = DiffCheckpointer(accelerator, args.run_dir, model=model, every_n_steps=1, write_batch=WRITE_BATCH,
                                base_every_n_steps=25)
        step = ckpt.restore("last")  # 0 on a fresh run
        batches, epoch = ckpt.dataloader(loader), ckpt.epoch
        print(f"START {step}", flush=True)
    while step < args.steps:
        for seq in batches:
            loss = F.cross_entropy(model(seq[:, :-1]).reshape(-1, vocab), seq[:, 1:].reshape(-1))
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            if ckpt is not None:
                keep_up(ckpt.engine, step, args)
                print(f"STEP {step}", flush=True)
            if step >= args.steps:
                break
        epoch += 1
    if ckpt is not None:
        ckpt.close()
    return {"model": accelerator.unwrap_model(model).state_dict(), "optimizers": [opt.optimizer.state_dict()],
            "schedulers": [sched.scheduler.state_dict()], "rng": rng_states()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", choices=SCENARIOS + LARGE)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--size", default="124m", help="the gpt2 scenario's size (bench/gpu_scale.py's SIZES)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--run-dir")
    ap.add_argument("--resume", action="store_true", help="resume from the run root's newest durable step")
    args = ap.parse_args()
    import torch

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    run = {"plain": plain, "lightning": lightning, "accelerate": accelerate, "gpt2": gpt2}[args.scenario.split("-")[0]]
    torch.save(to_cpu(run(args)), args.out)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
