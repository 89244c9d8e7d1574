"""Storage traffic of diffckpt: PUTs, bytes and write throughput per step, on local disk and S3.

A plain PyTorch loop (the GPT of ``examples/gpt.py``, AdamW + OneCycleLR + gradient clipping)
drives the core ``CheckpointEngine`` as ``tests/core/engine_runs.py`` does: ``start``, the
starting base at step 0, then ``record_step`` after every ``optimizer.step()`` (``every_n_steps=1``,
each step restorable) and ``write_base`` when ``wants_base`` says so, and ``close()`` at the end.
``base_every_n_steps=None``, so the starting base is the only base and the numbers show the diff
traffic; the base is reported on its own.

Configurations: backend (``local``: a temp dir; ``s3``: a loopback moto server started as a
separate process, ``s3://<bucket>/run-...``) x ``write_batch`` in (1, 4, 16, 64) x compression
(``zstd``, ``none``), plus ``none``: the same loop without an engine, the baseline. Every round
runs every configuration once, in alternating order (reversed every other round) to spread
drift; each run starts from the same seed and a fresh run root, which is deleted afterwards.

Measured per run:

- PUTs: a counting :class:`diffckpt.storage.Storage` wrapped around ``FsspecStorage`` is passed as
  ``dirpath``; it counts every ``write`` and its bytes, split into diff segments (``diffs/``),
  bases (``bases/``: ``state.safetensors`` and ``COMMIT``) and other objects (run and session
  files), and times each ``write`` call (``PUT MB/s``: storage alone).
- The writer's own ``WriterStats`` (segment and base bytes, raw record bytes, write and stall
  seconds). ``write throughput MB/s`` = (segment + base bytes) / ``write_seconds``, which also
  covers encoding and compressing a segment, so it is the rate the background writer sustains.
- Other ``Storage`` calls (``exists``, ``list``, ``read``): the engine's fencing check before each
  commit, the session start.
- Time: from the start of the first step after ``--warmup`` untimed steps until
  ``engine.close()`` returned (so the final flush counts), best of the rounds, relative to the
  baseline's best in the same process (the baseline runs twice per round, before each backend);
  both wall time and the process's CPU time (all threads) over that window, the latter being
  less sensitive to other load on the machine.

    python bench/storage.py [--steps N] [--rounds R] [--quick]

Writes a Markdown report to ``bench/results/storage.md`` (``storage-quick.md`` with --quick).
Torch keeps its default thread count. The moto server runs in a process of its own but on the
same cores, so on a small machine S3 time ratios include the server's CPU work, which a remote
S3 endpoint would not add.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
import warnings
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

from gpt import GPT, SIZES, make_loader, plain_step
from provenance import header, report_path, write_report
from s3server import LoopbackS3

from diffckpt import CheckpointEngine, CheckpointOptions, FsspecStorage

BATCHES = (1, 4, 16, 64)
COMPRESSIONS = ("zstd", "none")
BACKENDS = ("local", "s3")
BUCKET = "diffckpt-bench"


class CountingStorage:
    """A :class:`diffckpt.storage.Storage` that counts and times the writes of another one.

    Every protocol method is delegated; any other attribute (a method added to the protocol
    later, ``fs``, ``root``...) comes from the wrapped storage through ``__getattr__``.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.url = inner.url
        self._lock = threading.Lock()
        self.puts = {"diffs": 0, "bases": 0, "other": 0}
        self.bytes = {"diffs": 0, "bases": 0, "other": 0}
        self.put_seconds = 0.0
        self.segment_sizes: list[int] = []
        self.reads = self.lists = self.deletes = self.exists_calls = 0

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found on the wrapper itself.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def write(self, path: str, data: Any) -> None:
        parts = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
        nbytes = sum(memoryview(p).nbytes for p in parts)
        kind = path.split("/", 1)[0] if path.startswith(("diffs/", "bases/")) else "other"
        start = time.perf_counter()
        self.inner.write(path, data)
        elapsed = time.perf_counter() - start
        with self._lock:
            self.puts[kind] += 1
            self.bytes[kind] += nbytes
            self.put_seconds += elapsed
            if kind == "diffs":
                self.segment_sizes.append(nbytes)

    def create(self, path: str, data: bytes) -> bool:
        """Exclusive create (the session file); counted as a write of kind "other"."""
        start = time.perf_counter()
        created = self.inner.create(path, data)
        elapsed = time.perf_counter() - start
        with self._lock:
            self.puts["other"] += 1
            self.bytes["other"] += len(data)
            self.put_seconds += elapsed
        return created  # type: ignore[no-any-return]

    def read(self, path: str) -> bytes:
        self.reads += 1
        return self.inner.read(path)  # type: ignore[no-any-return]

    def list(self, prefix: str) -> dict[str, int]:
        self.lists += 1
        return self.inner.list(prefix)  # type: ignore[no-any-return]

    def delete(self, path: str) -> None:
        self.deletes += 1
        self.inner.delete(path)

    def exists(self, path: str) -> bool:
        self.exists_calls += 1
        return self.inner.exists(path)  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------ one run
