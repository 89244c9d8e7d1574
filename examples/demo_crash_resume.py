"""Kill a training run with SIGKILL, resume it, and check it ends bit-exactly where an
uninterrupted run ends (``make demo``).

1. A reference run trains the small GPT of ``gpt.py`` without any checkpointing.
2. The same run with ``DiffCheckpoint`` capturing every step is killed (``kill -9``) at a random
   step between 40% and 70% of the way.
3. A new process resumes it with ``Trainer.fit(ckpt_path="last")`` and trains to the end.
4. Every tensor of the final model, optimizer and scheduler state is compared with ``torch.equal``.

With ``--codec topk`` (or ``powersgd``, ``bf16``) both runs train with compressed gradients and
the diffs are the compressed payloads (``docs/compression.md``); the reference then trains with
the same codec, without checkpoints.

The training runs are subprocesses of this script (``--child``). Exit status 1 if not bit-exact.
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
from typing import Any

from diffckpt.planning import plan

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# ------------------------------------------------------------------------------------------ child
def child(args: argparse.Namespace) -> None:
    import lightning as L
    import torch

    sys.path.insert(0, HERE)
    from gpt import GPT, make_loader

    class Progress(L.Callback):
        def on_train_start(self, trainer, pl_module):
            print(f"START {trainer.global_step}", flush=True)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            print(f"STEP {trainer.global_step} {float(outputs['loss']):.4f}", flush=True)

    torch.set_num_threads(args.threads)
    L.seed_everything(args.seed, verbose=False)
    torch.use_deterministic_algorithms(True)
    model = GPT(args.size, total_steps=args.steps)
    loader = make_loader(args.size, seed=args.seed)
    callbacks: list[Any] = [Progress()]
    plugins: list[Any] = []
    codec = make_codec(args.codec)
    if args.child == "train":
        from lightning_ckpt import DiffCheckpoint, DiffCheckpointIO

        if args.auto:  # the tuner measures this run and picks all three
            from diffckpt import TuningOptions

            knobs: dict[str, Any] = dict.fromkeys(("every_n_steps", "write_batch", "base_every_n_steps"), "auto")
            knobs["tuning"] = TuningOptions(mtbf_s=args.mtbf)
        else:
            knobs = {"every_n_steps": 1, "write_batch": args.write_batch, "base_every_n_steps": args.base_every}
        callbacks.append(DiffCheckpoint(args.run_dir, codec=codec, **knobs))
        plugins.append(DiffCheckpointIO())
    elif codec is not None:  # the same compressed training, without checkpoints
        from lightning_ckpt.compression import GradientCompression

        callbacks.append(GradientCompression(codec))
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        enable_checkpointing=args.child == "train",
        callbacks=callbacks,
        plugins=plugins,
    )
    start = time.perf_counter()
    trainer.fit(model, train_dataloaders=loader, ckpt_path="last" if args.resume else None)
    print(f"FIT_SECONDS {time.perf_counter() - start:.3f}", flush=True)
    module = trainer.lightning_module
    torch.save(
        {
            "model": module.state_dict(),
            "optimizers": [o.state_dict() for o in trainer.optimizers],
            "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "global_step": trainer.global_step,
        },
        args.out,
    )
    if args.child == "ref":  # what one plain Lightning checkpoint of this run weighs
        path = os.path.join(os.path.dirname(args.out), "full.ckpt")
        trainer.save_checkpoint(path)
        print(f"FULL_CKPT_BYTES {os.path.getsize(path)}", flush=True)
        os.remove(path)


def make_codec(name: str) -> Any:
    """The demo's codecs: those whose resume is exact end to end from any step (no error
    feedback; see docs/compression.md for the others)."""
    from diffckpt.codecs import LowPrecision, PowerSGD, TopK

    return {
        "none": lambda: None,
        "topk": lambda: TopK(0.01),
        "powersgd": lambda: PowerSGD(4, error_feedback=False),
        "bf16": lambda: LowPrecision("bf16"),
    }[name]()


# ----------------------------------------------------------------------------------------- parent
def spawn(
    args: argparse.Namespace, mode: str, out: str, log: Any, resume: bool = False
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        mode,
        "--out",
        out,
        "--run-dir",
        args.run_dir,
        "--size",
        args.size,
        "--steps",
        str(args.steps),
        "--seed",
        str(args.seed),
        "--write-batch",
        str(args.write_batch),
        "--base-every",
        str(args.base_every),
        "--threads",
        str(args.threads),
        "--codec",
        args.codec,
        "--mtbf",
        str(args.mtbf),
        *(["--auto"] if args.auto else []),
    ]
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
    )
    env["OMP_NUM_THREADS"] = str(args.threads)
    return subprocess.Popen(
        cmd + (["--resume"] if resume else []),
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
        start_new_session=True,
    )


def watch(proc: subprocess.Popen, kill_at: int | None = None) -> dict[str, Any]:
    """Read the child's progress lines; SIGKILL its process group after ``STEP kill_at``."""
    seen: dict[str, Any] = {"losses": {}}
    assert proc.stdout is not None
    for line in proc.stdout:
        key, _, rest = line.strip().partition(" ")
        if key == "STEP":
            step, loss = rest.split()
            seen["losses"][int(step)] = float(loss)
            if kill_at is not None and int(step) == kill_at:
                os.killpg(proc.pid, signal.SIGKILL)
                seen["killed_at"] = kill_at
                break
        elif key in ("START", "FULL_CKPT_BYTES"):
            seen[key] = int(rest)
        elif key == "FIT_SECONDS":
            seen[key] = float(rest)
    proc.stdout.close()
    seen["rc"] = proc.wait()
    return seen


