"""A plain PyTorch loop under FSDP2 (``fully_shard``) on gloo, checkpointed through the core engine.

Run as a script; it starts ``--world`` processes itself (so that a test can kill the whole tree).

    fsdp_loop.py OUT --steps N [--root ROOT [--resume] [--dump-restored] [--stall R:REGEX]]
                 [--world W] [--unsharded] [--full-at K] [--auto] [--keep-last-bases N] [--bf16] [--clip C] [--micro M]
                 [--layout fsdp|hsdp|tp --mesh D0 D1] [--wide] [--diverge STEP]

Without ``--root`` nothing of diffckpt is used (the reference run). Every step draws its data from
a generator seeded by (step, rank, micro-batch), so a resumed run sees what the original saw; the
model has dropout (the RNG matters), two micro-batches accumulate, and gradients are clipped
(a collective under FSDP2; per mesh under FSDP x TP). ``--layout hsdp`` shards over a 2-D
``(replicate, shard)`` mesh, ``--layout tp`` makes the MLP tensor-parallel over the mesh's
second dim and shards over its first; ranks of one tensor-parallel group share batches. Rank 0 prints ``STEP n`` after each step is committed. At the end
each rank saves its pieces (parameters, optimizer state, scheduler, RNG) to ``OUT/rank<r>.pt``;
``--full-at K ...`` also saves the full tensors at step K to ``OUT/full<K>.pt`` (a collective), and
``--dump-restored`` the full tensors right after the resume to ``OUT/restored.pt``.

``--stall R:REGEX`` holds rank R's writes of objects whose path matches REGEX forever (it prints
``STALLED <path>`` first): one rank's stream falls behind the others', the way a slow or stuck
writer leaves it, so that a test can kill the job at that instant. It is a storage wrapper (a
delay cannot be produced on purpose otherwise); everything else is real.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from engine_runs import LoopState
from helpers import finish_process

from diffckpt import CheckpointEngine, CheckpointOptions
from diffckpt.rng import set_rng_state

# retention=None: the tests restore older steps of a run, which the default retention would trim.
# every_step: the runs restore every step, which a paced run root that falls behind would not keep
OPTIONS = {"write_batch": 2, "base_every_n_steps": 4, "fingerprint_every_n_steps": 3, "retention": None,
           "durability": "every_step"}


class Stalling:
    """A storage whose writes of matching paths never finish (see ``--stall``)."""

    def __init__(self, inner: Any, pattern: str) -> None:
        self.inner, self.pattern, self.url = inner, re.compile(pattern), inner.url
        self.local = getattr(inner, "local", False)

    def write(self, path: str, data: Any) -> None:
        if self.pattern.search(path):
            print(f"STALLED {path}", flush=True)
            while True:
                time.sleep(60)
        self.inner.write(path, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def make(sharded: bool, bf16: bool = False, layout: str = "fsdp", mesh_shape: tuple[int, ...] = (),
         wide: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    if layout == "fsdp" and not wide:
        # dim 0 sizes 5, 3 and 1: every split over 2 ranks is uneven and rank 1 holds empty pieces
        m = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(5, 3),
                                torch.nn.ReLU(), torch.nn.Linear(3, 1))
    else:  # 2-D: sizes a tensor-parallel plan splits evenly over 1, 2 or 4 ranks; the last layer's 1 row unevenly
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(8, 4),
                                torch.nn.ReLU(), torch.nn.Linear(4, 1))
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        kw: dict[str, Any] = {}
        if bf16:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        if layout in ("tp", "hsdp-tp"):  # FSDP x TP as torchtitan and Lightning do: the MLP over "tp", then FSDP
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )

            # 3-D (HSDP x TP): FSDP over the (replicate, shard) sub-mesh, as torchtitan's dp_replicate x dp_shard
            dims = ("dp", "tp") if layout == "tp" else ("replicate", "shard", "tp")
            world = init_device_mesh("cpu", mesh_shape, mesh_dim_names=dims)
            parallelize_module(m, world["tp"], {"0": ColwiseParallel(), "3": RowwiseParallel()})
            mesh = world[dims[:-1]] if len(dims) == 3 else world["dp"]
        elif layout == "hsdp":  # fully_shard over a (replicate, shard) mesh
            mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh, **kw)
        fully_shard(m, mesh=mesh, **kw)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    return m, opt, torch.optim.lr_scheduler.StepLR(opt, 3, 0.7)


def data_rank(rank: int, args: argparse.Namespace) -> int:
    """Whose batches a rank trains on: tensor-parallel ranks of one data-parallel rank share them."""
    return rank // args.mesh[-1] if args.layout in ("tp", "hsdp-tp") else rank


def clip(m: torch.nn.Module, max_norm: float) -> None:
    """Clip per mesh, as torchtitan does under FSDP x TP (clip_grad_norm_ cannot stack norms
    computed over two meshes); one group under FSDP2 and HSDP."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in m.parameters():
        groups.setdefault(getattr(p, "device_mesh", None), []).append(p)
    for params in groups.values():
        torch.nn.utils.clip_grad_norm_(params, max_norm)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def pieces(m: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any) -> dict[str, Any]:
    sd = opt.state_dict()
    return {"model": {k: local(v).clone() for k, v in m.state_dict().items()},
            "optimizer": {i: {k: local(v).clone() for k, v in s.items()} for i, s in sd["state"].items()},
            "groups": sd["param_groups"], "scheduler": sched.state_dict(), "rng": torch.get_rng_state()}