def batches(size: str):
    """An endless stream of training batches (the loader re-shuffles each epoch)."""
    loader = make_loader(size)
    while True:
        yield from loader


def run_once(config: tuple[str, int, str] | None, args: argparse.Namespace, steps: int,
             warmup: int, s3: LoopbackS3 | None) -> dict[str, Any]:
    """Train ``steps`` steps; ``config``: (backend, write_batch, compression), None: baseline."""
    torch.manual_seed(0)
    model = GPT(args.size, total_steps=steps)
    conf = model.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    opts = [opt]
    data = batches(args.size)

    workdir = prefix = None
    storage = engine = writer = None
    if config is not None:
        backend, write_batch, compression = config
        if backend == "local":
            workdir = tempfile.mkdtemp(prefix="bench-storage-", dir=args.tmp)
            inner = FsspecStorage(workdir)
        else:
            assert s3 is not None
            prefix = f"run-{uuid.uuid4().hex[:12]}"
            inner = FsspecStorage(f"s3://{BUCKET}/{prefix}", **s3.options)
        storage = CountingStorage(inner)
        options = CheckpointOptions(
            every_n_steps=1,
            write_batch=write_batch,
            base_every_n_steps=None,
            compression=compression,
        )
        engine = CheckpointEngine(storage, options)
        engine.start(model, opts, 0)
        engine.write_base(0, model.state_dict(), [o.state_dict() for o in opts], state_of(0, sched))
        writer = engine.recorder.writer  # its stats stay readable after close()

    try:
        t0, cpu0 = None, 0.0
        for step in range(1, steps + 1):
            if step == warmup + 1:
                t0, cpu0 = time.perf_counter(), time.process_time()
            batch = next(data)
            plain_step(model, opt, sched, batch)
            if engine is not None:
                engine.record_step(step, state_of(step, sched))
                if engine.wants_base(step):
                    optim_states = [o.state_dict() for o in opts]
                    engine.write_base(step, model.state_dict(), optim_states, state_of(step, sched))
        t_loop = time.perf_counter()
        if engine is not None:
            engine.close()
        t_end, cpu_end = time.perf_counter(), time.process_time()
        assert t0 is not None
        out: dict[str, Any] = {
            "seconds": t_end - t0, "tail": t_end - t_loop, "cpu": cpu_end - cpu0
        }
        if storage is not None and writer is not None:
            s = writer.stats
            out.update(
                puts=dict(storage.puts),
                bytes=dict(storage.bytes),
                put_seconds=storage.put_seconds,
                segment_sizes=list(storage.segment_sizes),
                other_calls=storage.reads + storage.lists + storage.exists_calls,
                segments=s.segments,
                records=s.records,
                bases=s.bases,
                segment_bytes=s.segment_bytes,
                base_bytes=s.base_bytes,
                raw=s.raw_record_bytes,
                write_seconds=s.write_seconds,
                stall=s.stall_seconds,
            )
        return out
    finally:
        if engine is not None and engine.recorder.writer is not None:  # an error above: stop the thread
            with contextlib.suppress(Exception):  # the error above is what to report
                engine.close()
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        if prefix and s3 is not None:
            s3.clear(prefix)
        del model, opt, sched, opts, engine, storage, writer
        gc.collect()


def state_of(step: int, sched: Any) -> dict[str, Any]:
    """The small framework state recorded with each step: counter, scheduler, torch RNG."""
    return {"step": step, "scheduler": sched.state_dict(), "rng": torch.get_rng_state()}


