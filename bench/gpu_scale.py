"""The runs of ``make gpu-check``'s overhead and restore parts (``bench/gpu_check.py``): a GPT-2
model built from a ``GPT2Config`` (no download), trained in a plain loop with bf16 autocast,
one configuration per process. Each run prints one ``RESULT {json}`` line.

    python bench/gpu_scale.py train CONFIG --workdir DIR [--device cuda] [--size 124m] [--batch auto]
    python bench/gpu_scale.py restore diffckpt|limit --workdir DIR  # after ``train diffckpt``

``train`` configurations: ``none`` (no checkpointing, the baseline), ``diffckpt`` (a diff every
step with ``CheckpointEngine``'s default options), ``diffckpt-every-step`` (the same with
``CheckpointOptions(durability="every_step")``: every step durable before training goes on;
refused where this checkout's options have no ``durability``), ``dcp-10`` and ``dcp-1``
(``torch.distributed.checkpoint.async_save`` of the model and optimizer every 10 steps and every
step, the previous save awaited first, older saves deleted). Timed: the ``--steps`` steps after
``--warmup``, from a device synchronisation to the end of the loop (``loop_s``) and to the end
of the final flush or save (``total_s``). Also reported: the peak device memory allocated over
the timed window, the process's peak RSS and the bytes written; for diffckpt, the durable step
(the run root) and the node-local step (the journal) when the loop ended, each as a lag in steps
and in seconds (how long before the loop's end the step it holds was committed), and the writer's
counters (``WriterStats``: ``stall_seconds``, training waiting for the writer; ``write_seconds``;
segment and base bytes).

``--batch auto`` (the ``none`` run only) picks the batch that keeps the device busy for about
``--target-ms`` a step and prints it; the parent passes it to the other runs.

``restore diffckpt`` resumes the newest durable step of ``train diffckpt``'s run root onto a fresh
model and checks it bitwise against that run's final state; ``restore limit`` is what no restore
can beat: ``torch.load`` of the full state at the base that run saved, plus one bare
``optimizer.step()`` per step replayed (gradients already in device memory).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench"), os.path.join(ROOT, "tests")]

SIZES = {  # GPT2Config: n_layer, n_embd, n_head, vocab, tokens per sequence
    "124m": (12, 768, 12, 50257, 1024),
    "350m": (24, 1024, 16, 50257, 1024),
    "tiny": (2, 64, 2, 512, 64),  # the dry run on a CPU
}
CONFIGS = ["none", "diffckpt", "diffckpt-every-step", "dcp-10", "dcp-1"]  # the slowest last
# The diffckpt configurations, as CheckpointOptions keyword arguments.
DIFFCKPT = {"diffckpt": {}, "diffckpt-every-step": {"durability": "every_step"}}


def options_missing(config: str) -> str | None:
    """Why this checkout cannot run the diffckpt configuration ``config`` (an option its
    ``CheckpointOptions`` lacks), or ``None``."""
    import dataclasses

    from diffckpt import CheckpointOptions

    fields = {f.name for f in dataclasses.fields(CheckpointOptions)}
    lacking = sorted(set(DIFFCKPT.get(config, {})) - fields)
    return f"CheckpointOptions has no {', '.join(lacking)} in this checkout" if lacking else None


def rss_peak() -> int:
    """This process's peak resident set size in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def build(args: argparse.Namespace) -> tuple[Any, Any]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, dim, heads, vocab, ctx = SIZES[args.size]
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab, n_positions=ctx,
                     bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    model = GPT2LMHeadModel(cfg).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    return model, opt


def batches(args: argparse.Namespace, batch: int) -> Any:
    import torch

    _, _, _, vocab, ctx = SIZES[args.size]
    ctx = getattr(args, "tokens", None) or ctx  # scale.py --tokens: shorter sequences, the same model
    g = torch.Generator(device=args.device).manual_seed(1)
    while True:
        yield torch.randint(0, vocab, (batch, ctx), device=args.device, generator=g)


def step_fn(args: argparse.Namespace, model: Any, opt: Any) -> Any:
    import torch

    # scale.py --fp32: no autocast, for a CPU without bfloat16 kernels (an AVX2 one took 37 s a
    # step at 124M with it, 1.8 s without)
    fp32 = getattr(args, "fp32", False)

    def step(ids: Any) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=not fp32):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
    return step


