"""Sharded training (FSDP2, HSDP, FSDP x TP): diffckpt every step against ``torch.distributed.checkpoint``.

Processes over gloo on CPU, started by this script (``torch.multiprocessing``, spawn). Each run
builds the GPT of ``examples/gpt.py`` afresh, ``fully_shard``-ed per block and at the root, AdamW +
OneCycleLR, clipping by norm (a collective; per mesh under FSDP x TP, as torchtitan does). The
layout (``--layout``): ``fsdp``, a 1-D mesh of 2 ranks; ``hsdp``, a ``(replicate, shard)`` mesh
of 2x2; ``tp``, each block's MLP ``ColwiseParallel``/``RowwiseParallel`` over the ``tp`` dim of a
2x2 ``(dp, tp)`` mesh, then ``fully_shard`` over ``dp``. Every data-parallel rank draws its own
batch from a generator seeded by (step, data-parallel rank), so every run of every config trains
the same steps. Configs, interleaved in rounds (the order
reverses every other round), every run in a fresh temp dir:

1. ``none``: no checkpointing, the baseline;
2. ``diffckpt``: ``CheckpointEngine`` with default options (every step restorable,
   ``write_batch`` 8, bases sized by bytes) but retention off (every step restorable and every
   byte written counted), ``begin`` at step
   0, ``commit`` after every step, ``end`` at the end; every rank writes its own stream of
   gradient pieces under ``ranks/r<rank>/``;
3. ``dcp-async-1``: ``torch.distributed.checkpoint.async_save`` every step;
4. ``dcp-async-10``: the same every 10 steps (``--dcp-every``);
5. ``dcp-sync-10``: ``torch.distributed.checkpoint.save`` every 10 steps.

DCP saves the Stateful ``AppState`` of the torch DCP tutorial (``get_state_dict`` /
``set_state_dict``: sharded model and optimizer state) plus the scheduler's state. Each
``async_save`` first waits for the previous one's future, as its docs ask. DCP runs its planning
collectives on a gloo group of its own: ``async_save`` runs them on its writer thread while the
training thread runs FSDP's, and two threads issuing collectives on one group may interleave them
differently on the two ranks.

Timed: from a barrier before the first step after ``--warmup`` until the last checkpoint is
written (``engine.end()``'s flush, the last future), the slowest rank's time. Bytes are counted
per rank on local disk after the run: diffckpt's segments (``ranks/r<rank>/diffs/``) and base
(``ranks/r<rank>/bases/``), DCP's ``__<rank>_*.distcp`` files (``.metadata`` counted for rank 0).

Restore, after the rounds, from the last round's diffckpt and ``dcp-async-10`` runs (warm page
cache), at step ``--dcp-every`` and at the last step, into a fresh sharded model and optimizer on
the same 2 ranks: ``CheckpointEngine.resume`` (base at step 0 + replay of every step since, each
rank its own stream) against ``dcp.load`` of the DCP checkpoint of that step; median of
``--repeats`` interleaved repeats, the slowest rank's time; every restore is compared bitwise
with the state the run trained. Under ``hsdp`` and ``tp`` both are also restored onto another
layout, a 1-D ``fully_shard`` over all the ranks (diffckpt: full tensors rebuilt from the streams
and cut; DCP: its resharding load), compared bitwise with the trained state's full tensors.

    python bench/sharded.py [--layout fsdp|hsdp|tp] [--steps 30] [--rounds 4] [--size bench] [--repeats 3] [--quick]

Writes ``bench/results/sharded.md`` (``sharded-hsdp.md``, ``sharded-tp.md``; ``-quick`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

from gpt import GPT, SIZES, make_dataset, plain_step
from provenance import header, report_path, write_report

from diffckpt import CheckpointEngine, CheckpointOptions
from diffckpt.rng import get_rng_state
from diffckpt.sharding import local, rank_prefix

CONFIGS = ["none", "diffckpt", "dcp-async-1", "dcp-async-10", "dcp-sync-10"]
LAYOUTS = {"fsdp": (2,), "hsdp": (2, 2), "tp": (2, 2)}  # the mesh of each layout


# --------------------------------------------------------------------------- the loop
def meshes(layout: str) -> dict[str, Any]:
    """The meshes of ``layout``: ``shard`` (what ``fully_shard`` gets), ``tp`` under FSDP x TP."""
    shape = LAYOUTS[layout]
    if layout == "hsdp":
        return {"shard": init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))}
    if layout == "tp":
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        return {"shard": mesh["dp"], "tp": mesh["tp"]}
    return {"shard": init_device_mesh("cpu", (dist.get_world_size(),))}


def build(args: argparse.Namespace, mesh: dict[str, Any]) -> tuple[GPT, torch.optim.Optimizer, Any]:
    """A fresh, identically initialised GPT laid out on ``mesh`` (:func:`meshes`): each block's
    MLP tensor-parallel first under FSDP x TP, then sharded per block and at the root; its AdamW
    and OneCycleLR (``GPT.configure_optimizers``, built on the sharded parameters)."""
    torch.manual_seed(0)
    model = GPT(args.size, total_steps=args.steps)
    for block in model.blocks:
        if "tp" in mesh:
            parallelize_module(block.mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    conf = model.configure_optimizers()
    return model, conf["optimizer"], conf["lr_scheduler"]["scheduler"]


def batch_for(data: torch.Tensor, step: int, rank: int, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return data[torch.randint(0, len(data), (size,), generator=g)]


class LoopState:
    """What diffckpt adds to a restorable step: the scheduler, and each rank's RNG."""

    def __init__(self, sched: Any) -> None:
        self.sched = sched

    def rank_state(self) -> dict[str, Any]:
        return {"rng": get_rng_state()}

    def state(self, ranks: list[Any]) -> dict[str, Any]:
        return {"scheduler": self.sched.state_dict(), "ranks": ranks}


