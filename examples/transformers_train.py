"""A transformers ``Trainer`` run with diffckpt: train, kill -9, resume, check it is bit-exact.

The child in :func:`train` is an ordinary ``Trainer`` run (a 2-layer GPT-2 built from a config, so
nothing is downloaded; synthetic token rows; dropout; the shuffling sampler; gradient
accumulation, clipping, warm-up + cosine schedule, the default fused AdamW) plus the lines that
checkpoint it with :class:`transformers_ckpt.DiffCheckpointCallback`. Run this file and it:

1. trains without diffckpt (the reference);
2. trains with a diff every optimizer step and kills the process with SIGKILL midway;
3. resumes in a new process with ``trainer.train(resume_from_checkpoint=True)`` and trains to the
   end;
4. compares every tensor of the final model, optimizer, scheduler and RNG states with
   ``torch.equal``, and the log history with ``==``, and reports the bytes written.

    python examples/transformers_train.py                  # one process
    python examples/transformers_train.py --processes 2    # DDP over gloo, via torchrun
    python examples/transformers_train.py --bf16           # bf16 autocast

Runs in well under a minute on a CPU. Exit status 1 if the resumed run is not bit-exact.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB, LENGTH = 64, 16
# log_history keys that measure wall-clock time: the only entries two runs cannot share
TIMINGS = ("train_runtime", "train_samples_per_second", "train_steps_per_second")


class Rows(torch.utils.data.Dataset):
    """Windows of a repeated random pattern with 10% noise: a loss that visibly falls. The rows
    are fixed when the dataset is built; ``__getitem__`` draws no random numbers (see
    docs/transformers.md, "What is not exact")."""

    def __init__(self, n: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        pattern = torch.randint(0, VOCAB, (13,), generator=g)
        starts = torch.randint(0, 13, (n, 1), generator=g)
        rows = pattern[(starts + torch.arange(LENGTH)) % 13]
        noise = torch.rand(rows.shape, generator=g) < 0.1
        self.x = torch.where(noise, torch.randint(0, VOCAB, rows.shape, generator=g), rows)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def train(args: argparse.Namespace) -> None:
    import numpy as np
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    print(f"PID {os.getpid()}", flush=True)  # every process: the demo kills them all

    class Progress(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            if state.is_world_process_zero:
                print(f"STEP {state.global_step}", flush=True)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32))
    targs = TrainingArguments(
        output_dir=args.output_dir, use_cpu=True, seed=42, num_train_epochs=args.epochs,
        per_device_train_batch_size=8, gradient_accumulation_steps=2, max_grad_norm=1.0,
        learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=4, bf16=args.bf16,
        logging_steps=4, save_strategy="no", report_to="none", disable_tqdm=True)
    callbacks: list = [Progress()]
    callback = None
    if args.run_dir:  # the diffckpt lines: the callback, and where train() resumes from
        from transformers_ckpt import DiffCheckpointCallback

        callback = DiffCheckpointCallback(args.run_dir, every_n_steps=1, write_batch=4, base_every_n_steps=50)
        callbacks.append(callback)
    trainer = Trainer(model=model, args=targs, train_dataset=Rows(), callbacks=callbacks)
    # A script that both starts and resumes would pass callback.checkpoint() instead: the newest
    # durable step's resume point, or None on a fresh run.
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    rank = trainer.args.process_index
    if callback is not None and args.resume and rank == 0:
        print(f"START {callback.resumed_step}", flush=True)
    opt = trainer.optimizer.optimizer  # the torch optimizer inside Accelerate's wrapper
    log = [{k: v for k, v in entry.items() if k not in TIMINGS} for entry in trainer.state.log_history]
    final = {"model": model.state_dict(), "optimizer": opt.state_dict(),
             "scheduler": trainer.lr_scheduler.state_dict(), "torch_rng": torch.get_rng_state(),
             "numpy_rng": torch.from_numpy(np.random.get_state()[1].astype(np.int64)),
             "python_rng": list(random.getstate()[1]), "log_history": json.dumps(log, sort_keys=True)}
    torch.save(final, f"{args.out}.rank{rank}")
    if rank == 0:
        steps = trainer.state.global_step
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        print(f"TOTAL {steps}", flush=True)
        print(f"LOSS {losses[0]:.3f} {losses[-1]:.3f}", flush=True)
        full = os.path.join(os.path.dirname(args.out), "full.pt")
        torch.save({"model": final["model"], "optimizer": final["optimizer"]}, full)
        print(f"FULL_BYTES {os.path.getsize(full)}", flush=True)


# ------------------------------------------------------------------------------------ the demo
def spawn(args: argparse.Namespace, work: str, name: str, run_dir: str | None, log,
          resume: bool = False) -> subprocess.Popen:
    launch = [sys.executable] if args.processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.processes),
        "--master_port", str(29400 + random.randrange(500))]
    cmd = [*launch, os.path.abspath(__file__), "--child", "--out", os.path.join(work, f"{name}.pt"),
           "--output-dir", os.path.join(work, "trainer-ref" if run_dir is None else "trainer"),
           "--epochs", str(args.epochs)]
    cmd += (["--run-dir", run_dir] if run_dir else []) + (["--resume"] if resume else [])
    cmd += ["--bf16"] if args.bf16 else []
    root = os.path.dirname(HERE)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, start_new_session=True)


def watch(proc: subprocess.Popen, kill_at: int | None = None) -> dict:
    seen: dict = {"pids": []}
    began = time.perf_counter()
    for line in proc.stdout:
        key, _, rest = line.strip().partition(" ")
        if key == "STEP":
            if kill_at is not None and int(rest) >= kill_at:
                # torchrun starts its workers in sessions of their own: kill each one, then the
                # launcher's group.
                for pid in seen["pids"]:
                    os.kill(pid, signal.SIGKILL)
                os.killpg(proc.pid, signal.SIGKILL)
                seen["killed_at"] = int(rest)
                break
        elif key == "PID":
            seen["pids"].append(int(rest))
        elif key in ("START", "TOTAL", "FULL_BYTES"):
            seen[key] = int(rest)
        elif key == "LOSS":
            seen[key] = tuple(float(x) for x in rest.split())
    proc.stdout.close()
    seen["rc"] = proc.wait()
    seen["seconds"] = time.perf_counter() - began
    return seen


def demo(args: argparse.Namespace) -> int:
    from diffckpt.runstore import RunStore
    from diffckpt.storage import open_storage

    work = tempfile.mkdtemp(prefix="diffckpt-transformers-")
    run_dir, log_path = os.path.join(work, "run"), os.path.join(work, "children.log")
    try:
        with open(log_path, "w") as log:
            print("[1/3] reference: the same Trainer run without diffckpt ...", flush=True)
            ref = watch(spawn(args, work, "ref", None, log))
            if ref["rc"]:
                return fail(f"the reference exited with {ref['rc']}", log_path)
            total = ref["TOTAL"]
            kill_at = random.Random(args.seed).randint(total * 4 // 10, total * 7 // 10)
            print(f"[2/3] with DiffCheckpointCallback, a diff every step; SIGKILL after step {kill_at} ...",
                  flush=True)
            crashed = watch(spawn(args, work, "unused", run_dir, log), kill_at=kill_at)
            if "killed_at" not in crashed:
                return fail(f"the run ended (rc {crashed['rc']}) before step {kill_at}", log_path)
            print("[3/3] a new process: trainer.train(resume_from_checkpoint=True) to the end ...", flush=True)
            resumed = watch(spawn(args, work, "resumed", run_dir, log, resume=True))
            if resumed["rc"]:
                return fail(f"the resumed run exited with {resumed['rc']}", log_path)
        tensors, differ = 0, []
        for rank in range(args.processes):
            a = torch.load(os.path.join(work, f"ref.pt.rank{rank}"), weights_only=True)
            b = torch.load(os.path.join(work, f"resumed.pt.rank{rank}"), weights_only=True)
            n, d = compare(a, b, f"rank{rank}")
            tensors, differ = tensors + n, differ + d
        inv = RunStore(open_storage(run_dir)).inventory()
        bases = sum(n for p, n in inv.sizes.items() if p.startswith("bases/"))
        diffs = sum(n for p, n in inv.sizes.items() if p.startswith("diffs/"))
        steps = max(sum(s.last - s.after for s in inv.segments), 1)
        full = ref["FULL_BYTES"]
        params = sum(t.numel() for k, t in a["model"].items() if k != "lm_head.weight")  # tied
        first, last = ref["LOSS"]
        print(f"\ndiffckpt + transformers Trainer: GPT-2 ({params / 1e3:.0f}k parameters), {args.processes} "
              f"process(es), {'bf16 autocast, ' if args.bf16 else ''}accumulation 2, clipping, "
              f"warm-up + cosine, fused AdamW, {total} steps")
        rows = [("reference", f"{ref['seconds']:.1f} s, logged loss {first:.2f} -> {last:.2f}"),
                ("killed with SIGKILL after step", str(crashed["killed_at"])),
                ("resumed from step (newest durable)", str(resumed["START"])),
                ("on storage", (f"{bases / 1e6:.2f} MB in {len(inv.bases)} bases + {diffs / 1e6:.2f} MB "
                                f"of diffs in {len(inv.segments)} segments")),
                ("diff bytes per step", (f"{diffs / steps / 1e3:.1f} kB ({100 * diffs / steps / full:.1f}% of "
                                         f"a {full / 1e6:.2f} MB model + optimizer checkpoint)")),
                ("tensors compared with torch.equal", str(tensors)),
                ("log history", "equal" if not any("log_history" in d for d in differ) else "differs")]
        for label, value in rows:
            print(f"  {label:<36}  {value}")
        print(f"  bit-exact: {'yes' if not differ else 'no'}")
        for d in differ[:10]:
            print(f"    differs: {d}")
        return 1 if differ else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def compare(a, b, path: str = "") -> tuple[int, list[str]]:
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return 1, [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        parts = [compare(a[k], b[k], f"{path}[{k!r}]") for k in a]
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        parts = [compare(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b))]
    else:
        return 0, [] if a == b else [f"{path}: {a!r} != {b!r}"]
    return sum(n for n, _ in parts), [d for _, ds in parts for d in ds]


def fail(message: str, log_path: str) -> int:
    with open(log_path) as f:
        print(f"demo failed: {message}\n--- children's stderr (tail) ---\n{f.read()[-3000:]}")
    return 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=1, help="1, or 2+ for DDP over gloo via torchrun")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (on CPU: the optimizer stays fp32)")
    ap.add_argument("--seed", type=int, default=0, help="chooses the kill step")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--output-dir", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        train(args)
    else:
        sys.exit(demo(args))


if __name__ == "__main__":
    main()
