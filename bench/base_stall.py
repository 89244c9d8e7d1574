"""How long training waits for the writer at a base, with the node-local tier's journal on and off,
on S3 (a moto server on loopback, ``bench/s3server.py``) at GPT-2 124M shapes.

The model is ``bench/gpu_scale.py``'s GPT-2 124M (a ``GPT2Config``, no download), one training
thread, trained on the CPU in float32 with sequences shortened to ``--seq`` tokens so that a step
takes a few seconds here (bf16 autocast on this CPU took 40 to 80 s a step, even at 32 tokens):
the parameter count, and so a step's float32 gradients (0.5 GB) and the weights in a base, are the
124M model's. ``--optimizer`` is ``sgd`` by default (a base of the weights alone, 0.5 GB) and
``write_batch`` 1, to keep every object within what the moto server completes in minutes here
(``--optimizer adamw``: a base with AdamW's moments, 1.5 GB). The loop drives the core
``CheckpointEngine`` (``start``, the starting base at step 0 flushed, then ``record_step`` after
every ``optimizer.step()``, every step restorable, and ``write_base`` every ``--base-every`` steps).
Each configuration runs in a fresh process against its own prefix of the bucket:

- ``off``: ``local_dir=None``, no journal: training waits only when ``max_pending_bytes`` is full;
- ``on``: the journal in a temp folder (the default tier): training also waits until the record
  before it is journaled.

``--pending`` is ``max_pending_bytes`` (default 3 GiB: room for a base, 1.5 GB at 124M, and a few
steps; at the library's default, 256 MiB, a 124M base alone is past the bound and every record after
a base waits for the base's upload, journal or not, which is the bound at work).

Measured on the training thread: each checkpoint call's wall time and the writer's stall counter
(``WriterStats.stall_seconds``, the time ``put`` waited in the hand-off). Reported per run:

- ``stall/base``: the stall of a base's window (its ``write_base`` and the records of the steps after
  it, up to the next base's step), averaged over the bases after step 0;
- ``stall/step``: the stall per record of the steps up to the first of those bases (no base in
  flight: what the journal's one-step wait costs by itself);
- ``base upload``: seconds from a ``write_base`` call until the writer counted the base written;
- ``s/step``: wall time of the timed steps (the final ``close()`` not counted), and ``close s``.

    python bench/base_stall.py [--steps 5] [--base-every 3] [--write-batch 1] [--seq 32]
                               [--optimizer sgd]
                               [--configs off,on] [--trials 1] [--pending BYTES] [--out JSON]

Writes ``bench/results/base-stall.json`` (every run, per-step figures included) unless ``--out``, and
prints a Markdown table. To compare with another checkout (e.g. the code before a change), run this
file from that checkout: it imports diffckpt from the tree it sits in.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

BUCKET = "diffckpt-base-stall"


# ------------------------------------------------------------------------------------ the child
def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from gpu_scale import SIZES
    from transformers import GPT2Config, GPT2LMHeadModel

    from diffckpt import CheckpointEngine, CheckpointOptions, FsspecStorage, RetryPolicy

    torch.set_num_threads(args.threads)
    layers, dim, heads, vocab, ctx = SIZES["124m"]
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab, n_positions=ctx,
                     bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    model = GPT2LMHeadModel(cfg)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1) if args.optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=1e-3))
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1)

    def step() -> None:
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()

    options = CheckpointOptions(write_batch=args.write_batch, every_n_steps=1, base_every_n_steps=args.base_every,
                                retention=None, max_pending_bytes=args.pending,
                                local_dir=args.local_dir if args.config == "on" else None,
                                retry=RetryPolicy(budget_s=60, initial_backoff_s=0.05, max_backoff_s=0.5))
    # moto completes a multipart upload of hundreds of MB in one request that can outlast
    # botocore's 60 s read timeout on a loaded machine (then s3fs's retry of it gets a 500)
    engine = CheckpointEngine(FsspecStorage(args.url, config_kwargs={"read_timeout": 900}), options)
    engine.start(model, [opt], 0)
    engine.write_base(0, model.state_dict(), [opt.state_dict()], {"step": 0})
    engine.flush()
    writer = engine.recorder.writer
    stats = writer.stats

    # When each base is counted written (stats.bases), polled: its upload time.
    bases_done: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        seen = stats.bases
        while not stop.wait(0.02):
            while stats.bases > seen:
                seen += 1
                bases_done.append(time.perf_counter())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    steps: list[dict[str, Any]] = []
    base_calls: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    for n in range(1, args.steps + 1):
        began = time.perf_counter()
        step()
        trained = time.perf_counter()
        stalled = stats.stall_seconds
        engine.record_step(n, {"step": n})
        recorded = time.perf_counter()
        rec_stall = stats.stall_seconds - stalled
        base_s = base_stall = None
        if engine.wants_base(n):
            stalled = stats.stall_seconds
            base_calls.append((n, time.perf_counter()))
            engine.write_base(n, model.state_dict(), [opt.state_dict()], {"step": n})
            base_s, base_stall = time.perf_counter() - recorded, stats.stall_seconds - stalled
        print(f"step {n}: {time.perf_counter() - began:.1f} s, stalled {stats.stall_seconds:.1f} s in all",
              file=sys.stderr, flush=True)
        steps.append({"step": n, "train_s": trained - began, "record_s": recorded - trained, "record_stall": rec_stall,
                      "base_s": base_s, "base_stall": base_stall, "wall_s": time.perf_counter() - began})
    loop_s = time.perf_counter() - t0
    engine.close()
    close_s = time.perf_counter() - t0 - loop_s
    stop.set()
    watcher.join()
    uploads = [done - called for (_, called), done in zip(base_calls, bases_done)]
    return {"config": args.config, "params": params, "steps": steps, "loop_s": loop_s, "close_s": close_s,
            "s_per_step": loop_s / args.steps, "base_steps": [s for s, _ in base_calls], "base_upload_s": uploads,
            "base_bytes": stats.base_bytes, "segment_bytes": stats.segment_bytes, "bases": stats.bases,
            "peak_held_bytes": stats.peak_held_bytes, "max_pending_bytes": args.pending}


def summarize(run: dict[str, Any], base_every: int) -> dict[str, Any]:
    """``stall/base``: per base after step 0, the stall of its ``write_base`` and of the records up to
    the next base's step; ``stall/step``: per record up to the first of them."""
    steps = run["steps"]
    windows = []
    for b in run["base_steps"]:
        window = [s for s in steps if b < s["step"] <= b + base_every]
        windows.append((steps[b - 1]["base_stall"] or 0.0) + sum(s["record_stall"] for s in window))
    first = run["base_steps"][0] if run["base_steps"] else len(steps) + 1
    before = [s["record_stall"] for s in steps if s["step"] <= first]
    worst = max((max(s["record_s"], s["base_s"] or 0.0) for s in steps), default=0.0)
    return {"stall_per_base": statistics.fmean(windows) if windows else 0.0, "stall_windows": windows,
            "stall_per_step": statistics.fmean(before) if before else 0.0, "worst_call_s": worst,
            "upload_s": statistics.fmean(run["base_upload_s"]) if run["base_upload_s"] else None}