class AppState(Stateful):
    """The torch DCP tutorial's wrapper (sharded model and optimizer state), plus the scheduler."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any) -> None:
        self.model, self.opt, self.sched = model, opt, sched

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd, "sched": self.sched.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.opt, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])
        self.sched.load_state_dict(state_dict["sched"])


def data_rank(args: argparse.Namespace) -> int:
    """Whose batches this rank trains on: the ranks of one tensor-parallel group share them."""
    return dist.get_rank() // LAYOUTS["tp"][1] if args.layout == "tp" else dist.get_rank()


def full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The full tensors of every parameter and optimizer state tensor (a collective), keyed by name."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    out = {f"p.{k}": v.full_tensor() for k, v in model.named_parameters()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"o.{order[int(i)]}.{k}": v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
                    for k, v in s.items()})
    return out


def pieces(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's pieces of every parameter and optimizer state tensor, cloned."""
    out = {f"p.{k}": local(v).detach().clone() for k, v in model.named_parameters()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"o.{i}.{k}": local(v).detach().clone() for k, v in s.items()})
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def cpu_seconds() -> float:
    """CPU time of this process so far, every thread (training, writers, gloo), user + system."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def summed(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def tree_bytes(path: str, keep: Any = None) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        total += sum(os.path.getsize(os.path.join(dirpath, n)) for n in names if keep is None or keep(n))
    return total


def usage(config: str, path: str, world: int) -> dict[str, Any]:
    """Bytes on disk per rank: diffckpt's segments and base, or DCP's files (rank 0 also holds
    the ``.metadata``), and the number of checkpoints written."""
    if config == "diffckpt":
        streams = [os.path.join(path, rank_prefix(r)) for r in range(world)]
        return {"seg": [tree_bytes(os.path.join(s, "diffs")) for s in streams],
                "base": [tree_bytes(os.path.join(s, "bases")) for s in streams],
                "total": [tree_bytes(s) for s in streams], "other": tree_bytes(path) - sum(map(tree_bytes, streams))}
    if config.startswith("dcp"):
        saves = sorted(os.listdir(path)) if os.path.isdir(path) else []
        total = [tree_bytes(path, lambda n, r=r: n.startswith(f"__{r}_")) for r in range(world)]
        meta = tree_bytes(path, lambda n: n == ".metadata")
        total[0] += meta
        return {"total": total, "meta": meta, "saves": len(saves)}
    return {"total": [0] * world}


def run_once(config: str, args: argparse.Namespace, mesh: Any, pg: Any, data: torch.Tensor, path: str,
             steps: int, truth_at: tuple[int, ...] = ()) -> dict[str, Any]:
    rank = dist.get_rank()
    model, opt, sched = build(args, mesh)
    # dropout differs per data-parallel rank, the same in every run; a tensor-parallel group draws alike,
    # or the layers outside its plan, which every rank of the group holds, would diverge
    torch.manual_seed(1000 + data_rank(args))
    engine, writer, future, t0, cpu0, blocked = None, None, None, 0.0, 0.0, 0.0
    every = 1 if config == "dcp-async-1" else args.dcp_every
    truth: dict[int, dict[str, torch.Tensor]] = {}
    whole: dict[int, dict[str, torch.Tensor]] = {}  # full tensors, for restores onto another layout
    if config == "diffckpt":
        # retention off: every step stays restorable and every byte written is on disk to count
        engine = CheckpointEngine(path, CheckpointOptions(retention=None))
        engine.begin(model, [opt], 0, LoopState(sched))
        writer = engine.recorder.writer  # its stats stay readable after end()
    for step in range(1, steps + 1):
        if step == args.warmup + 1:
            dist.barrier()
            t0, cpu0 = time.perf_counter(), cpu_seconds()
        plain_step(model, opt, sched, batch_for(data, step, data_rank(args), args.batch), per_mesh=args.layout == "tp")
        t_ckpt = time.perf_counter()
        if engine is not None:
            engine.commit(step, LoopState(sched))
        elif config.startswith("dcp") and step % every == 0:
            state = {"app": AppState(model, opt, sched)}
            target = os.path.join(path, f"step{step:06d}")
            if config.startswith("dcp-async"):
                if future is not None:
                    future.result()
                future = dcp.async_save(state, checkpoint_id=target, process_group=pg)
            else:
                dcp.save(state, checkpoint_id=target, process_group=pg)
        if step > args.warmup:
            blocked += time.perf_counter() - t_ckpt
        if step in truth_at:
            truth[step] = pieces(model, opt)
            if args.layout != "fsdp":
                whole[step] = full(model, opt)
    t_end = time.perf_counter()
    if engine is not None:
        engine.end()
    if future is not None:
        future.result()
    now, cpu = time.perf_counter(), cpu_seconds() - cpu0
    seconds, blocked, cpu = slowest(now - t0), slowest(blocked + now - t_end), summed(cpu)
    dist.barrier()
    out: dict[str, Any] = {"seconds": seconds, "blocked": blocked, "cpu": cpu}
    if writer is not None:
        s = writer.stats
        stats = torch.tensor([s.stall_seconds, s.write_seconds, s.segment_bytes, s.raw_record_bytes], dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        out["writer"] = dict(zip(("stall", "write", "seg_bytes", "raw"), stats.tolist()))
        out["segments"] = s.segments
    if rank == 0:
        out.update(usage(config, path, args.world), load=os.getloadavg()[0])
    del model, opt, sched, engine, writer, future
    gc.collect()
    return {"result": out, "truth": truth, "full": whole}


# ------------------------------------------------------------------------- restore
def restore_once(method: str, step: int, root: str, args: argparse.Namespace, mesh: Any, pg: Any,
                 truth: dict[str, torch.Tensor], whole: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """``method``: ``diffckpt`` or ``dcp`` onto the run's layout, ``-1d`` onto a 1-D
    ``fully_shard`` over every rank (compared with the full tensors ``whole``)."""
    other = method.endswith("-1d")
    model, opt, sched = build(args, meshes("fsdp") if other else mesh)  # before the clock, as a resume does
    gc.collect()
    dist.barrier()
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    extra: dict[str, Any] = {}
    if method.startswith("diffckpt"):
        result = CheckpointEngine(root).resume(model, [opt], step)
        assert result is not None and result.step == step, result
        sched.load_state_dict(result.state["scheduler"])
        extra = {"replayed": result.replayed, "base_step": result.base_step, "replay_s": result.replay_s,
                 "read_bytes": result.read_bytes, "read_wait_s": result.read_wait_s}
    else:
        dcp.load({"app": AppState(model, opt, sched)}, checkpoint_id=os.path.join(root, f"step{step:06d}"),
                 process_group=pg)
    seconds, cpu = slowest(time.perf_counter() - t0), summed(cpu_seconds() - cpu0)
    ok = torch.tensor([1 if (same(full(model, opt), whole or {}) if other else same(pieces(model, opt), truth)) else 0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    del model, opt, sched
    gc.collect()
    return {"seconds": seconds, "cpu": cpu, "bitwise": bool(ok.item()), **extra}


# -------------------------------------------------------------------------- workers
def say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def worker(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    for name in ("diffckpt", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    pg = dist.new_group(backend="gloo")  # DCP's own group (see the module docstring)
    mesh = meshes(args.layout)
    data = make_dataset(args.size)
    configs = args.configs.split(",")
    last = args.rounds - 1
    keep = {"diffckpt": "diffckpt", "dcp-async-10": "dcp"}
    kept: dict[str, str] = {}
    truths: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    wholes: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    restore_steps = (args.dcp_every, args.steps)

    warm = os.path.join(args.workdir, "warm")
    for config in ("diffckpt", "dcp-async-1", "dcp-sync-10"):  # imports, allocator, sockets, threads
        run_once(config, args, mesh, pg, data, warm, args.dcp_every if config == "dcp-sync-10" else 3)
        if rank == 0:
            shutil.rmtree(warm, ignore_errors=True)
        dist.barrier()
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for rnd in range(args.rounds):
        for config in configs if rnd % 2 == 0 else list(reversed(configs)):
            path = os.path.join(args.workdir, f"{config}-r{rnd}")
            kept_here = rnd == last and config in keep
            r = run_once(config, args, mesh, pg, data, path, args.steps, restore_steps if kept_here else ())
            results[config].append(r["result"])
            if kept_here:
                kept[keep[config]], truths[keep[config]], wholes[keep[config]] = path, r["truth"], r["full"]
            elif rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
            mb = sum(r["result"].get("total", [0])) / 1e6
            say(rank, f"round {rnd + 1}/{args.rounds} {config:13s} {r['result']['seconds']:7.2f} s {mb:9.1f} MB")

    restores: dict[str, dict[int, list[dict[str, Any]]]] = {}
    if set(kept) == {"diffckpt", "dcp"}:  # restore needs both runs (--configs may leave one out)
        methods = ["diffckpt", "dcp"] + (["diffckpt-1d", "dcp-1d"] if args.layout != "fsdp" else [])
        restores = {m: {s: [] for s in restore_steps} for m in methods}
        same_runs = all(same(truths["diffckpt"][s], truths["dcp"][s]) for s in restore_steps)
        if rank == 0 and not same_runs:
            print("note: the diffckpt and DCP runs did not train bitwise alike", flush=True)
        for rep in range(args.repeats):
            for step in restore_steps:
                for method in methods if rep % 2 == 0 else list(reversed(methods)):
                    run = method.removesuffix("-1d")
                    r = restore_once(method, step, kept[run], args, mesh, pg, truths[run][step],
                                     wholes[run].get(step))
                    restores[method][step].append(r)
                    say(rank, f"restore {rep + 1}/{args.repeats} step {step:4d} {method:9s} {r['seconds']:7.3f} s "
                              f"bitwise {r['bitwise']}")
    if rank == 0:
        with open(args.result_file, "w") as f:
            json.dump({"runs": results, "restores": restores}, f)
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- report
def render(data: dict[str, Any], args: argparse.Namespace) -> list[str]:
    runs: dict[str, list[dict[str, Any]]] = data["runs"]

    def med(config: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[config])

    def per_rank(config: str, key: str, r: int) -> float:
        return statistics.median(x[key][r] for x in runs[config])

    timed = args.steps - args.warmup
    base = med("none", "seconds")
    ranks = " / ".join(f"r{r}" for r in range(args.world))
    full = None  # one DCP checkpoint, per rank
    for c in ("dcp-sync-10", "dcp-async-10", "dcp-async-1"):
        if c in runs:
            full = [per_rank(c, "total", r) / statistics.median(x["saves"] for x in runs[c]) for r in range(args.world)]
            break
    cpu_base = med("none", "cpu")
    lines = ["| config | median s | s/step | vs none | vs none, per round | CPU s | CPU vs none | training blocked s | "
             f"checkpoints | bytes per rank per step ({ranks}) | of a full checkpoint per step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for config, rs in runs.items():
        t = med(config, "seconds")
        paired = statistics.median(x["seconds"] / n["seconds"] for x, n in zip(rs, runs["none"]))
        if config == "diffckpt":
            per = [per_rank(config, "seg", r) / args.steps for r in range(args.world)]
            ckpts = f"{args.steps} (every step)"
        elif config.startswith("dcp"):
            per = [per_rank(config, "total", r) / args.steps for r in range(args.world)]
            ckpts = str(rs[0]["saves"])
        else:
            per, ckpts = None, "-"
        cells = [config, f"{t:.2f}", f"{t / timed:.3f}", f"{t / base:.2f}×", f"{paired:.2f}×",
                 f"{med(config, 'cpu'):.1f}", f"{med(config, 'cpu') / cpu_base:.2f}×", f"{med(config, 'blocked'):.2f}", ckpts,
                 " / ".join(f"{p / 1e6:.2f} MB" for p in per) if per else "-",
                 f"{100 * sum(per) / sum(full):.1f}%" if per and full else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if "diffckpt" in runs:
        seg = [per_rank("diffckpt", "seg", r) for r in range(args.world)]
        bases = [per_rank("diffckpt", "base", r) for r in range(args.world)]
        w = {k: statistics.median(x["writer"][k] for x in runs["diffckpt"]) for k in runs["diffckpt"][0]["writer"]}
        lines += [
            f"diffckpt per rank ({ranks}): segments {' / '.join(f'{b / 1e6:.2f} MB' for b in seg)} for "
            f"{args.steps} steps in {runs['diffckpt'][0]['segments']} segments "
            f"({' / '.join(f'{b / args.steps / 1e6:.3f} MB' for b in seg)} per step); starting base "
            f"{' / '.join(f'{b / 1e6:.2f} MB' for b in bases)}; run-root files "
            f"{statistics.median(x['other'] for x in runs['diffckpt']) / 1e3:.1f} kB. Writer, slowest rank, "
            f"median per run: write time {w['write']:.2f} s, training stalled on a full queue {w['stall']:.2f} s, "
            f"raw/encoded {w['raw'] / w['seg_bytes']:.2f}.", ""]
    if full is not None:
        lines += [f"One DCP checkpoint (sharded model + AdamW state + scheduler) per rank ({ranks}, r0 with "
                  f"`.metadata`): {' / '.join(f'{b / 1e6:.2f} MB' for b in full)}.", ""]
    restores = data["restores"]
    if restores:
        lines += ["| step restored | onto | diffckpt `resume` s | of which replay s | read wait s | steps replayed (base) | "
                  "read per rank | CPU s | `dcp.load` s | CPU s | diffckpt / DCP | bitwise (diffckpt / DCP) |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]

        def m(rs: list[dict[str, Any]], key: str) -> float:
            return statistics.median(x[key] for x in rs)

        for step in sorted(restores["diffckpt"], key=int):
            for suffix, onto in (("", f"the same {args.layout} layout"), ("-1d", f"1-D FSDP2, {args.world} ranks")):
                if "diffckpt" + suffix not in restores:
                    continue
                d, c = restores["diffckpt" + suffix][step], restores["dcp" + suffix][step]
                ok = (f"{'yes' if all(x['bitwise'] for x in d) else 'NO'} / "
                      f"{'yes' if all(x['bitwise'] for x in c) else 'NO'}")
                lines.append(
                    f"| {step} | {onto} | {m(d, 'seconds'):.3f} | {m(d, 'replay_s'):.3f} | {m(d, 'read_wait_s'):.3f} | "
                    f"{d[0]['replayed']} ({d[0]['base_step']}) | {d[0]['read_bytes'] / 1e6:.1f} MB | {m(d, 'cpu'):.2f} | "
                    f"{m(c, 'seconds'):.3f} | {m(c, 'cpu'):.2f} | {m(d, 'seconds') / m(c, 'seconds'):.1f}× | {ok} |")
        lines.append("")
    lines += ["All runs (s, in round order; 1-minute load average at the end of each run in parentheses):", ""]
    lines += [f"- {c}: " + " ".join(f"{r['seconds']:.2f} ({r['load']:.1f})" for r in rs) for c, rs in runs.items()]
    for method, by_step in restores.items():
        for step, rs in by_step.items():
            lines.append(f"- restore {method} step {step}: " + " ".join(f"{r['seconds']:.3f}" for r in rs))
    return lines


NOTES = (
    "`median s`: the timed steps plus the last flush or future, slowest rank. `vs none`: ratio of the "
    "medians; `vs none, per round`: median over rounds of the ratio to that round's `none` run. `CPU s`: "
    "user + system time of both rank processes over the timed window (every thread: training, writers, "
    "gloo), which other load on the machine changes much less than wall time. `training blocked s`: of "
    "that, the time the training thread spent in checkpoint calls (`commit`; `save`, `async_save` and "
    "waiting for the previous future) and the final flush or future, slowest rank. `bytes per rank per "
    "step`: diffckpt's segments only (the starting base is given below), DCP's files, divided by the "
    "steps of the run. `of a full checkpoint per step`: those bytes against one DCP checkpoint every "
    "step. Restore: the slowest rank's time from a barrier to the state loaded (diffckpt: `resume` and "
    "the scheduler; DCP: `dcp.load` of the Stateful, `set_state_dict` included), into a model and "
    "optimizer built before the clock; `read wait s`: of the replay, the time rank 0 waited for segment "
    "data; `read per rank`: diffckpt's encoded segment bytes read by rank 0; `CPU s`: both processes; "
    "`bitwise`: every piece of every parameter and optimizer state tensor equals the trained one on "
    "every rank, in every repeat. Two ranks of one torch thread each share the two cores with "
    "diffckpt's writer threads and DCP's async writer threads."
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", default="fsdp", choices=sorted(LAYOUTS), help="fsdp: 2 ranks; hsdp, tp: 2x2")
    ap.add_argument("--steps", type=int, default=30, help="steps per run, a multiple of --dcp-every")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of every run")
    ap.add_argument("--size", default="bench", choices=sorted(SIZES))
    ap.add_argument("--batch", type=int, help="sequences per rank per step (default: half the size's batch)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--dcp-every", type=int, default=10, help="steps between the sparse DCP saves")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of every restore")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    ap.add_argument("--tmp", help="parent of the temp run dirs (default: the system temp dir; use local disk)")
    ap.add_argument("--out", help="Markdown report path")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny size, 20 steps, 1 round, 1 repeat")
    args = ap.parse_args()
    if args.quick:
        args.size, args.steps, args.rounds, args.repeats, args.warmup = "tiny", 20, 1, 1, 2
    args.world = math.prod(LAYOUTS[args.layout])
    if args.batch is None:  # two data-parallel ranks in every layout but HSDP's four
        args.batch = max(1, SIZES[args.size].batch_size // 2)
    configs = args.configs.split(",")
    if set(configs) - set(CONFIGS) or "none" not in configs:
        sys.exit(f"--configs must include 'none' and only use {CONFIGS}")
    if args.steps % args.dcp_every or args.steps <= max(args.warmup, args.dcp_every):
        sys.exit("--steps must be a multiple of --dcp-every, above it and above --warmup")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    kind = {"fsdp": "FSDP2 (`fully_shard`)", "hsdp": "HSDP (`fully_shard` over a 2x2 (replicate, shard) mesh)",
            "tp": "FSDP x TP (`parallelize_module` over tp, `fully_shard` over dp, 2x2)"}[args.layout]
    info = header(f"gloo, {kind}", f" per rank, {args.world} ranks")
    cfg = SIZES[args.size]
    n_params = sum(p.numel() for p in GPT(args.size).parameters())
    out = report_path(args.out, "sharded" if args.layout == "fsdp" else f"sharded-{args.layout}", args.quick)
    with tempfile.TemporaryDirectory(prefix="bench-sharded-", dir=args.tmp) as workdir:
        args.workdir, args.result_file = workdir, os.path.join(workdir, "result.json")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(worker, args=(port, args), nprocs=args.world, start_method="spawn")
        with open(args.result_file) as f:
            data = json.load(f)
    wall = time.perf_counter() - started
    info += [
        (f"- model: GPT '{args.size}', {n_params / 1e6:.2f}M parameters (fp32), `fully_shard` per block and at the "
         f"root, {kind} on {args.world} CPU ranks; batch {args.batch} x {cfg.ctx} tokens per data-parallel rank, "
         "AdamW + OneCycleLR, gradient clipping"),
        (f"- {args.steps} optimizer steps per run, first {args.warmup} untimed; {args.rounds} interleaved rounds; "
         f"temp dirs on local disk; diffckpt: `CheckpointOptions()` defaults (every step restorable, write_batch 8, "
         f"bases sized by bytes, retention off); DCP sparse saves every {args.dcp_every} steps"),
        (f"- restore: {args.repeats} interleaved repeats, medians, warm page cache; bench wall time {wall:.0f} s, "
         "load average after it " + " / ".join(f"{x:.2f}" for x in os.getloadavg())),
    ]
    table = render(data, args)
    print("\n" + "\n".join(table))
    write_report(out, [f"# Sharded ({args.layout}) training: diffckpt against torch.distributed.checkpoint", "", *info, "",
                       *table, "", NOTES, ""])
    print(f"\nwritten to {out} ({wall:.0f} s)")


if __name__ == "__main__":
    main()