def compare(a: Any, b: Any, path: str, counts: dict[str, int], diffs: list[str]) -> None:
    """Compare two states bitwise; tensors with ``torch.equal`` (dtype and shape too)."""
    import torch

    if isinstance(a, torch.Tensor):
        top = path[2:].split("'")[0]  # "['model'][...]" -> "model"
        counts[top] = counts.get(top, 0) + 1
        if not (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        ):
            diffs.append(path)
    elif isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        for k in a:
            compare(a[k], b[k], f"{path}[{k!r}]", counts, diffs)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            compare(x, y, f"{path}[{i}]", counts, diffs)
    elif a != b:
        diffs.append(f"{path}: {a!r} != {b!r}")


def mb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def fail(msg: str, log_path: str) -> None:
    with open(log_path) as f:
        tail = f.read()[-3000:]
    sys.exit(f"demo failed: {msg}\n--- child stderr (tail) ---\n{tail}")


def parent(args: argparse.Namespace) -> int:
    import torch

    from diffckpt.localtier import read_local_tier
    from diffckpt.runstore import RunStore
    from diffckpt.storage import open_storage

    begin = time.perf_counter()
    work = tempfile.mkdtemp(prefix="diffckpt-demo-")
    keep_run = args.run_dir is not None
    if args.run_dir is None:
        args.run_dir = os.path.join(work, "run")
    elif os.path.exists(args.run_dir):
        if os.listdir(args.run_dir) and not os.path.exists(os.path.join(args.run_dir, "run.json")):
            sys.exit(
                f"--run-dir {args.run_dir} exists and is not a diffckpt run; "
                "choose a fresh directory"
            )
        shutil.rmtree(args.run_dir)  # a fresh run every time
    log_path = os.path.join(work, "children.log")
    kill_at = random.Random(args.seed).randint(-(-args.steps * 4 // 10), args.steps * 7 // 10)
    ref_out, res_out = os.path.join(work, "reference.pt"), os.path.join(work, "resumed.pt")
    try:
        with open(log_path, "w") as log:
            print(f"[1/3] reference run, {args.steps} steps, no checkpointing ...", flush=True)
            ref = watch(spawn(args, "ref", ref_out, log))
            if ref["rc"] != 0:
                fail(f"reference run exited with {ref['rc']}", log_path)
            print(
                f"[2/3] run with DiffCheckpoint{' (settings on auto)' if args.auto else ' every step'}; "
                f"SIGKILL at step {kill_at} ...",
                flush=True,
            )
            crashed = watch(
                spawn(args, "train", os.path.join(work, "unused.pt"), log), kill_at=kill_at
            )
            if crashed.get("killed_at") != kill_at:
                fail(
                    f"the checkpointed run ended (rc {crashed['rc']}) before step {kill_at}",
                    log_path,
                )
            store = RunStore(open_storage(args.run_dir))
            durable = plan(store).target
            # what this node's journal adds (the node-local tier): the resume takes it back
            local = read_local_tier(store, "auto").step
            print(
                f"[3/3] resume with ckpt_path='last' (newest durable step: {durable} in the run root"
                + (f", {local} in the local tier" if local is not None else "") + ") ...",
                flush=True,
            )
            resumed = watch(spawn(args, "train", res_out, log, resume=True))
            if resumed["rc"] != 0:
                fail(f"resumed run exited with {resumed['rc']}", log_path)

        ref_state = torch.load(ref_out, weights_only=True)
        res_state = torch.load(res_out, weights_only=True)
        counts: dict[str, int] = {}
        diffs: list[str] = []
        compare(ref_state, res_state, "", counts, diffs)
        exact = not diffs

        inv = store.inventory()
        base_bytes = sum(n for p, n in inv.sizes.items() if p.startswith("bases/"))
        diff_bytes = sum(n for p, n in inv.sizes.items() if p.startswith("diffs/"))
        diff_steps = max(sum(s.last - s.after for s in inv.segments), 1)
        one_full = ref["FULL_CKPT_BYTES"]
        full = one_full * args.steps
        stored = base_bytes + diff_bytes
        n_params = sum(t.numel() for t in ref_state["model"].values())
        losses = ref["losses"]
        start = resumed["START"]
        rows = [
            (
                "reference run (no checkpointing)",
                f"{ref['FIT_SECONDS']:.1f} s, loss {losses[1]:.2f} -> {losses[args.steps]:.2f}",
            ),
            ("killed with SIGKILL after step", f"{kill_at}"),
            ("in the run root at the kill", f"{durable}  (what a loss of the node would leave)"),
            (
                "resumed from step (newest durable)",
                f"{start}" + ("" if start == max(durable, local or durable) else
                              f"  (but the run root and local tier said {max(durable, local or durable)}!)")
                + ("  (the node-local tier's journal)" if start > durable else ""),
            ),
            ("steps lost", f"{kill_at - start}  " + (
                "(settings auto-tuned)" if args.auto else f"(write_batch={args.write_batch})")),
            ("resumed run (replay + rest)", f"{resumed['FIT_SECONDS']:.1f} s"),
            (
                "on storage: bases + diffs",
                (
                    f"{mb(base_bytes)} ({len(inv.bases)} bases) + "
                    f"{mb(diff_bytes)} ({len(inv.segments)} segments) = {mb(stored)}"
                ),
            ),
            (
                "a full checkpoint every step",
                (
                    f"{mb(one_full)} x {args.steps} = {mb(full)}  "
                    f"(diffckpt: {100 * stored / full:.0f}%)"
                ),
            ),
            (
                "diff bytes per step",
                (
                    f"{mb(diff_bytes / diff_steps)}  "
                    f"({100 * diff_bytes / diff_steps / one_full:.1f}% of a full checkpoint)"
                ),
            ),
            *(
                (f"auto-tuned (g{gen}, MTBF {args.mtbf:.0f} s)", "; ".join(
                    f"step {d['step']}: every_n_steps={d['settings']['every_n_steps']} write_batch="
                    f"{d['settings']['write_batch']} base_every_n_steps={d['settings']['base_every_n_steps']} "
                    f"(expected loss {100 * d['expected_loss']:.2f}% of training time)"
                    for d in store.tuning_log(gen)))
                for gen in sorted(inv.sessions) if store.tuning_log(gen)
            ),
            (
                "tensors compared with torch.equal",
                f"{sum(counts.values())} ("
                + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
                + ")",
            ),
        ]
        print(
            f"\ndiffckpt crash/resume demo: GPT '{args.size}' ({n_params / 1e6:.2f}M parameters), "
            f"AdamW + OneCycleLR, {args.steps} steps, a diff every step"
            + ("" if args.codec == "none" else f", compressed training with {make_codec(args.codec).name}")
        )
        for label, value in rows:
            print(f"  {label:<36}  {value}")
        print(f"  bit-exact: {'yes' if exact else 'no'}")
        for d in diffs[:10]:
            print(f"    differs: {d}")
        kept = f"; run kept in {args.run_dir}" if keep_run else ""
        print(f"  ({time.perf_counter() - begin:.0f} s in all{kept})")
        return 0 if exact else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps of the whole run")
    ap.add_argument("--size", default="demo", help="model size preset of gpt.py")
    ap.add_argument("--seed", type=int, default=0, help="training seed and kill-step choice")
    ap.add_argument("--write-batch", type=int, default=8)
    ap.add_argument("--base-every", type=int, default=50)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads per training process (default 1)"
    )
    ap.add_argument(
        "--codec",
        default="none",
        choices=["none", "topk", "powersgd", "bf16"],
        help="compressed training: TopK(0.01), PowerSGD(4, error_feedback=False) or "
        "LowPrecision('bf16'); the diffs are the payloads (default: none, exact dense diffs)",
    )
    ap.add_argument("--auto", action="store_true",
                    help='every_n_steps, write_batch and base_every_n_steps="auto" (the tuner picks them)')
    ap.add_argument("--mtbf", type=float, default=1800.0, help="with --auto: the MTBF in seconds (default 1800)")
    ap.add_argument("--run-dir", help="keep the run here (default: a temp dir, removed at the end)")
    ap.add_argument("--child", choices=["ref", "train"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
    else:
        sys.exit(parent(args))


if __name__ == "__main__":
    main()