# ------------------------------------------------------------------------------- report
def machine_info(args: argparse.Namespace, steps: int, warmup: int) -> list[str]:
    cfg = SIZES[args.size]
    n_params = sum(p.numel() for p in GPT(args.size).parameters())
    import fsspec
    import moto
    import s3fs

    return [
        *header(f"fsspec {fsspec.__version__}, s3fs {s3fs.__version__}, moto {moto.__version__} "
                "(loopback server, a separate process on the same cores)", " (default)"),
        f"- model: GPT '{args.size}', {n_params / 1e6:.2f}M parameters (fp32, "
        + f"{n_params * 4 / 1e6:.2f} MB of gradients per step), batch {cfg.batch_size} x {cfg.ctx} "
        + "tokens, AdamW + OneCycleLR, gradient clipping; plain PyTorch loop, core engine",
        f"- {steps} optimizer steps per run, first {warmup} untimed; {args.rounds} interleaved "
        + "rounds (baseline twice per round); every_n_steps=1, base_every_n_steps=None (only "
        + "the starting base at step 0), "
        + f"fingerprint_every_n_steps={CheckpointOptions().fingerprint_every_n_steps}, "
        + f"compression_level={CheckpointOptions().compression_level}; local temp dirs under "
        + f"{args.tmp or tempfile.gettempdir()}",
    ]


def med(runs: list[dict[str, Any]], fn: Any) -> float:
    return statistics.median(fn(r) for r in runs)


