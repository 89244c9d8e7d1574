"""Expected loss of the auto-tuner's settings against fixed ones, from measured costs.

A plain PyTorch loop (the GPT of ``examples/gpt.py``, AdamW + OneCycleLR + gradient clipping, one
torch thread so that a core is left for the writer) drives the core ``CheckpointEngine`` as an
adapter does: ``start`` and the starting base at step 0, then after every ``optimizer.step()``
``review`` when ``review_due``, ``record_step`` (with the small state when ``wants_state``) and
``write_base`` when ``wants_base``; ``close()`` at the end. Configurations, each run from the same
seed into a fresh run root that is deleted afterwards:

- ``none``: the same loop without an engine, the baseline (before each round and after the last:
  each round is bracketed by two);
- fixed: ``every_n_steps`` in (1, 10, 100) x ``write_batch`` in (1, 16), ``base_every_n_steps``
  = the run length (``--steps``, so each run writes exactly one periodic base, at its last step,
  and the base cost in the measured overhead is the amortized cost of that interval);
- ``auto (mtbf X)``: all three knobs ``"auto"``, ``TuningOptions(mtbf_s=X)`` for a few MTBFs.

Measured per run (nothing below comes from the cost model):

- overhead, three ways, over the timed steps (after ``--warmup``): (1) training-thread CPU
  seconds (``time.thread_time``) plus seconds stalled on a full writer queue, against the
  training-thread CPU seconds of the baseline (the mean of the two ``none`` runs around the
  round); on a shared machine wall time mostly measures other people's load, CPU time much less.
  (2) Wall seconds against the baseline's, for reference (the end-of-run flush, ``close()``,
  apart). (3) The direct cost: the training thread's CPU seconds inside engine calls, plus the
  gradient copies in the optimizer's step hook and the stalls; it needs no baseline, so it has
  no run-to-run noise, but misses the writer thread's interference with training, so the true
  overhead is at least this. J uses max((1), (3)) per run. Median over the rounds, [min..max].
- durability lag: a storage wrapper notes when each segment (and base COMMIT) write returns; the
  lag of a durable step is that time minus the end of its optimizer step; mean over the durable
  steps of the run (for auto runs, those after the tuner's last change).
- bytes per step: diff-segment bytes written / steps (bases listed apart).
- recovery: after the run, a fresh model and optimizer are restored with
  ``CheckpointEngine(root).restore``: to the newest base (the base load time), to the durable
  step farthest from the base before it, and to that base; replay per step = (the step's time -
  its base's) / replayed steps. Every round; the least over the rounds.

Expected loss per unit of training time, for each MTBF (the issue's formula, measured inputs):
``J = overhead + (E[lost] + E[recovery]) / MTBF`` with ``E[lost] = segment_steps x step time / 2
+ lag`` (step time with checkpointing) and ``E[recovery] = base load + replay per step x
(base interval - segment_steps) / 2``.
Auto rows, one per run, use the settings the tuner ended with; the tuner's own cost model
(``expected_loss``) is also evaluated on each auto run's last measurements, for comparison. The
plot ``docs/tuning-loss.png`` draws J against the MTBF for the fixed settings, and the auto runs at
the MTBF they were tuned for; left with the overhead of J, right with the direct one.

    python bench/autotune.py [--threads 1] [--steps 200] [--rounds 2] [--quick]
                             [--backend local|slow --latency 0.05]

``--backend slow``: ``memory://`` behind a wrapper that sleeps ``--latency`` s per request (a
slow object store; fault injection for the bench only). Writes ``bench/results/autotune.md``
(``autotune-quick.md`` with --quick, ``autotune-slow.md`` with ``--backend slow``) and the plot
``docs/tuning-loss.png`` (only for a full local run; ``--plot PATH`` otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import math
import os
import re
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

from diffckpt import CheckpointEngine, CheckpointOptions, FsspecStorage, TuningOptions
from diffckpt.format import SegmentName
from diffckpt.tuning.model import Settings, describe

FIXED = [(n, b) for n in (1, 10, 100) for b in (1, 16)]
MTBFS = {"30 min": 1800.0, "6 h": 6 * 3600.0, "1 week": 7 * 24 * 3600.0}
BASE_COMMIT = re.compile(r"bases/(\d+)\.g\d+/COMMIT$")
BASE_STATE = re.compile(r"bases/(\d+)\.g\d+/state\.safetensors$")


class ProbeStorage:
    """A :class:`diffckpt.storage.Storage` around another one that notes when each step becomes
    durable (a segment write or a base's COMMIT returned) and the bytes written, and optionally
    sleeps ``latency`` seconds per request (a slow object store)."""

    def __init__(self, inner: Any, latency: float = 0.0) -> None:
        self.inner = inner
        self.url = inner.url
        self.latency = latency
        self._lock = threading.Lock()
        self.durable_at: dict[int, float] = {}
        self.bytes = {"diffs": 0, "bases": 0, "other": 0}
        self.base_sizes: dict[int, int] = {}

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _wait(self) -> None:
        if self.latency:
            time.sleep(self.latency)

    def write(self, path: str, data: Any) -> None:
        parts = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
        nbytes = sum(memoryview(p).nbytes for p in parts)
        self._wait()
        self.inner.write(path, data)
        done = time.perf_counter()
        kind = path.split("/", 1)[0] if path.startswith(("diffs/", "bases/")) else "other"
        seg = SegmentName.parse(path)
        base = BASE_COMMIT.match(path)
        state = BASE_STATE.match(path)
        with self._lock:
            self.bytes[kind] += nbytes
            if state:
                self.base_sizes[int(state[1])] = nbytes
            for step in ([seg.last] if seg else []) + ([int(base[1])] if base else []):
                self.durable_at.setdefault(step, done)

    def create(self, path: str, data: bytes) -> bool:
        self._wait()
        return self.inner.create(path, data)  # type: ignore[no-any-return]

    def read(self, path: str) -> bytes:
        self._wait()
        return self.inner.read(path)  # type: ignore[no-any-return]

    def list(self, prefix: str) -> dict[str, int]:
        self._wait()
        return self.inner.list(prefix)  # type: ignore[no-any-return]

    def delete(self, path: str) -> None:
        self.inner.delete(path)

    def exists(self, path: str) -> bool:
        self._wait()
        return self.inner.exists(path)  # type: ignore[no-any-return]


def batches(size: str):
    loader = make_loader(size)
    while True:
        yield from loader


def state_of(step: int, sched: Any) -> dict[str, Any]:
    """The small framework state of a restorable step: counter, scheduler, torch RNG."""
    return {"step": step, "scheduler": sched.state_dict(), "rng": torch.get_rng_state()}


def new_model(args: argparse.Namespace, steps: int) -> tuple[Any, Any, Any]:
    model = GPT(args.size, total_steps=steps)
    conf = model.configure_optimizers()
    return model, conf["optimizer"], conf["lr_scheduler"]["scheduler"]


def name_of(config: tuple) -> str:
    if config[0] == "none":
        return "none"
    if config[0] == "fixed":
        return f"every {config[1]}, batch {config[2]}"
    return f"auto (mtbf {config[1]})"


def options_for(config: tuple, base_every: int) -> CheckpointOptions:
    if config[0] == "fixed":
        return CheckpointOptions(every_n_steps=config[1], write_batch=config[2],
                                 base_every_n_steps=base_every)
    return CheckpointOptions(every_n_steps="auto", write_batch="auto", base_every_n_steps="auto",
                             tuning=TuningOptions(mtbf_s=MTBFS[config[1]]))


def open_root(args: argparse.Namespace) -> tuple[Any, Any]:
    """A fresh run root: (inner storage, cleanup function)."""
    if args.backend == "local":
        workdir = tempfile.mkdtemp(prefix="bench-autotune-", dir=args.tmp)
        return FsspecStorage(workdir), lambda: shutil.rmtree(workdir, ignore_errors=True)
    inner = FsspecStorage(f"memory://autotune-{uuid.uuid4().hex[:12]}")

    def cleanup() -> None:
        with contextlib.suppress(Exception):
            inner.fs.rm(inner.root, recursive=True)

    return inner, cleanup


def run_once(config: tuple, args: argparse.Namespace, steps: int, warmup: int,
             restore: bool = False) -> dict[str, Any]:
    """Train ``steps`` steps under ``config``; see the module docstring for what is measured."""
    torch.manual_seed(0)
    model, opt, sched = new_model(args, steps)
    data = batches(args.size)
    engine = storage = writer = None
    cleanup = None
    if config[0] != "none":
        inner, cleanup = open_root(args)
        storage = ProbeStorage(inner, args.latency if args.backend == "slow" else 0.0)
        engine = CheckpointEngine(storage, options_for(config, args.base_every))
        engine.start(model, [opt], 0)
        writer = engine.recorder.writer  # its stats stay readable after close()
        engine.write_base(0, model.state_dict(), [opt.state_dict()], state_of(0, sched))
    step_end: dict[int, float] = {}
    in_engine = in_review = hooks = 0.0
    reviews = 0
    try:
        t0 = cpu0 = None
        for step in range(1, steps + 1):
            if step == warmup + 1:
                t0, cpu0 = time.perf_counter(), time.thread_time()
                in_engine = in_review = hooks = 0.0
                reviews = 0
            batch = next(data)
            plain_step(model, opt, sched, batch)
            if engine is None:
                continue
            step_end[step], cpu_in = time.perf_counter(), time.thread_time()
            assert engine.recorder.capture is not None
            hooks += engine.recorder.capture.copy_s  # gradient copies in the optimizer's step hook
            if engine.recorder.review_due(step):
                engine.recorder.review(step)
                in_review += time.thread_time() - cpu_in
                reviews += 1
            wants_base = engine.wants_base(step)
            with engine.recorder.measuring_state():
                state = state_of(step, sched) if wants_base or engine.wants_state(step) else None
            engine.record_step(step, state)
            if wants_base:
                engine.write_base(step, model.state_dict(), [opt.state_dict()], state)
            in_engine += time.thread_time() - cpu_in
        t_loop, cpu_loop = time.perf_counter(), time.thread_time()
        if engine is not None:
            engine.close()
        t_end = time.perf_counter()
        assert t0 is not None and cpu0 is not None
        out: dict[str, Any] = {"wall": t_loop - t0, "cpu": cpu_loop - cpu0, "tail": t_end - t_loop,
                               "in_engine": in_engine + hooks, "stall": 0.0,
                               "in_review": in_review, "reviews": reviews}
        if engine is None or storage is None or writer is None:
            return out
        changed = max([d["step"] for d in engine.recorder.tuning.decisions], default=0)
        lags = [t - step_end[s] for s, t in sorted(storage.durable_at.items())
                if s in step_end and s > max(warmup, changed)]
        meter = engine.recorder.tuning.meter
        out.update(
            stall=writer.stats.stall_seconds, settings=engine.settings,
            decisions=list(engine.recorder.tuning.decisions), last_review=engine.recorder.tuning.last_review,
            update_s=None if meter is None else meter.update_s.get(),
            lags=lags, durable_steps=sorted(storage.durable_at), bytes=dict(storage.bytes),
            base_sizes=dict(storage.base_sizes),
        )
        if restore:
            out.update(time_restore(args, steps, storage, sorted(storage.durable_at)))
        return out
    finally:
        if engine is not None and engine.recorder.writer is not None:
            with contextlib.suppress(Exception):
                engine.close()
        if cleanup is not None:
            cleanup()
        del model, opt, sched, engine, storage, writer
        gc.collect()


def time_restore(args: argparse.Namespace, steps: int, storage: ProbeStorage,
                 durable: list[int]) -> dict[str, Any]:
    """Restore into a fresh model and optimizer, timing each: the newest base (the base load
    time; a periodic base holds the optimizer moments, the starting one does not), the durable
    step farthest from the base before it (the most replay) and that base; replay per step is
    the difference of the last two / the steps replayed."""
    bases = sorted(storage.base_sizes)
    since = {s: s - max(b for b in bases if b <= s) for s in durable}
    target = max(durable, key=lambda s: (since[s], s))
    times: dict[int, float] = {}
    replayed = 0
    for step in dict.fromkeys([bases[-1], target - since[target], target]):
        model, opt, _ = new_model(args, steps)
        start = time.perf_counter()
        result = CheckpointEngine(storage).restore(model, [opt], step=step)
        times[step] = time.perf_counter() - start
        if step == target:
            replayed = result.replayed
        del model, opt
    replay = (times[target] - times[target - since[target]]) / replayed if replayed else None
    return {"base_load_s": times[bases[-1]], "base_step": bases[-1], "restore_s": times[target],
            "restore_step": target, "replayed": replayed, "replay_step_s": replay}


# ------------------------------------------------------------------------------ analysis
def summarize(results: dict[tuple, list[dict[str, Any]]], args: argparse.Namespace,
              timed: int) -> tuple[float, list[dict[str, Any]]]:
    """Rows of the table: one per fixed configuration (pooled over rounds), one per auto run
    (its settings may differ by round). Returns (baseline s/step, rows)."""
    none = results[("none",)]
    rounds = len(none) - 1  # none[i] and none[i + 1] bracket round i
    base_wall = [(none[i]["wall"] + none[i + 1]["wall"]) / 2 for i in range(rounds)]
    base_cpu = [(none[i]["cpu"] + none[i + 1]["cpu"]) / 2 for i in range(rounds)]
    t_base = statistics.median(r["wall"] for r in none) / timed
    t_cpu = statistics.median(r["cpu"] for r in none) / timed
    replays = [r["replay_step_s"] for c, runs in results.items() if c[0] == "fixed"
               for r in runs if r.get("replay_step_s")]
    fallback_replay = statistics.median(replays) if replays else None
    rows = []
    for config, runs in results.items():
        if config[0] == "none":
            continue
        for i, r in enumerate(runs):
            r["ovh_wall"] = r["wall"] / base_wall[i] - 1
            r["ovh_cpu"] = (r["cpu"] + r["stall"]) / base_cpu[i] - 1
            r["direct"] = (r["in_engine"] + r["stall"]) / timed / t_cpu
        groups = [list(enumerate(runs))] if config[0] == "fixed" else [[x] for x in enumerate(runs)]
        for group in groups:
            rs = [r for _, r in group]
            restored = [r for r in rs if "base_load_s" in r]
            base_load = min(r["base_load_s"] for r in restored)
            measured = [r["replay_step_s"] for r in restored if r["replay_step_s"] is not None]
            s: Settings = rs[0]["settings"]
            base_every = s.base_every_n_steps if s.base_every_n_steps is not None else timed
            k = s.segment_steps
            # The direct cost is a floor: a paired estimate below it is run-to-run noise.
            overhead = statistics.median(max(r["ovh_cpu"], r["direct"]) for r in rs)
            lags = [x for r in rs for x in r["lags"]]
            lag = statistics.mean(lags) if lags else None
            replay, replay_note = (min(measured), "") if measured else (None, "")
            if replay is None:
                replay, replay_note = fallback_replay, "*"
            step_s = t_base * (1 + max(overhead, 0.0))
            lost = k * step_s / 2 + (lag or 0.0)
            recovery = base_load + (replay or 0.0) * max(0, base_every - k) / 2
            direct = statistics.median(r["direct"] for r in rs)
            label = name_of(config) + ("" if config[0] == "fixed" else f", round {group[0][0] + 1}")
            rows.append({
                "config": config, "label": label, "runs": rs, "settings": s, "k": k,
                "base_every": base_every, "overhead": overhead,
                "cpu": [r["ovh_cpu"] for r in rs], "wall": [r["ovh_wall"] for r in rs],
                "direct": direct,
                "tail": statistics.median(r["tail"] for r in rs),
                "diff_bytes": statistics.median(r["bytes"]["diffs"] for r in rs) / args.steps,
                "lag": lag, "base_load_s": base_load, "replay_step_s": replay,
                "replay_note": replay_note, "lost": lost, "recovery": recovery,
                "J": {m: j_curve(overhead, lost, recovery, v) for m, v in MTBFS.items()},
                "J_direct": {m: j_curve(direct, lost, recovery, v) for m, v in MTBFS.items()},
            })
    return t_base, rows


def j_curve(overhead: float, lost: float, recovery: float, mtbf: float) -> float:
    return max(overhead, 0.0) + (lost + recovery) / mtbf


def pct(x: float) -> str:
    return f"{100 * x:.2f}%" if abs(x) < 10 else f"{100 * x:.0f}%"


def spread(xs: list[float]) -> str:
    med = statistics.median(xs)
    return pct(med) if len(xs) == 1 else f"{pct(med)} [{pct(min(xs))}..{pct(max(xs))}]"


def render(rows: list[dict[str, Any]], results: dict[tuple, list[dict[str, Any]]],
           t_base: float) -> list[str]:
    mt = list(MTBFS)
    best = {m: min(range(len(rows)), key=lambda i: rows[i]["J"][m]) for m in mt}
    lines = [
        "| configuration | settings (every, batch, base) | segment steps "
        "| overhead (CPU) | overhead (wall) | direct overhead | overhead in J | diff bytes/step "
        "| lag s | close s | base load s | replay ms/step | E[lost] s | E[recovery] s | "
        + " | ".join(f"J @ MTBF {m}" for m in mt) + " |",
        "|---|---|" + "---:|" * (12 + len(mt)),
    ]
    for i, row in enumerate(rows):
        s = row["settings"]
        cells = [
            row["label"],
            f"{s.every_n_steps}, {s.write_batch}, {s.base_every_n_steps}",
            str(row["k"]),
            spread(row["cpu"]),
            spread(row["wall"]),
            pct(row["direct"]),
            pct(row["overhead"]),
            f"{row['diff_bytes'] / 1e6:.2f} MB",
            "n/a" if row["lag"] is None else f"{row['lag']:.3f}",
            f"{row['tail']:.2f}",
            f"{row['base_load_s']:.3f}",
            "n/a" if row["replay_step_s"] is None else
            f"{1e3 * row['replay_step_s']:.1f}{row['replay_note']}",
            f"{row['lost']:.2f}",
            f"{row['recovery']:.2f}",
        ]
        for m in mt:
            cell = pct(row["J"][m])
            cells.append(f"**{cell}**" if best[m] == i else cell)
        lines.append("| " + " | ".join(cells) + " |")
    best_d = {m: min(range(len(rows)), key=lambda i: rows[i]["J_direct"][m]) for m in mt}
    lines += ["", "The same J with the direct overhead (training-thread CPU inside engine calls, "
              "gradient copies and stalls; no baseline, so no run-to-run noise, but without the "
              "writer thread's interference with training):", "",
              "| configuration | direct overhead | " + " | ".join(f"J @ MTBF {m}" for m in mt)
              + " |", "|---|---:|" + "---:|" * len(mt)]
    for i, row in enumerate(rows):
        cells = [row["label"], pct(row["direct"])]
        cells += [f"**{pct(row['J_direct'][m])}**" if best_d[m] == i else pct(row["J_direct"][m])
                  for m in mt]
        lines.append("| " + " | ".join(cells) + " |")
    fixed = [r for r in rows if r["config"][0] == "fixed"]
    lines += ["", "Auto against the best fixed setting, per MTBF (J with the CPU overhead; "
              "in brackets with the direct overhead):", ""]
    for m in mt:
        bf = min(fixed, key=lambda r: r["J"][m])
        autos = [r for r in rows if r["config"] == ("auto", m)]
        parts = []
        bd = min(fixed, key=lambda r: r["J_direct"][m])
        for a in autos:
            ja, jb = a["J"][m], bf["J"][m]
            da, db = a["J_direct"][m], bd["J_direct"][m]
            parts.append(f"{a['label'].split(', ')[-1]}: {pct(ja)} ({ja - jb:+.2%} absolute) "
                         f"[{pct(da)}, {da - db:+.2%} absolute, {da / db:.2f}x]")
        lines.append(f"- MTBF {m}: best fixed is {bf['label']} with {pct(bf['J'][m])} "
                     f"[{bd['label']} with {pct(bd['J_direct'][m])}]; auto " + "; ".join(parts))
    lines += ["", "What the tuner chose, every decision, and the measurements behind its last "
              "review (`engine.recorder.tuning.last_review`), next to what this bench measured:", ""]
    for config, runs in results.items():
        if config[0] != "auto":
            continue
        lines.append(f"- **{name_of(config)}**")
        for i, r in enumerate(runs):
            s = r["settings"]
            ds = "; ".join(f"step {d['step']}: ({d['settings']['every_n_steps']}, "
                           f"{d['settings']['write_batch']}, {d['settings']['base_every_n_steps']})"
                           f" {d['reason']}, predicted loss {pct(d['expected_loss'])}"
                           for d in r["decisions"])
            lines.append(f"  - round {i + 1}: ended with every_n_steps {s.every_n_steps}, "
                         f"write_batch {s.write_batch}, base_every_n_steps "
                         f"{s.base_every_n_steps}. Decisions: {ds}")
            if r["last_review"] is None:
                continue
            dec, m = r["last_review"]
            e = dec.estimate
            lines.append(f"    - last review: {dec.reason}; predicted overhead {pct(e.overhead)}, "
                         f"lost {e.lost_work_s:.2f} s, recovery {e.recovery_s:.2f} s, writer "
                         f"busy {e.writer_utilization:.0%}, loss {pct(e.loss)}")
            lines.append(f"    - engine measured: {describe(m)}; optimizer update "
                         f"{1e3 * (r['update_s'] or 0):.2f} ms")
            lines.append(f"    - reviews in the timed steps: {r['reviews']}, "
                         f"{1e3 * r['in_review']:.0f} ms of training-thread CPU in all "
                         f"({r['in_review'] / max(r['cpu'], 1e-9):.2%} of the run's)")
            rep = r.get("replay_step_s")
            rep_s = "n/a" if rep is None else f"{1e3 * rep:.2f} ms"
            lines.append(f"    - bench measured: step {1e3 * t_base:.1f} ms without checkpointing "
                         f"(baseline median), replay {rep_s}/step, load of the base at step "
                         f"{r['base_step']} {r['base_load_s']:.3f} s, bases written "
                         + ", ".join(f"step {k}: {v / 1e6:.1f} MB"
                                     for k, v in sorted(r["base_sizes"].items())))
    return lines


def model_view(results: dict[tuple, list[dict[str, Any]]], base_every: int) -> list[str]:
    """The tuner's own cost model on the measurements of each auto run's last review: its
    predicted J for the fixed settings, next to its choice."""
    from diffckpt.tuning.model import expected_loss

    mt = [m for m in MTBFS if results.get(("auto", m)) and results[("auto", m)][-1]["last_review"]]
    if not mt:
        return []
    lines = ["", "The tuner's cost model (`expected_loss`) on the last review's measurements of "
             "each auto run (last round), for the fixed settings and for its choice; `!`: a "
             "constraint is violated:", "",
             "| settings | " + " | ".join(f"model J, MTBF {m}" for m in mt) + " |",
             "|---|" + "---:|" * len(mt)]
    cands = [Settings(n, b, base_every) for n, b in FIXED] + ["chosen"]
    for c in cands:
        cells = []
        for m in mt:
            r = results[("auto", m)][-1]
            dec, meas = r["last_review"]
            s = dec.settings if c == "chosen" else c
            e = expected_loss(s, meas, TuningOptions(mtbf_s=MTBFS[m]))
            cells.append(pct(e.loss) + ("!" if e.violations else "")
                         + (f" ({s.every_n_steps}, {s.write_batch}, {s.base_every_n_steps})"
                            if c == "chosen" else ""))
        name = ("tuner's choice" if c == "chosen"
                else f"every {c.every_n_steps}, batch {c.write_batch}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [60 * 1.25**i for i in range(int(math.log(31 * 86400 / 60, 1.25)) + 1)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    panels = (("overhead", "J", "overhead in J: max(CPU vs baseline, direct)"),
              ("direct", "J_direct", "overhead: direct (engine calls + stalls), a floor"))
    for ax, (key, jkey, label) in zip(axes, panels, strict=True):
        for row in rows:
            if row["config"][0] != "fixed":
                continue
            ax.plot([x / 3600 for x in xs],
                    [100 * j_curve(row[key], row["lost"], row["recovery"], x) for x in xs],
                    label=row["label"], lw=1.3)
        autos = [(MTBFS[r["config"][1]], r) for r in rows if r["config"][0] == "auto"]
        if autos:
            ax.plot([m / 3600 for m, _ in autos], [100 * r[jkey][r["config"][1]] for _, r in autos],
                    "k*", ms=11, label="auto runs (at the MTBF they were tuned for)")
        for m in MTBFS.values():
            ax.axvline(m / 3600, color="grey", lw=0.5, ls=":")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("MTBF (hours)")
        ax.set_title(label, fontsize=9)
        ax.grid(True, which="both", lw=0.3, alpha=0.5)
    axes[0].set_ylabel("expected loss J (% of training time)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of every run")
    ap.add_argument("--size", default="demo", choices=sorted(SIZES))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--base-every", type=int, help="base_every_n_steps of the fixed settings "
                    "(default: --steps, one periodic base per run)")
    ap.add_argument("--backend", default="local", choices=("local", "slow"))
    ap.add_argument("--latency", type=float, default=0.05, help="s per request for --backend slow")
    ap.add_argument("--tmp", help="parent of the local temp run dirs (default: system temp dir)")
    ap.add_argument("--out", help="Markdown report path")
    ap.add_argument("--plot", help="plot path (default: docs/tuning-loss.png; none with --quick)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run (~1 min): tiny model, 120 steps, 2 rounds")
    args = ap.parse_args()
    if args.quick:
        args.size, args.steps, args.rounds = "tiny", 120, 2
    if args.base_every is None:
        args.base_every = args.steps
    if args.steps < 100 + args.warmup:
        sys.exit("--steps must reach a restorable step of every 100 (>= 100 + --warmup)")
    suffix = "" if args.backend == "local" else "-slow"
    out = report_path(args.out, "autotune" + suffix, args.quick)
    plot_path = args.plot or (None if args.quick or args.backend != "local" else
                              os.path.join(ROOT, "docs", "tuning-loss.png"))
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("diffckpt").setLevel(logging.ERROR)

    steps, warmup = args.steps, args.warmup
    timed = steps - warmup
    n_params = sum(p.numel() for p in GPT(args.size).parameters())
    cfg = SIZES[args.size]
    backend = ("local disk (temp dirs under " + (args.tmp or tempfile.gettempdir()) + ")"
               if args.backend == "local" else
               f"memory:// behind a wrapper sleeping {args.latency * 1e3:.0f} ms per request")
    info = [
        *header("core engine, plain PyTorch loop"),
        f"- model: GPT '{args.size}', {n_params / 1e6:.2f}M parameters (fp32, "
        f"{n_params * 4 / 1e6:.2f} MB of gradients per step), batch {cfg.batch_size} x {cfg.ctx} "
        "tokens, AdamW + OneCycleLR, gradient clipping"
        + (" (the size bench/storage.py uses; 'bench' takes ~0.4 s a step on one thread, too "
           "slow for this matrix in ~6 minutes: `--size bench`)" if args.size == "demo" else ""),
        f"- {steps} optimizer steps per run, first {warmup} untimed; {args.rounds} rounds, order "
        "reversed every other round, a baseline run before each round and after the last; fixed "
        "settings: "
        f"base_every_n_steps={args.base_every}; storage: {backend}",
        f"- MTBFs: {', '.join(f'{k} ({v:.0f} s)' for k, v in MTBFS.items())}; TuningOptions "
        "defaults otherwise (max_overhead 3%, retune_every_n_steps 50; the engine's first "
        "review comes at step 10)",
    ]
    t_start = time.perf_counter()
    configs: list[tuple] = [("fixed", n, b) for n, b in FIXED] + [("auto", m) for m in MTBFS]
    results: dict[tuple, list[dict[str, Any]]] = {("none",): []}
    results.update({c: [] for c in configs})
    run_once(("none",), args, warmup + 3, warmup)  # warm the process up
    run_once(("fixed", 1, 1), args, warmup + 3, warmup)
    for rnd in range(args.rounds):
        order = configs if rnd % 2 == 0 else list(reversed(configs))
        for config in [("none",), *order] + ([("none",)] if rnd == args.rounds - 1 else []):
            restore = config[0] != "none"
            r = run_once(config, args, steps, warmup, restore=restore)
            results[config].append(r)
            extra = ""
            if config[0] != "none":
                s = r["settings"]
                lag = statistics.mean(r["lags"]) if r["lags"] else float("nan")
                extra = (f" stall {r['stall']:.2f} close {r['tail']:.2f}  -> ({s.every_n_steps}, "
                         f"{s.write_batch}, {s.base_every_n_steps}) lag {lag:.3f} s")
                if "restore_s" in r:
                    extra += (f", restore step {r['restore_step']} {r['restore_s']:.2f} s "
                              f"(load {r['base_load_s']:.3f} s, {r['replayed']} replayed)")
            print(f"round {rnd + 1}/{args.rounds} {name_of(config):22s} wall {r['wall']:6.2f} s "
                  f"cpu {r['cpu']:6.2f} s{extra}", flush=True)
    t_base, rows = summarize(results, args, timed)
    table = render(rows, results, t_base) + model_view(results, args.base_every)
    elapsed = time.perf_counter() - t_start
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    none = results[("none",)]
    info.append(f"- baseline: {1e3 * t_base:.1f} ms/step wall (median of {len(none)} runs; wall "
                + " ".join(f"{r['wall']:.2f}" for r in none) + " s, training-thread CPU "
                + " ".join(f"{r['cpu']:.2f}" for r in none)
                + f" s); whole benchmark {elapsed:.0f} s; load average after it {load}")
    sizes: dict[str, set[str]] = {"starting": set(), "periodic": set()}
    for row in rows:
        for r in row["runs"]:
            for k, v in r["base_sizes"].items():
                sizes["periodic" if k else "starting"].add(f"{v / 1e6:.1f} MB")
    notes = [
        "",
        "`overhead (CPU)`: (training-thread CPU seconds + seconds stalled on a full "
        "writer queue) / the mean training-thread CPU seconds of the two baseline runs around "
        "the round - 1, over the timed steps; time the thread was preempted by other processes "
        "does not count, but contention for the core's caches and memory still moves it. "
        "`overhead (wall)`: wall seconds of the timed steps / the same round's baseline - 1 "
        "(the end-of-run flush apart: `close s`). Both: median [min..max] over the rounds (auto "
        "rows: one run each, since the tuner may choose differently each time). `direct "
        "overhead`: training-thread CPU seconds inside review/record_step/write_base, plus the "
        "gradient copies in the optimizer's step hook (`engine.recorder.capture.copy_s`) and stall "
        "seconds, per step, as a share of the baseline's CPU seconds per step; the true "
        "overhead is at least this. `overhead in J`: median over the rounds of max(CPU, "
        "direct) per run. `segment steps`: `Settings.segment_steps`, how far apart durable "
        "steps are. `lag`: mean time from the end of a durable step's optimizer step until its "
        "segment (or base COMMIT) write returned (auto rows: steps after the tuner's last "
        "change). `diff bytes/step`: segment bytes / steps (every step's gradients are "
        "recorded whatever the settings). Bases written: "
        + ", ".join(f"{k} {' / '.join(sorted(v))}" for k, v in sizes.items() if v)
        + " (the starting base of a fresh run holds no optimizer moments yet). `base load`: "
        "restore of the run's newest base into a fresh model right after the run (warm page "
        "cache; the starting base where the run wrote no other), least over the rounds. "
        "`replay`: (restore of the durable step farthest from its base - restore of that base) "
        "/ steps replayed, least over the rounds; `*`: no durable step past a base, so the "
        "median replay cost of the fixed runs. `E[lost]` = segment steps x step "
        "time (the baseline's wall step x (1 + overhead)) / 2 + lag; `E[recovery]` = base load "
        "+ replay x (base every - segment steps) / 2; J = overhead + (E[lost] + E[recovery]) / "
        "MTBF. Bold: the least J per MTBF.",
        "",
        "All runs (timed wall s / training-thread CPU s, in the order run):",
        "",
    ]
    for config, runs in results.items():
        notes.append(f"- {name_of(config)}: "
                     + " ".join(f"{r['wall']:.2f}/{r['cpu']:.2f}" for r in runs))
    title = "# Auto-tuned against fixed checkpoint settings: expected loss from measured costs"
    report = [title, "", *info, "", *table, *notes, ""]
    print("\n" + "\n".join(table))
    write_report(out, report)
    print(f"\nwritten to {out}")
    if plot_path:
        plot(rows, plot_path, f"GPT '{args.size}', {torch.get_num_threads()} torch thread, "
             f"{'local disk' if args.backend == 'local' else 'slow store'}, base every "
             f"{args.base_every} for fixed settings; J from measured costs")
        print(f"plot written to {plot_path}")


if __name__ == "__main__":
    main()
