"""An Accelerate training loop with diffckpt: train, kill -9, resume, check it is bit-exact.

The loop in :func:`train` is an ordinary Accelerate loop (gradient accumulation, clipping, a
warm-up schedule, bf16 autocast, dropout, a shuffling loader) plus the four lines that
checkpoint it with :class:`accelerate_ckpt.DiffCheckpointer`. Run this file and it:

1. trains the loop without diffckpt (the reference);
2. trains it with a diff every optimizer step and kills the process with SIGKILL midway;
3. resumes in a new process with ``ckpt.restore("last")`` and trains to the end;
4. compares every tensor of the final model, optimizer and scheduler with ``torch.equal``, and
   reports the bytes written.

    python examples/accelerate_train.py                  # one process
    python examples/accelerate_train.py --processes 2    # DDP over gloo, via torchrun
    python examples/accelerate_train.py --codec topk     # compressed training; payloads are the diffs

Runs in well under a minute on a CPU. Exit status 1 if the resumed run is not bit-exact.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB, CTX = 48, 32


class TinyLM(nn.Module):
    """A two-layer causal transformer language model."""

    def __init__(self, dim: int = 96, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(CTX, dim))
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.1, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(CTX), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        return self.head(self.body(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True))


def dataset(samples: int = 1024) -> torch.utils.data.TensorDataset:
    """Windows of a repeated random pattern with 10% noise: a loss that visibly falls."""
    g = torch.Generator().manual_seed(0)
    pattern = torch.randint(0, VOCAB, (19,), generator=g)
    starts = torch.randint(0, 19, (samples, 1), generator=g)
    seqs = pattern[(starts + torch.arange(CTX + 1)) % 19]
    noise = torch.rand(seqs.shape, generator=g) < 0.1
    return torch.utils.data.TensorDataset(torch.where(noise, torch.randint(0, VOCAB, seqs.shape, generator=g), seqs))


def train(args: argparse.Namespace) -> None:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, mixed_precision="bf16")
    print(f"PID {os.getpid()}", flush=True)  # every process: the demo kills them all
    set_seed(0)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=16, shuffle=True)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    steps_per_epoch = len(loader) // accelerator.num_processes // 2
    total = steps_per_epoch * args.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    ckpt, batches, first_epoch = None, loader, 0
    if args.run_dir:  # the four diffckpt lines
        from accelerate_ckpt import DiffCheckpointer

        ckpt = DiffCheckpointer(accelerator, args.run_dir, model=model, every_n_steps=1, write_batch=4,
                                base_every_n_steps=50, codec=make_codec(args.codec))
        step = ckpt.restore("last")  # 0 on a fresh run
        batches, first_epoch = ckpt.dataloader(loader), ckpt.epoch
        print(f"START {step}", flush=True)
    elif args.codec != "none":  # the reference trains with the same codec, without checkpoints
        from accelerate_ckpt import GradientCompression

        GradientCompression(accelerator, make_codec(args.codec), model=model)
    step = ckpt.step if ckpt else 0
    began = time.perf_counter()
    for _ in range(first_epoch, args.epochs):
        for (seq,) in batches:
            with accelerator.accumulate(model):
                logits = model(seq[:, :-1])
                loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                if accelerator.is_main_process:
                    print(f"STEP {step} {loss.item():.4f}", flush=True)
    if ckpt is not None:
        ckpt.close()  # flush the last steps
    if accelerator.is_main_process:
        print(f"SECONDS {time.perf_counter() - began:.2f}", flush=True)
        print(f"TOTAL {total}", flush=True)
        state = {"model": accelerator.unwrap_model(model).state_dict(),
                 "optimizer": optimizer.optimizer.state_dict(), "scheduler": scheduler.state_dict()}
        torch.save(state, args.out)
        full = os.path.join(os.path.dirname(args.out), "full.pt")
        torch.save({"model": state["model"], "optimizer": state["optimizer"]}, full)
        print(f"FULL_BYTES {os.path.getsize(full)}", flush=True)
    accelerator.end_training()  # destroys the process group before the interpreter exits


def make_codec(name: str):
    from diffckpt.codecs import PowerSGD, TopK

    return {"none": None, "topk": TopK(0.01), "powersgd": PowerSGD(4, error_feedback=False)}[name]


# ------------------------------------------------------------------------------------ the demo
def spawn(args: argparse.Namespace, out: str, run_dir: str | None, log) -> subprocess.Popen:
    launch = [sys.executable] if args.processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.processes),
        "--master_port", str(29400 + random.randrange(500))]
    cmd = launch + [os.path.abspath(__file__), "--child", "--out", out, "--epochs", str(args.epochs),
                    "--codec", args.codec] + (["--run-dir", run_dir] if run_dir else [])
    root = os.path.dirname(HERE)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, start_new_session=True)


def watch(proc: subprocess.Popen, kill_at: int | None = None) -> dict:
    seen: dict = {"losses": {}, "pids": []}
    for line in proc.stdout:
        key, _, rest = line.strip().partition(" ")
        if key == "STEP":
            step, loss = rest.split()
            seen["losses"][int(step)] = float(loss)
            if kill_at is not None and int(step) >= kill_at:
                # torchrun starts its workers in sessions of their own: kill each one, then the
                # launcher's group.
                for pid in seen["pids"]:
                    os.kill(pid, signal.SIGKILL)
                os.killpg(proc.pid, signal.SIGKILL)
                seen["killed_at"] = int(step)
                break
        elif key == "PID":
            seen["pids"].append(int(rest))
        elif key in ("START", "TOTAL", "FULL_BYTES"):
            seen[key] = int(rest)
        elif key == "SECONDS":
            seen[key] = float(rest)
    proc.stdout.close()
    seen["rc"] = proc.wait()
    return seen


def demo(args: argparse.Namespace) -> int:
    from diffckpt.runstore import RunStore
    from diffckpt.storage import open_storage

    work = tempfile.mkdtemp(prefix="diffckpt-accelerate-")
    run_dir, log_path = os.path.join(work, "run"), os.path.join(work, "children.log")
    try:
        with open(log_path, "w") as log:
            print("[1/3] reference: the same loop without diffckpt ...", flush=True)
            ref = watch(spawn(args, os.path.join(work, "ref.pt"), None, log))
            if ref["rc"]:
                return fail(f"the reference exited with {ref['rc']}", log_path)
            total = ref["TOTAL"]
            kill_at = random.Random(args.seed).randint(total * 4 // 10, total * 7 // 10)
            print(f"[2/3] with DiffCheckpointer, a diff every step; SIGKILL after step {kill_at} ...", flush=True)
            crashed = watch(spawn(args, os.path.join(work, "unused.pt"), run_dir, log), kill_at=kill_at)
            if "killed_at" not in crashed:
                return fail(f"the run ended (rc {crashed['rc']}) before step {kill_at}", log_path)
            print("[3/3] a new process: ckpt.restore('last'), then train to the end ...", flush=True)
            resumed = watch(spawn(args, os.path.join(work, "resumed.pt"), run_dir, log))
            if resumed["rc"]:
                return fail(f"the resumed run exited with {resumed['rc']}", log_path)
        a = torch.load(os.path.join(work, "ref.pt"), weights_only=True)
        b = torch.load(os.path.join(work, "resumed.pt"), weights_only=True)
        tensors, differ = compare(a, b)
        inv = RunStore(open_storage(run_dir)).inventory()
        bases = sum(n for p, n in inv.sizes.items() if p.startswith("bases/"))
        diffs = sum(n for p, n in inv.sizes.items() if p.startswith("diffs/"))
        steps = max(sum(s.last - s.after for s in inv.segments), 1)
        full = ref["FULL_BYTES"]
        params = sum(t.numel() for t in a["model"].values())
        losses = ref["losses"]
        print(f"\ndiffckpt + Accelerate: TinyLM ({params / 1e6:.2f}M parameters), {args.processes} "
              f"process(es), bf16 autocast, accumulation 2, clipping, {total} steps"
              + ("" if args.codec == "none" else f", codec {args.codec}"))
        rows = [("reference", f"{ref['SECONDS']:.1f} s, loss {losses[1]:.2f} -> {losses[total]:.2f}"),
                ("killed with SIGKILL after step", str(crashed["killed_at"])),
                ("resumed from step (newest durable)", str(resumed["START"])),
                ("on storage", (f"{bases / 1e6:.2f} MB in {len(inv.bases)} bases + {diffs / 1e6:.2f} MB "
                                f"of diffs in {len(inv.segments)} segments")),
                ("diff bytes per step", (f"{diffs / steps / 1e3:.1f} kB ({100 * diffs / steps / full:.1f}% of "
                                         f"a {full / 1e6:.2f} MB model + optimizer checkpoint)")),
                ("tensors compared with torch.equal", str(tensors))]
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
    ap.add_argument("--codec", default="none", choices=["none", "topk", "powersgd"])
    ap.add_argument("--seed", type=int, default=0, help="chooses the kill step")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        train(args)
    else:
        sys.exit(demo(args))


if __name__ == "__main__":
    main()
