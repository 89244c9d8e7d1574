"""FSDP2 (``fully_shard``) training with diffckpt: train, kill -9, resume, check it is bit-exact.

The loop in :func:`worker` is an ordinary FSDP2 loop (dropout, two accumulated micro-batches,
gradient clipping, a schedule) plus the lines that checkpoint it through
:class:`diffckpt.CheckpointEngine`: every rank writes its own pieces to its own stream, with no
exchange between ranks per step. ``--layout`` picks the mesh: ``fsdp``, 1-D over 2 processes;
``hsdp``, ``fully_shard`` over a 2x2 ``(replicate, shard)`` mesh; ``tp``, the MLP tensor-parallel
(``ColwiseParallel``/``RowwiseParallel``) over the ``tp`` dim of a 2x2 mesh, then ``fully_shard``
over ``dp``. A block several ranks hold (HSDP's replicas, the last layer under ``tp``) is written
once, by the lowest of them. Run this file and it:

1. trains without diffckpt (the reference) on 2 or 4 processes over gloo;
2. trains with a diff every optimizer step and kills the whole job with SIGKILL midway;
3. resumes in a new job with ``engine.resume(model, [opt], "last")`` and trains to the end;
4. compares every rank's pieces of every parameter and optimizer state tensor with
   ``torch.equal``, rebuilds the full tensors in one process with ``diffckpt.load_state``, and
   reports the bytes each rank wrote per step.

    python examples/sharded_train.py [--steps 40] [--kill-at 23] [--layout fsdp|hsdp|tp]

Runs in about half a minute on a CPU (a minute for the 4-process layouts). Exit status 1 if the resumed run is not bit-exact.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

MESHES = {"fsdp": (2,), "hsdp": (2, 2), "tp": (2, 2)}


def make(layout: str) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 96), nn.GELU(), nn.Dropout(0.1), nn.Linear(96, 96), nn.GELU(),
                          nn.Linear(96, 5))
    if layout == "tp":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        world = init_device_mesh("cpu", MESHES[layout], mesh_dim_names=("dp", "tp"))
        parallelize_module(model, world["tp"], {"0": ColwiseParallel(), "3": RowwiseParallel()})
        mesh = world["dp"]
    else:  # a 2-D mesh is HSDP: replicated over its first dim, sharded over its second
        mesh = init_device_mesh("cpu", MESHES[layout])
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))


class LoopState:
    """What this loop adds to a restorable step: the schedule, and each rank's RNG (dropout)."""

    def __init__(self, sched: Any) -> None:
        self.sched = sched

    def rank_state(self) -> dict[str, Any]:
        from diffckpt.rng import get_rng_state

        return {"rng": get_rng_state()}

    def state(self, ranks: list[Any]) -> dict[str, Any]:
        return {"scheduler": self.sched.state_dict(), "ranks": ranks}


def worker(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=math.prod(MESHES[args.layout]))
    model, opt, sched = make(args.layout)
    data_rank = rank // 2 if args.layout == "tp" else rank  # a tensor-parallel pair shares its batches
    torch.manual_seed(1 + rank)
    engine, first = None, 0
    if args.root:
        from diffckpt import CheckpointEngine
        from diffckpt.rng import set_rng_state

        engine = CheckpointEngine(args.root)  # defaults: a diff every step, a base every 1000 steps
        result = engine.resume(model, [opt], "last", missing_ok=True)  # every rank, in parallel
        if result is not None:
            first = result.step
            sched.load_state_dict(result.state["scheduler"])
            set_rng_state(engine.own(result.state["ranks"])["rng"])
        engine.begin(model, [opt], first, LoopState(sched))
    for step in range(first + 1, args.steps + 1):
        for micro in range(2):
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + 10 * data_rank + micro))
            (model(x).square().mean() / 2).backward()
        meshes: dict[Any, list[nn.Parameter]] = {}  # clipped per mesh (one but under tp), as torchtitan does
        for param in model.parameters():
            meshes.setdefault(param.device_mesh, []).append(param)
        for params in meshes.values():
            nn.utils.clip_grad_norm_(params, 1.0)  # a collective: recorded after it
        opt.step()
        sched.step()
        opt.zero_grad()
        if engine is not None:
            engine.commit(step, LoopState(sched))
        if rank == 0:
            print(f"STEP {step}", flush=True)
    if engine is not None:
        engine.end()
    sd = opt.state_dict()["state"]
    pieces = {"model": {k: v.to_local().clone() for k, v in model.state_dict().items()},
              "optimizer": {i: {k: getattr(v, "to_local", lambda v=v: v)().clone() for k, v in s.items()}
                            for i, s in sd.items()}}
    torch.save(pieces, os.path.join(args.out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def launch(out: str, steps: int, layout: str, root: str | None, kill_at: int | None = None) -> None:
    """Run the job in a process tree of its own; SIGKILL all of it once step ``kill_at`` printed."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--out", out, "--steps", str(steps),
           "--layout", layout]
    proc = subprocess.Popen(cmd + (["--root", root] if root else []), stdout=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.stdout is not None
    for line in proc.stdout:
        if kill_at is not None and line.startswith("STEP ") and int(line.split()[1]) >= kill_at:
            os.killpg(proc.pid, signal.SIGKILL)
            print(f"killed the job with SIGKILL after step {kill_at}")  # the launcher and every rank
            break
    proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=23)
    p.add_argument("--layout", choices=sorted(MESHES), default="fsdp")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(worker, args=(port, args), nprocs=math.prod(MESHES[args.layout]), start_method="spawn")
        return 0

    import diffckpt

    tmp = tempfile.mkdtemp(prefix="diffckpt-sharded-")
    try:
        ref, run, root = (os.path.join(tmp, d) for d in ("ref", "run", "ckpt"))
        os.makedirs(ref)
        os.makedirs(run)
        launch(ref, args.steps, args.layout, None)
        launch(run, args.steps, args.layout, root, kill_at=args.kill_at)
        launch(run, args.steps, args.layout, root)  # resumes from the newest step durable on every rank
        exact, world = True, math.prod(MESHES[args.layout])
        for rank in range(world):
            a, b = (torch.load(os.path.join(d, f"rank{rank}.pt"), weights_only=True) for d in (ref, run))
            same = all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and all(
                torch.equal(a["optimizer"][i][k], b["optimizer"][i][k]) for i in a["optimizer"] for k in a["optimizer"][i])
            exact &= same
            print(f"rank {rank}: {len(a['model'])} parameter pieces and their AdamW state "
                  f"{'bitwise equal to' if same else 'DIFFER from'} the run without diffckpt")
        full = diffckpt.load_state(root)  # both ranks' streams, in one process, as full tensors
        shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in list(full["model"].items())[:2])
        print(f"load_state: step {full['step']} as full tensors ({shapes}, ...)")
        for rank in range(world):
            stream = os.path.join(root, "ranks", f"r{rank:05d}", "diffs")
            nbytes = sum(os.path.getsize(os.path.join(stream, f)) for f in os.listdir(stream))
            print(f"rank {rank}: {nbytes / args.steps / 1024:.1f} KiB of diffs per step")
        print("bit-exact" if exact else "NOT bit-exact")
        return 0 if exact else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