def full(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    def f(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor().clone() if hasattr(t, "full_tensor") else t.clone()
    return {"model": {k: f(v) for k, v in m.state_dict().items()},
            "optimizer": {i: {k: f(v) for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}}


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    m, opt, sched = make(not args.unsharded, args.bf16, args.layout, tuple(args.mesh), args.wide)
    torch.manual_seed(1000 + rank)
    first, engine, based = 0, None, []
    if args.root:
        # --defaults: the shipped defaults (bases sized by bytes, retention on) but for write_batch
        options = {"write_batch": OPTIONS["write_batch"]} if args.defaults else dict(OPTIONS)
        if args.auto:
            options.update(every_n_steps="auto", write_batch="auto")
        if args.keep_last_bases:
            from diffckpt import RetentionPolicy

            options.update(retention=RetentionPolicy(keep_last_bases=args.keep_last_bases, min_age_s=0.0))
        target: Any = args.root
        if args.stall and int(args.stall.split(":", 1)[0]) == rank:
            from diffckpt import FsspecStorage

            target = Stalling(FsspecStorage(args.root), args.stall.split(":", 1)[1])
        engine = CheckpointEngine(target, CheckpointOptions(**options))
        if args.resume:
            result = engine.resume(m, [opt], "last")
            assert result is not None
            first = result.step
            sched.load_state_dict(result.state["scheduler"])
            mine = engine.own(result.state["ranks"])
            if mine is not None:
                set_rng_state(mine["rng"])
            if args.dump_restored:
                state = full(m, opt)
                if rank == 0:
                    torch.save(dict(state, step=first), os.path.join(args.out, "restored.pt"))
        engine.begin(m, [opt], first, LoopState(sched))
    for step in range(first + 1, args.steps + 1):
        for micro in range(args.micro):
            seed = 1000 * step + 10 * data_rank(rank, args) + micro
            x = torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))
            (m(x).pow(2).mean() / args.micro).backward()
        clip(m, args.clip)
        opt.step()
        if step == args.diverge and rank == args.world - 1:  # a replica changed on one rank alone
            with torch.no_grad():
                local(next(m.parameters())).add_(1.0)
        sched.step()
        opt.zero_grad()
        if engine is not None and engine.commit(step, LoopState(sched)).base:
            based.append(step)
        if rank == 0:
            print(f"STEP {step}", flush=True)
        if step in args.full_at:
            state = full(m, opt)
            if rank == 0:
                torch.save(state, os.path.join(args.out, f"full{step}.pt"))
    if engine is not None:
        if args.defaults:  # the byte-sized base interval each rank followed, and its bases
            print(f"INTERVAL rank {rank}: {engine.settings.base_every_n_steps} {based}", flush=True)
        engine.end()
    torch.save(pieces(m, opt, sched), os.path.join(args.out, f"rank{rank}.pt"))
    dist.barrier()
    finish_process()  # no interpreter finalization, which aborts a gloo process now and then


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--root")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--unsharded", action="store_true", help="a plain module, no fully_shard (with --world 1)")
    p.add_argument("--layout", choices=("fsdp", "hsdp", "tp", "hsdp-tp"), default="fsdp",
                   help="fsdp: a 1-D mesh; hsdp: fully_shard over --mesh (replicate, shard); tp: the MLP "
                        "tensor-parallel over --mesh's second dim, then fully_shard over its first")
    p.add_argument("--wide", action="store_true", help="the 2-D layouts' model, on a 1-D mesh or unsharded")
    p.add_argument("--mesh", type=int, nargs="+", default=(1, 1), help="the mesh's shape (3 dims for hsdp-tp)")
    p.add_argument("--diverge", type=int, default=-1, help="the last rank changes its first piece at this step")
    p.add_argument("--full-at", type=int, nargs="*", default=[])
    p.add_argument("--dump-restored", action="store_true")
    p.add_argument("--bf16", action="store_true", help="MixedPrecisionPolicy: bfloat16 parameters and reduction")
    p.add_argument("--micro", type=int, default=2, help="micro-batches accumulated per step")
    p.add_argument("--clip", type=float, default=0.05, help="gradient norm clipping (inf: never engages)")
    p.add_argument("--stall", metavar="RANK:REGEX")
    p.add_argument("--auto", action="store_true", help="every_n_steps and write_batch tuned automatically")
    p.add_argument("--keep-last-bases", type=int, help="retention beside training")
    p.add_argument("--defaults", action="store_true", help="CheckpointOptions defaults (but write_batch)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(args.world, port, args), nprocs=args.world, start_method="spawn")
    sys.exit(0)


if __name__ == "__main__":
    main()