# ------------------------------------------------------------------------------------ the parent
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", nargs="?", default="bench", choices=["bench", "child"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--base-every", type=int, default=3)
    ap.add_argument("--write-batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=32, help="tokens per sequence (124M's is 1024)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pending", type=int, default=3 << 30, help="max_pending_bytes")
    ap.add_argument("--configs", default="off,on")
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "base-stall.json"))
    # the child's own
    ap.add_argument("--config", default="on")
    ap.add_argument("--url", default="")
    ap.add_argument("--local-dir", default="")
    args = ap.parse_args()
    if args.what == "child":
        sys.stdout.write("RESULT " + json.dumps(child(args)) + "\n")
        return

    from s3server import LoopbackS3

    s3 = LoopbackS3(BUCKET)
    env = {**os.environ, **s3.env, "PYTHONPATH": ROOT}
    runs: list[dict[str, Any]] = []
    configs = args.configs.split(",")
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="diffckpt-base-stall-") as work:
            for trial in range(args.trials):
                for config in configs if trial % 2 == 0 else configs[::-1]:
                    url = s3.url(f"run-{uuid.uuid4().hex[:8]}")
                    cmd = [sys.executable, os.path.abspath(__file__), "child", "--config", config, "--url", url,
                           "--local-dir", os.path.join(work, f"local-{trial}-{config}"),
                           *(f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                             ("steps", "base_every", "write_batch", "seq", "batch", "threads", "pending", "optimizer"))]
                    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=False)
                    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
                    if out.returncode or not lines:
                        raise RuntimeError(f"{config} failed (its stderr is above)")
                    run = json.loads(lines[-1][len("RESULT "):])
                    run["trial"], run["summary"] = trial, summarize(run, args.base_every)
                    runs.append(run)
                    s3.clear(url)
                    print(f"# {config} trial {trial}: {json.dumps(run['summary'])}", file=sys.stderr, flush=True)
    finally:
        s3.stop()
    report(runs, args, time.perf_counter() - started)


def report(runs: list[dict[str, Any]], args: argparse.Namespace, seconds: float) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("what", "config", "url", "local_dir")},
                   "runs": runs, "seconds": seconds}, f, indent=1)
    gb = 1e9
    print(f"GPT-2 124M shapes ({runs[0]['params'] / 1e6:.1f}M parameters), seq {args.seq}, batch {args.batch}, "
          f"{args.optimizer}, {args.steps} steps, a base every {args.base_every}, write_batch {args.write_batch}, "
          f"max_pending_bytes {args.pending / gb:.2f} GB, S3 (moto on loopback); {seconds:.0f} s in all\n")
    print("| journal | trial | stall/base s | stall/step s | worst call s | base upload s | s/step | close s "
          "| base GB | segment GB | peak held GB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for run in runs:
        s = run["summary"]
        upload = "–" if s["upload_s"] is None else f"{s['upload_s']:.1f}"
        print(f"| {run['config']} | {run['trial']} | {s['stall_per_base']:.2f} | {s['stall_per_step']:.3f} "
              f"| {s['worst_call_s']:.2f} | {upload} | {run['s_per_step']:.2f} | {run['close_s']:.1f} "
              f"| {run['base_bytes'] / gb:.2f} | {run['segment_bytes'] / gb:.2f} | {run['peak_held_bytes'] / gb:.2f} |")


if __name__ == "__main__":
    main()
