"""The writer's path of one record, stage by stage, at GPT-2 124M size, against the raw bandwidth
of the target it writes to (docs/benchmarks.md, "The writer pipeline"; ``make bench-pipeline``).

Records: the gradients of one real backward of GPT-2 124M (``bench/gpu_scale.py``'s model: a
``GPT2Config``, no download) under bf16 autocast on the CPU, batch 1 x ``--tokens`` tokens,
computed before any clock. Most of them are bfloat16-valued float32 tensors, which
``narrowing.narrowed`` stores in 16 bits exactly; the tied embedding's (38.6M parameters, summed
from the lookup and the head) is bfloat16-valued but in the rows of the batch's tokens, and is
stored row-split (format 4); the position embedding's stays float32. Random tensors would
compress differently and hide zstd's cost. Each record holds them as ``Recorder.record_step``
does (one AdamW event, the param groups, a small restorable state); every record is the same
gradients at a new step.

Stages, each timed on its own over ``--records`` records (MB/s of the stored record, median):

- ``narrow``: ``narrowing.narrowed`` of every gradient on the CPU (``prepare_record``; MB/s of the
  float32 gradients read). The GPU path narrows on the device instead, off the writer thread.
- ``pack``: ``tree.pack_parts`` (the safetensors header and views of the tensors).
- ``decide``: the sample ``compression="auto"`` compresses (256 KiB, one thread), and what
  ``segment.zstd_shortens`` concludes with each target's measured rate.
- ``zstd``: the record compressed as ``compression="zstd"`` does (``ZSTD_THREADS`` workers), and
  its ratio: what zstd would cost where it is chosen.
- ``hash``: XXH3-128 of the stored bytes (``SegmentEncoder.checksum``, no copy).
- ``spool``: ``Spool.append`` of the stored bytes on the target, ``write_batch`` records a file.

End to end, with default options:

- ``openseg``: ``OpenSegment.add`` of the narrowed records into a spool beside a local run root on
  the target, ``write_batch`` (8) records a segment, ``compression="auto"``: the writer thread's
  part after ``prepare_record`` (encode, hash beside the write, append);
- ``writer``: a ``BackgroundWriter`` with ``CheckpointOptions()`` writing the float32 records to a
  run root on the target (narrowing on the CPU, the node-local tier's journal, segments committed
  with ``fsync`` in the commit thread, cut at ``write_batch`` records or ``options.SEGMENT_BYTES``:
  one record a segment at 124M), from the first ``put_record`` until ``flush`` returns.

Raw, measured in the same run on the same target: the same stored bytes written to new files,
``write_batch`` records a file, from one thread (one ``writev`` per record) and from
``spoolwrite.WRITERS`` threads (``pwrite`` of 16 MiB pieces), without and with an ``fsync`` at the
end of each file. Like the ``spool`` and ``openseg`` runs, each file is removed once written
(outside the clock). The page cache is flushed (``os.sync``) before every timed run. Raw, ``openseg``
and ``writer`` runs are interleaved over ``--rounds`` rounds; each figure is the median.

    python bench/pipeline.py [--records 8] [--rounds 3] [--tokens 64]
                             [--targets shm=/dev/shm,disk=/var/tmp] [--out JSON] [--quick]

Writes ``bench/results/pipeline.json`` (``pipeline-quick.json`` with ``--quick``) and prints a
Markdown report.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

import torch
import zstandard
from provenance import header

from diffckpt import CheckpointOptions
from diffckpt.capture import group_hyperparams
from diffckpt.narrowing import is_split, narrowed
from diffckpt.openseg import OpenSegment
from diffckpt.options import DEFAULT_WRITE_BATCH, SEGMENT_BYTES, segment_records
from diffckpt.runstore import RunStore
from diffckpt.segment import ZSTD_THREADS, SegmentEncoder, zstd_shortens
from diffckpt.storage import FsspecStorage, Spool
from diffckpt.storage.spoolwrite import PARALLEL_MIN, WRITERS, target_of
from diffckpt.tree import pack_parts
from diffckpt.units import format_bytes
from diffckpt.writer import BackgroundWriter

MB = 1e6
SAMPLE = 1 << 18
PIECE = 16 << 20
TARGET_RATIO = 0.8


# ------------------------------------------------------------------------------- the records
def gradients(tokens: int, size: str) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """Every parameter's gradient after one backward under bf16 autocast, and AdamW's groups."""
    from gpu_scale import SIZES
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, dim, heads, vocab, ctx = SIZES[size]
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab, n_positions=ctx,
                     bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    ids = torch.randint(0, vocab, (1, min(tokens, ctx)), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return grads, group_hyperparams(opt)


def record(step: int, grads: list[torch.Tensor], groups: list[dict[str, Any]]) -> dict[str, Any]:
    """A step record as ``Recorder.record_step`` hands it over (restorable: a small state)."""
    return {"step": step, "prev": step - 1, "events": [{"optimizer": 0, "groups": groups, "grads": [list(grads)]}],
            "param_groups": [groups], "buffers": {}, "state": {"step": step}}


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def timed(fn: Any, *args: Any) -> tuple[float, Any]:
    """Seconds ``fn(*args)`` took, and what it returned."""
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def settle() -> None:
    """Write back what earlier runs left dirty, so that each timed run starts alike."""
    os.sync()


# ------------------------------------------------------------------------------- raw writes
def raw_files(folder: str, blobs: list[list[Any]], batch: int, threads: int, fsync: bool) -> float:
    """Seconds to write ``blobs`` (each a record's parts) to new files, ``batch`` a file, from one
    thread (``writev``) or from ``threads`` (``pwrite`` of 16 MiB pieces). Each file is removed once
    written (outside the clock), as the ``spool`` and ``openseg`` runs remove each spool: the page
    cache holds as much dirty data in all of them."""
    views = [[memoryview(p).cast("B") for p in parts] for parts in blobs]
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    elapsed = 0.0
    for first in range(0, len(views), batch):
        path = os.path.join(folder, f"raw-{first}.bin")
        start = time.perf_counter()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        offset = 0
        for parts in views[first : first + batch]:
            offset += write_serial(fd, parts) if pool is None else write_pieces(fd, parts, offset, pool)
        if fsync:
            os.fsync(fd)
        os.close(fd)
        elapsed += time.perf_counter() - start
        os.unlink(path)
    if pool is not None:
        pool.shutdown()
    return elapsed


def write_serial(fd: int, parts: list[memoryview]) -> int:
    total = sum(p.nbytes for p in parts)
    done = 0
    while done < total:  # writev may write less than asked: go on from where it stopped
        skip, rest = done, []
        for p in parts:
            if skip >= p.nbytes:
                skip -= p.nbytes
                continue
            rest.append(p[skip:])
            skip = 0
        done += os.writev(fd, rest[:1024])
    return total


def write_pieces(fd: int, parts: list[memoryview], offset: int, pool: ThreadPoolExecutor) -> int:
    """Each part cut into pieces of at most 16 MiB, each piece ``pwrite`` at its offset by the pool."""
    jobs = []
    for p in parts:
        for start in range(0, p.nbytes, PIECE):
            jobs.append((p[start : start + PIECE], offset + start))
        offset += p.nbytes

    def piece(job: tuple[memoryview, int]) -> int:
        view, at = job
        done = 0
        while done < view.nbytes:
            done += os.pwrite(fd, view[done:], at + done)
        return done

    return sum(pool.map(piece, jobs))


# ------------------------------------------------------------------------------- the stages
def stage_figures(grads: list[torch.Tensor], narrow: list[torch.Tensor], groups: list[dict[str, Any]],
                  records: int, quick: bool) -> dict[str, Any]:
    """What each in-memory stage takes per record (seconds), on the same records."""
    out: dict[str, Any] = {"narrow": [], "pack": [], "hash": [], "zstd": [], "sample": []}
    for step in range(1, records + 1):
        out["narrow"].append(timed(lambda: [narrowed(g) for g in grads])[0])
        seconds, parts = timed(pack_parts, record(step, narrow, groups))
        out["pack"].append(seconds)
        blob = SegmentEncoder({"gen": 1, "after": 0}, "none", 1).encode(record(step, narrow, groups))
        out["hash"].append(timed(SegmentEncoder.checksum, blob)[0])
        largest = memoryview(max(parts, key=len)).cast("B")
        begin = max(0, largest.nbytes // 2 - SAMPLE // 2)
        sample = largest[begin : begin + SAMPLE]
        seconds, packed = timed(zstandard.ZstdCompressor(level=1).compress, sample)
        out["sample"].append((seconds, len(packed)))
    for step in range(1, (1 if quick else min(3, records)) + 1):
        encoder = SegmentEncoder({"gen": 1, "after": 0}, "zstd", 1)
        seconds, blob = timed(encoder.encode, record(step, narrow, groups))
        out["zstd"].append((seconds - statistics.median(out["pack"]), blob.raw_length / blob.length))
    return out


def spool_appends(folder: str, blobs: list[list[Any]], batch: int) -> list[float]:
    """Seconds of each ``Spool.append`` of a record's parts, ``batch`` records a spool."""
    seconds = []
    for first in range(0, len(blobs), batch):
        spool = Spool(os.path.join(folder, f"spool-{first}.tmp"))
        for parts in blobs[first : first + batch]:
            seconds.append(timed(spool.append, parts)[0])
        spool.discard()
    return seconds


def openseg_run(folder: str, recs: list[dict[str, Any]], batch: int) -> tuple[float, str, int]:
    """Seconds of ``OpenSegment.add`` of every record (segments of ``batch``), the compression
    decided, and the bytes stored."""
    storage = FsspecStorage(folder)
    elapsed, stored, decided = 0.0, 0, "?"
    for first in range(0, len(recs), batch):
        segment = OpenSegment(storage, 1, first, "auto", 1)
        try:
            for rec in recs[first : first + batch]:
                elapsed += timed(segment.add, rec)[0]
            decided = segment.encoder.compression or "?"
            stored += segment.spool.size
        finally:
            segment.discard()
    return elapsed, decided, stored


def writer_run(folder: str, grads: list[torch.Tensor], groups: list[dict[str, Any]], records: int) -> float:
    """Seconds for a ``BackgroundWriter`` with default options to take and commit ``records``
    float32 records (put until ``flush`` returns)."""
    root = os.path.join(folder, "run")
    # "writer is behind": the point here, since the bench hands records over as fast as it can
    logging.getLogger("diffckpt").setLevel(logging.ERROR)
    writer = BackgroundWriter(RunStore(FsspecStorage(root)), 1, CheckpointOptions(), after=0)
    try:
        start = time.perf_counter()
        for step in range(1, records + 1):
            rec = record(step, grads, groups)
            writer.put_record(rec, nbytes(grads))
        writer.flush()
        return time.perf_counter() - start
    finally:
        writer.close()
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------- the report
def rate(size: float, seconds: float) -> float:
    return size / seconds / MB if seconds > 0 else float("inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=16, help="records per run (write_batch 8 a segment)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="sequence length of the one backward")
    ap.add_argument("--size", default="124m", help="bench/gpu_scale.py's model sizes (tiny: a smoke run)")
    ap.add_argument("--targets", default="shm=/dev/shm,disk=/var/tmp", help="name=folder,...")
    ap.add_argument("--skip-writer", action="store_true", help="leave the BackgroundWriter runs out")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 records, 1 round")
    ap.add_argument("--out", help="JSON path (default bench/results/pipeline.json)")
    args = ap.parse_args()
    if args.quick:
        args.records, args.rounds = 2, 1
    began = time.perf_counter()
    targets = dict(item.split("=", 1) for item in args.targets.split(","))
    batch = DEFAULT_WRITE_BATCH
    grads, groups = gradients(args.tokens, args.size)
    narrow = [narrowed(g) for g in grads]
    fp32_bytes = nbytes(grads)
    kept = [g for g, n in zip(grads, narrow) if n is g]
    split = [g for g, n in zip(grads, narrow) if is_split(n)]
    recs = [record(step, narrow, groups) for step in range(1, args.records + 1)]
    blobs = [SegmentEncoder({"gen": 1, "after": 0}, "none", 1).encode(r).stored for r in recs]
    stored = sum(len(p) for p in blobs[0])
    info = [*header(f"zstandard {zstandard.__version__}, xxhash {__import__('xxhash').VERSION}"),
            f"- model: GPT-2 {args.size} shapes, {sum(g.numel() for g in grads) / 1e6:.1f}M parameters; "
            f"one backward under bf16 autocast at 1 x {args.tokens} tokens",
            f"- a record: {format_bytes(fp32_bytes)} of float32 gradients, {format_bytes(stored)} stored "
            f"({len(grads) - len(kept)} of {len(grads)} gradients narrowed to bfloat16, {len(split)} of them row-split "
            f"({format_bytes(nbytes(split))} of float32); float32 kept: "
            f"{format_bytes(nbytes(kept))} in {len(kept)} tensors, the largest {max(kept, key=torch.Tensor.numel).numel() / 1e6:.1f}M)"
            if kept else f"- a record: {format_bytes(stored)} stored, every gradient narrowed",
            f"- {args.records} records a run, {batch} a segment (raw files, spools, `OpenSegment`), "
            f"{segment_records(batch, stored)} a segment in the writer (cut at {format_bytes(SEGMENT_BYTES)}); "
            f"{args.rounds} round(s); zstd workers "
            f"{ZSTD_THREADS}, parallel spool writers {WRITERS}"]
    print("\n".join(info), flush=True)

    stages = stage_figures(grads, narrow, groups, args.records, args.quick)
    sample_s = statistics.median(s for s, _ in stages["sample"])
    sample_packed = statistics.median(n for _, n in stages["sample"])
    figures: dict[str, Any] = {
        "record_bytes": stored, "fp32_bytes": fp32_bytes, "cores": os.cpu_count(), "zstd_threads": ZSTD_THREADS,
        "writers": WRITERS,
        "stages": {
            "narrow": rate(fp32_bytes, statistics.median(stages["narrow"])),
            "pack": rate(stored, statistics.median(stages["pack"])),
            "sample": rate(SAMPLE, sample_s), "sample_ratio": SAMPLE / sample_packed,
            "zstd": rate(stored, statistics.median(s for s, _ in stages["zstd"])),
            "zstd_ratio": statistics.median(r for _, r in stages["zstd"]),
            "hash": rate(stored, statistics.median(stages["hash"])),
        },
        "targets": {},
    }
    runs = ["raw1", f"raw{WRITERS}", "raw1+fsync", f"raw{WRITERS}+fsync", "spool", "openseg",
            *([] if args.skip_writer else ["writer"])]
    for name, parent in targets.items():
        folder = tempfile.mkdtemp(prefix="bench-pipeline-", dir=parent)
        seconds: dict[str, list[float]] = {run: [] for run in runs}
        decided = set()
        try:
            for rnd in range(args.rounds):
                order = runs if rnd % 2 == 0 else runs[::-1]
                for run in order:
                    settle()
                    if run.startswith("raw"):
                        threads = int(run[3:].split("+")[0])
                        seconds[run].append(raw_files(folder, blobs, batch, threads, run.endswith("fsync")))
                    elif run == "spool":
                        seconds[run].append(sum(spool_appends(folder, blobs, batch)))
                    elif run == "openseg":
                        elapsed, how, _ = openseg_run(folder, recs, batch)
                        seconds[run].append(elapsed)
                        decided.add(how)
                    else:
                        seconds[run].append(writer_run(folder, grads, groups, args.records))
                print(f"{name} round {rnd + 1}: " + ", ".join(f"{k} {rate(stored * args.records, v[-1]):,.0f} MB/s"
                                                             for k, v in seconds.items()), flush=True)
            fd = os.open(folder, os.O_RDONLY)  # the spools' file system: which way large appends took in the end
            way = target_of(fd).workers(PARALLEL_MIN)
            os.close(fd)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        total = stored * args.records
        rates = {run: rate(total, statistics.median(v)) for run, v in seconds.items()}
        rates["raw"] = max(rates["raw1"], rates[f"raw{WRITERS}"])
        rates["raw+fsync"] = max(rates["raw1+fsync"], rates[f"raw{WRITERS}+fsync"])
        figures["targets"][name] = {
            "folder": parent, "rates": rates, "decided": sorted(decided), "spool_writers": way,
            "zstd_would_shorten": zstd_shortens(SAMPLE, int(sample_packed), sample_s, rates["spool"] * MB),
        }
    lines = report(figures, info, args)
    lines.append(f"- bench wall time {(time.perf_counter() - began) / 60:.1f} min")
    print("\n".join(lines))
    out = args.out or os.path.join(ROOT, "bench", "results", "pipeline-quick.json" if args.quick else "pipeline.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"args": vars(args), "info": info, "figures": figures, "report": lines}, f, indent=1)
    print(f"written: {out}")


def records_ratio(figures: dict[str, Any], rates: dict[str, float]) -> float:
    """The ``BackgroundWriter``'s records a second against those the target takes of the float32
    records as handed over, written raw with ``fsync``: whether narrowing and the rest of the
    pipeline cost more time than the bytes they save (the stored-bytes ratio above counts the
    narrowing against the writer, and not the bytes it saved)."""
    return (rates["writer"] / figures["record_bytes"]) / (rates["raw+fsync"] / figures["fp32_bytes"])


def report(figures: dict[str, Any], info: list[str], args: argparse.Namespace) -> list[str]:
    st = figures["stages"]
    lines = ["", "# The writer pipeline", "", *info, "",
             "| stage (one thread unless said) | MB/s |", "|---|---:|",
             f"| narrow on the CPU (float32 read) | {st['narrow']:,.0f} |",
             f"| pack (`pack_parts`) | {st['pack']:,.0f} |",
             f"| auto's sample, zstd level 1 (ratio {st['sample_ratio']:.2f}) | {st['sample']:,.0f} |",
             f"| zstd level 1, {figures['zstd_threads']} workers (ratio {st['zstd_ratio']:.2f}) | {st['zstd']:,.0f} |",
             f"| XXH3-128 of the record | {st['hash']:,.0f} |", ""]
    names = list(figures["targets"])
    rows = ["raw1", f"raw{figures['writers']}", "raw1+fsync", f"raw{figures['writers']}+fsync", "spool", "openseg",
            *([] if args.skip_writer else ["writer"])]
    label = {"raw1": "raw, 1 thread (writev)", f"raw{figures['writers']}": f"raw, {figures['writers']} threads (pwrite)",
             "raw1+fsync": "raw, 1 thread, fsync each file",
             f"raw{figures['writers']}+fsync": f"raw, {figures['writers']} threads, fsync each file",
             "spool": "`Spool.append`", "openseg": "**end to end: `OpenSegment.add`**",
             "writer": "**end to end: `BackgroundWriter`** (narrowing, journal, commit with fsync)"}
    lines += ["| MB/s | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for row in rows:
        lines.append(f"| {label[row]} | " + " | ".join(f"{figures['targets'][n]['rates'][row]:,.0f}" for n in names) + " |")
    lines.append("")
    for n in names:
        t = figures["targets"][n]
        r = t["rates"]
        lines.append(f"- {n} ({t['folder']}): `OpenSegment.add` at {r['openseg'] / r['raw']:.0%} of raw "
                     f"({r['openseg']:,.0f} of {r['raw']:,.0f} MB/s; target {TARGET_RATIO:.0%}: "
                     f"{'pass' if r['openseg'] >= TARGET_RATIO * r['raw'] else 'miss'})"
                     + (f", `BackgroundWriter` at {r['writer'] / r['raw+fsync']:.0%} of raw with fsync "
                        f"(records a second: {records_ratio(figures, r):.0%} of the float32 records written raw "
                        "with fsync)" if "writer" in r else "")
                     + f"; auto chose {'/'.join(t['decided'])} (zstd would shorten the write: {t['zstd_would_shorten']}); "
                     f"large appends settled on {t['spool_writers']} thread(s)")
    return lines


if __name__ == "__main__":
    main()