def render(results: dict[Any, list[dict[str, Any]]], steps: int) -> list[str]:
    # Times: best of the rounds. Other load on the machine only ever adds time, so the minimum
    # is the steadiest estimate on a shared box; every run is listed below the table.
    base = min(r["seconds"] for r in results[None])
    base_cpu = min(r["cpu"] for r in results[None])
    lines = [
        ("| backend | write_batch | compression | PUTs/step (diffs) | bytes/step (diffs) "
         "| total bytes/step | segment size | raw/encoded | write throughput MB/s | PUT MB/s "
         "| exists+list+read/step | stall s | close s | time ratio vs none | CPU ratio vs none |"),
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base_rows: set[tuple[int, int]] = set()
    other_puts: set[int] = set()
    other_bytes: list[int] = []
    for config, runs in results.items():
        if config is None:
            continue
        backend, wb, comp = config
        puts = med(runs, lambda r: r["puts"]["diffs"])
        seg_bytes = med(runs, lambda r: r["bytes"]["diffs"])
        total = med(runs, lambda r: r["bytes"]["diffs"] + r["bytes"]["bases"])
        seg_size = med(runs, lambda r: statistics.mean(r["segment_sizes"] or [0]))
        raw = med(runs, lambda r: r["raw"] / r["segment_bytes"] if r["segment_bytes"] else 0)
        wtp = med(runs, lambda r: (r["segment_bytes"] + r["base_bytes"]) / 1e6
                  / max(r["write_seconds"], 1e-9))
        ptp = med(runs, lambda r: (r["bytes"]["diffs"] + r["bytes"]["bases"]) / 1e6
                  / max(r["put_seconds"], 1e-9))
        ratio = min(r["seconds"] for r in runs) / base
        cpu_ratio = min(r["cpu"] for r in runs) / base_cpu
        cells = [
            backend, str(wb), comp,
            f"{puts / steps:.3f}",
            f"{seg_bytes / steps / 1e6:.2f} MB",
            f"{total / steps / 1e6:.2f} MB",
            f"{seg_size / 1e6:.2f} MB",
            f"{raw:.2f}",
            f"{wtp:.0f}",
            f"{ptp:.0f}",
            f"{med(runs, lambda r: r['other_calls']) / steps:.2f}",
            f"{med(runs, lambda r: r['stall']):.2f}",
            f"{med(runs, lambda r: r['tail']):.2f}",
            f"{ratio:.2f}x",
            f"{cpu_ratio:.2f}x",
        ]
        lines.append("| " + " | ".join(cells) + " |")
        for r in runs:
            base_rows.add((r["puts"]["bases"], r["bytes"]["bases"]))
            other_puts.add(r["puts"]["other"])
            other_bytes.append(r["bytes"]["other"])
    lines += [""]
    for bputs, bbytes in sorted(base_rows):
        lines.append(
            f"Bases (every configuration): {bputs} PUTs, {bbytes / 1e6:.2f} MB in total "
            f"(the starting base's state.safetensors + COMMIT), i.e. "
            f"{bbytes / steps / 1e6:.3f} MB/step over this run; included in `total bytes/step`."
        )
    lines.append(
        f"Other objects (run.json, session file): {'/'.join(map(str, sorted(other_puts)))} PUTs, "
        f"{min(other_bytes)}-{max(other_bytes)} bytes per run; not in the table."
    )
    lines += [
        "",
        (f"Baseline (no checkpointing): best {base:.2f} s wall, {base_cpu:.2f} s process CPU "
         "for the timed steps."),
        "",
        "All runs (timed wall s / process CPU s, in the order run):",
        "",
    ]
    for config, runs in results.items():
        name = "none" if config is None else "/".join(map(str, config))
        lines.append(f"- {name}: " + " ".join(f"{r['seconds']:.2f}/{r['cpu']:.2f}" for r in runs))
    lines += [
        "",
        ("`PUTs/step (diffs)`: diff-segment writes / steps (each write is one object: one PUT, "
         "or a multipart upload for large ones, on S3; a temp file + fsync + rename + directory "
         "fsync locally). `bytes/step (diffs)`: segment bytes / steps. `total bytes/step`: "
         "segment + base bytes / steps. `segment size`: mean bytes per segment. `raw/encoded`: "
         "record bytes before / after encoding (compression effect). `write throughput MB/s`: "
         "(segment + base bytes) / the writer's `write_seconds` (includes encoding and zstd). "
         "`PUT MB/s`: the same bytes / time inside `Storage.write` only. "
         "`exists+list+read/step`: the other `Storage` calls the engine made, per step (mostly "
         "the fencing check before each commit: one read of the next session file, normally a "
         "404). `stall s`: training waited on a full writer queue. `close s`: time "
         "`engine.close()` took (the final flush). `time ratio "
         "vs none`: timed wall seconds (steps after warmup + `engine.close()`), best of the rounds, "
         "/ the baseline's best (other load only adds time). `CPU ratio vs none`: the same for "
         "the CPU time of this process (all its threads: training, writer, s3fs; not the moto "
         "server) "
         "over the same window, best of the rounds; less sensitive than wall time to other load "
         "on the machine, but OpenMP workers spinning on a busy machine inflate it too."
         " Traffic columns are medians over the rounds (they do not vary)."),
    ]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of every run")
    ap.add_argument("--size", default="demo", choices=sorted(SIZES))
    ap.add_argument("--tmp", help="parent of the local temp run dirs (default: system temp dir)")
    ap.add_argument("--out", help="Markdown report path")
    ap.add_argument(
        "--quick", action="store_true", help="smoke run (< 1 min): tiny model, 64 steps, 1 round"
    )
    args = ap.parse_args()
    if args.quick:
        args.size, args.steps, args.rounds = "tiny", 64, 1
    out = report_path(args.out, "storage", args.quick)
    steps, warmup = args.steps, args.warmup
    if steps <= warmup:
        sys.exit("--steps must exceed --warmup")
    warnings.filterwarnings("ignore")  # torchdata's and torch's deprecation chatter
    for name in ("diffckpt", "botocore", "s3fs", "werkzeug", "moto"):
        logging.getLogger(name).setLevel(logging.ERROR)

    info = machine_info(args, steps, warmup)
    t_start = time.perf_counter()
    s3 = LoopbackS3(BUCKET)
    try:
        # The baseline runs before each backend's block, so twice per round.
        order: list[Any] = []
        for backend in BACKENDS:
            order += [None, *((backend, b, c) for b, c in itertools.product(BATCHES, COMPRESSIONS))]
        configs: list[Any] = list(dict.fromkeys(order))
        run_once(None, args, warmup + 2, warmup, s3)  # warm the process up (allocator, imports)
        run_once(("s3", 1, "none"), args, warmup + 2, warmup, s3)  # and the S3 client
        results: dict[Any, list[dict[str, Any]]] = {c: [] for c in configs}
        for rnd in range(args.rounds):
            for config in order if rnd % 2 == 0 else list(reversed(order)):
                r = run_once(config, args, steps, warmup, s3)
                results[config].append(r)
                name = "none" if config is None else "/".join(map(str, config))
                extra = ""
                if config is not None:
                    extra = (f"  {r['puts']['diffs']:4d} segment PUTs "
                             f"{r['bytes']['diffs'] / 1e6:8.1f} MB  tail {r['tail']:.2f} s")
                head = f"round {rnd + 1}/{args.rounds} {name:18s}"
                print(f"{head} {r['seconds']:7.2f} s (CPU {r['cpu']:6.2f} s){extra}", flush=True)
    finally:
        s3.stop()
    table = render(results, steps)
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    elapsed = time.perf_counter() - t_start
    info.append(f"- whole benchmark {elapsed:.0f} s; load average after it {load}")
    title = "# Storage traffic and throughput per write_batch, local disk vs S3"
    report = [title, "", *info, "", *table, ""]
    print("\n" + "\n".join(table))
    write_report(out, report)
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