def calibrate(args: argparse.Namespace, model: Any, opt: Any) -> int:
    """The batch that keeps the device busy about ``--target-ms`` per step (at most 32: GPT-2
    124M at 32 x 1024 tokens needs about 40 GB of an 80 GB device)."""
    step, batch = step_fn(args, model, opt), 4
    for _ in range(2):
        data = batches(args, batch)
        step(next(data))  # warm-up: kernels chosen, memory allocated
        sync(args.device)
        t0 = time.perf_counter()
        for _ in range(2):
            step(next(data))
        sync(args.device)
        per_step = (time.perf_counter() - t0) / 2
        batch = max(1, min(32, round(batch * args.target_ms / 1000 / per_step)))
    return batch


def train(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    model, opt = build(args)
    batch = calibrate(args, model, opt) if args.batch == "auto" else int(args.batch)
    if args.batch == "auto":  # measure from the same starting point as every other configuration
        model, opt = build(args)
    data = batches(args, batch)
    step = step_fn(args, model, opt)
    root = os.path.join(args.workdir, args.config)
    os.makedirs(root, exist_ok=True)
    engine = save = None
    if args.config in DIFFCKPT:
        from diffckpt import CheckpointEngine, CheckpointOptions

        missing = options_missing(args.config)
        if missing:
            raise SystemExit(f"{args.config}: {missing}")

        class Source:  # nothing beyond model and optimizer: the data depend on the step alone
            def rank_state(self) -> Any:
                return None

            def state(self, ranks: list[Any]) -> Any:
                return {}

        engine, source = CheckpointEngine(root, CheckpointOptions(**DIFFCKPT[args.config])), Source()
        engine.begin(model, [opt], 0, source)
    elif args.config.startswith("dcp-"):
        import torch.distributed.checkpoint as dcp

        every, pending, kept, removed = int(args.config.split("-")[1]), None, [], [0]

        def save(n: int, final: bool = False) -> None:
            nonlocal pending
            if final and n % every == 0:  # saved in the loop already: wait for it
                pending.result()
                return
            if n % every and not final:
                return
            if pending is not None:
                pending.result()
                while len(kept) > 1:  # keep the newest completed save and the one in flight
                    old = kept.pop(0)
                    removed[0] += dir_bytes(old)  # counted as written
                    shutil.rmtree(old, ignore_errors=True)
            path = os.path.join(root, f"step{n}")
            kept.append(path)
            sd = {"model": model.state_dict(), "optimizer": opt.state_dict()}
            pending = dcp.async_save(sd, checkpoint_id=path)
            if final:
                pending.result()
    last = args.warmup + args.steps
    committed = {0: time.perf_counter()}  # when each step's checkpoint call returned
    for n in range(1, args.warmup + args.steps + 1):
        if n == args.warmup + 1:
            sync(args.device)
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t0, cpu0 = time.perf_counter(), thread_cpu()
        step(next(data))
        if engine is not None:
            engine.commit(n, source)
        elif save is not None:
            save(n)
        committed[n] = time.perf_counter()
        if n > args.warmup + 2 and time.perf_counter() - t0 > args.max_seconds:
            last = n  # too slow to finish in its time: timed over the steps it made
            break
    sync(args.device)
    t_loop, cpu1 = time.perf_counter(), thread_cpu()
    durable_at_loop_end = engine.durable_step if engine is not None else None
    tiers = tiers_at(engine, last, t_loop, committed) if engine is not None else {}
    if engine is not None:
        writer = getattr(engine.recorder, "writer", None)  # the session's: the engine lets go of it at end()
        engine.end()
        tiers["writer"] = writer_stats(writer)
    elif save is not None:
        save(last, final=True)
    t_end = time.perf_counter()
    if args.config == "diffckpt":  # the trained state, for ``restore diffckpt``'s check (not timed)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, os.path.join(args.workdir, "final.pt"))
    written, timed = dir_bytes(root) + (removed[0] if save is not None else 0), last - args.warmup
    return {
        "config": args.config, "batch": batch, "steps": timed, "params": sum(p.numel() for p in model.parameters()),
        "loop_s": t_loop - t0, "total_s": t_end - t0, "s_per_step": (t_loop - t0) / timed,
        "flush_s": t_end - t_loop, "rss_peak": rss_peak(),
        "device_peak": torch.cuda.max_memory_allocated() if args.device == "cuda" else None,
        "bytes_written": written, "bytes_per_step": written / last,
        "not_durable_at_loop_end": None if engine is None else last - (durable_at_loop_end or 0),
        # each timed step's time as the loop saw it (the device's queue evens them out), and the CPU
        # each thread spent a timed step: where a slow step's time went
        "step_ms": [round(1000 * (committed[n] - committed[n - 1]), 1) for n in range(args.warmup + 2, last + 1)],
        "cpu_ms_per_step": {k: round(1000 * (v - cpu0.get(k, 0.0)) / timed, 1) for k, v in cpu1.items()
                            if v - cpu0.get(k, 0.0) > 0},
        **tiers,
    }


def thread_cpu() -> dict[str, float]:
    from fast_steps import thread_cpu as cpu  # one definition, in the CPU emulation's script

    return cpu()


def writer_stats(writer: Any) -> dict[str, Any]:
    from fast_steps import writer_figures  # one definition, in the CPU emulation's script

    return writer_figures(writer)


def tiers_at(engine: Any, last: int, now: float, committed: dict[int, float]) -> dict[str, Any]:
    """The durable step (the run root) and the node-local step (the journal) of a running session,
    each with its lag behind step ``last`` in steps and in seconds (``now`` less the time the step
    it holds was committed), from the metrics loggers get."""
    metrics = engine.metrics()
    out: dict[str, Any] = {}
    for name, key in (("durable", "diffckpt/durable_step"), ("local", "diffckpt/local_step")):
        step = metrics.get(key)
        step = None if step is None else int(step)
        out[f"{name}_step"] = step
        out[f"{name}_lag_steps"] = None if step is None else last - step
        out[f"{name}_lag_s"] = None if step is None else now - committed.get(step, committed[0])
    return out


def same(a: Any, b: Any) -> bool:
    """Whether two state trees hold the same keys and bitwise equal tensors."""
    from helpers import assert_bitwise_equal

    try:
        assert_bitwise_equal(a, b)
    except AssertionError:
        return False
    return True


def restore(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    model, opt = build(args)
    if args.config == "diffckpt":
        from diffckpt import CheckpointEngine  # imported before the clock starts
        from diffckpt.tree import portable

        sync(args.device)
        t0 = time.perf_counter()
        result = CheckpointEngine(os.path.join(args.workdir, "diffckpt")).resume(model, [opt])
        sync(args.device)
        seconds, steps, rss = time.perf_counter() - t0, result.step, rss_peak()  # before the check's load
        replayed, base_step = result.replayed, result.base_step
        truth = torch.load(os.path.join(args.workdir, "final.pt"), map_location="cpu", weights_only=True)
        exact = same(portable({"model": model.state_dict(), "optimizer": opt.state_dict()}), truth)
    else:  # the state diffckpt's base held, then as many bare steps as replay took from it
        steps = replayed = args.steps_replayed
        base_step = args.base_step
        path = limit_state(args.workdir, base_step, model, opt)
        grads = [torch.randn_like(p) for p in model.parameters()]
        sync(args.device)
        t0 = time.perf_counter()
        load_and_step(model, opt, path, args.device, grads, steps)
        sync(args.device)
        seconds, exact, rss = time.perf_counter() - t0, None, rss_peak()
    return {"config": args.config, "seconds": seconds, "steps": steps, "replayed": replayed, "base_step": base_step,
            "exact": exact, "rss_peak": rss,
            "device_peak": torch.cuda.max_memory_allocated() if args.device == "cuda" else None}


def limit_state(folder: str, base_step: int, model: Any, opt: Any) -> str:
    """The file of full state the restore limit loads: what diffckpt's base held. A base at step 0
    holds the freshly built model and an optimizer without moments (written here from the fresh
    ``model`` and ``opt``, so that no training run pays for it); a later base holds the moments,
    as the trained state in ``final.pt`` does (the same tensors)."""
    import torch

    if base_step > 0:
        return os.path.join(folder, "final.pt")
    path = os.path.join(folder, "base0.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return path


def load_and_step(model: Any, opt: Any, path: str, device: str, grads: list[Any], steps: int) -> None:
    """What no restore can beat: ``torch.load`` of the full state, then ``steps`` bare optimizer
    steps with gradients already in memory."""
    import torch

    full = torch.load(path, map_location=device, weights_only=True)
    model.load_state_dict(full["model"])
    opt.load_state_dict(full["optimizer"])
    del full
    for _ in range(steps):
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        opt.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["train", "restore"])
    ap.add_argument("config", choices=[*CONFIGS, "limit"])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--size", default="124m", choices=sorted(SIZES))
    ap.add_argument("--batch", default="auto", help="sequences per step, or auto (see above)")
    ap.add_argument("--target-ms", type=float, default=100.0)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-seconds", type=float, default=float("inf"),
                    help="stop timing after this long (at least 3 steps), timed over the steps made")
    ap.add_argument("--steps-replayed", type=int, default=0, help="restore limit: bare optimizer steps")
    ap.add_argument("--base-step", type=int, default=0, help="restore limit: the step of diffckpt's base")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    out = train(args) if args.what == "train" else restore(args)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
