"""``diffckpt tune URL --params N --step-time T``: probe a storage location and recommend
``every_n_steps``, ``write_batch`` and ``base_every_n_steps`` (:func:`diffckpt.tuning.planner.advise`).

This module holds the command's arguments and the report as text; ``--json`` prints the report's
data as the planner returns it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from ..options import BY_BYTES, CheckpointOptions
from ..tuning.host import COPY_PROBE_BYTES
from ..tuning.model import TuningOptions
from ..tuning.planner import FIXED_BASE_EVERY, NOTE, advise
from ..tuning.probe import DEFAULT_REPEATS, DEFAULT_SIZES, PROBE_RETRY
from ..tuning.sizing import STATE_SLOTS, CodecSpec, ModelSpec, parse_codec
from ..units import (
    MiB,
    format_bytes,
    format_count,
    format_duration,
    format_percent,
    format_rate,
    parse_count,
    parse_duration,
    parse_fraction,
    parse_positive,
    parse_size,
)
from .common import storage_options, table

__all__ = ["add_arguments", "parse_base_knob", "parse_knob", "parse_sizes", "render", "run"]

_dur, _pct = format_duration, format_percent  # the report uses them on nearly every line


def parse_sizes(text: str) -> list[int]:
    """Comma-separated probe sizes: ``4KiB,1MiB,16MiB``."""
    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError("give at least one probe size, e.g. 4KiB,1MiB,16MiB")
    return sizes


def parse_knob(text: str) -> int | str:
    """A knob the user fixes (a positive integer) or leaves to the tuner (``auto``)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return parse_positive(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"not a positive integer or 'auto': {text!r}") from None


def parse_base_knob(text: str) -> int | str | None:
    """``base_every_n_steps``: as :func:`parse_knob`, ``none`` (only the starting base) or
    ``bytes`` (the training default: sized from the bytes of a step and of a base)."""
    if text.strip().lower() == "none":
        return None
    if text.strip().lower() == BY_BYTES:
        return BY_BYTES
    try:
        return parse_knob(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"not a positive integer, 'none', 'auto' or 'bytes': {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``tune`` command's arguments."""
    p.description = ("Probe a storage location and recommend every_n_steps, write_batch and "
                     "base_every_n_steps for a model. " + NOTE[0].upper() + NOTE[1:] + "; this "
                     "command is for planning.")
    p.add_argument("url", metavar="URL", help="where checkpoints will go (local path or fsspec URL); "
                   "a few objects are written under URL/_probe/ and deleted")
    p.add_argument("-O", "--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option (repeatable; VALUE may be JSON)")
    p.add_argument("--params", type=parse_count, required=True, metavar="N",
                   help="parameter count: 350000, 125M, 1.3B")
    p.add_argument("--step-time", type=parse_duration, required=True, metavar="DURATION",
                   help="training time of one optimizer step without checkpointing: 0.5, 500ms")
    p.add_argument("--mtbf", type=parse_duration, default=TuningOptions.mtbf_s, metavar="DURATION",
                   help="mean time between failures of the job: 24h (default), 30m, 7d, seconds")
    p.add_argument("--optimizer", choices=sorted(STATE_SLOTS), default="adamw",
                   help="sets the state slots in bases (adam/adamw 2, sgd-momentum 1, sgd 0) and the "
                        "timed step (default adamw)")
    p.add_argument("--codec", type=parse_codec, default=CodecSpec("none"), metavar="CODEC",
                   help="gradient codec: none (dense fp32, default), topk:0.01, powersgd:4, bf16")
    p.add_argument("--max-overhead", type=parse_fraction, default=TuningOptions.max_overhead,
                   metavar="FRACTION", help=f"share of step time checkpointing may take "
                   f"(default {TuningOptions.max_overhead:g}; 3%% works too)")
    p.add_argument("--rto", type=parse_duration, metavar="DURATION",
                   help="recovery-time objective: longest a restore may take (default: no bound)")
    p.add_argument("--memory", type=parse_size, default=CheckpointOptions.max_pending_bytes,
                   metavar="SIZE", help="max_pending_bytes for the writer queue (default 256MiB)")
    p.add_argument("--replay-step-time", type=parse_duration, metavar="DURATION",
                   help="replay time of one step if known (e.g. measured on the GPU); default: "
                        "estimated on this machine")
    p.add_argument("--copy-bandwidth", type=parse_size, metavar="BYTES_PER_S",
                   help="memory-copy bandwidth of the training device (e.g. 1TB for a GPU); "
                        "default: measured on --device")
    p.add_argument("--device", default="cpu", help="where to time copies and the optimizer step (default cpu)")
    p.add_argument("--every-n-steps", type=parse_knob, default="auto", metavar="N|auto",
                   help="fix this knob and tune the others")
    p.add_argument("--write-batch", type=parse_knob, default="auto", metavar="N|auto",
                   help="fix this knob and tune the others")
    p.add_argument("--base-every-n-steps", type=parse_base_knob, default="auto", metavar="N|none|auto|bytes",
                   help="fix this knob and tune the others (bytes: the interval training's default "
                        "base_every_n_steps='bytes' gives this model)")
    p.add_argument("--probe-sizes", type=parse_sizes, default=list(DEFAULT_SIZES), metavar="SIZES",
                   help="comma-separated object sizes to write (default 4KiB,1MiB,16MiB)")
    p.add_argument("--repeats", type=parse_positive, default=DEFAULT_REPEATS, metavar="N",
                   help=f"writes per size (default {DEFAULT_REPEATS}); the median counts")
    p.add_argument("--retry-budget", type=parse_duration, default=PROBE_RETRY.budget_s, metavar="DURATION",
                   help=f"give up on an unreachable storage after retrying this long "
                        f"(default {PROBE_RETRY.budget_s:g}s)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")


def run(args: argparse.Namespace) -> int:
    """Run ``diffckpt tune`` with parsed ``args``; print the report."""
    model = ModelSpec(args.params, args.step_time, args.optimizer, args.codec, args.memory)
    options = TuningOptions(mtbf_s=args.mtbf, max_overhead=args.max_overhead, rto_s=args.rto)
    fixed = {"every_n_steps": args.every_n_steps, "write_batch": args.write_batch,
             "base_every_n_steps": args.base_every_n_steps}
    # Storage errors name the setting that bounds retries; on the command line it is the flag.
    retry = dataclasses.replace(PROBE_RETRY, budget_s=args.retry_budget, budget_setting="--retry-budget")
    report = advise(args.url, model, options, storage_options=storage_options(args.storage_option),
                    sizes=args.probe_sizes, repeats=args.repeats, retry=retry, device=args.device,
                    copy_bps=args.copy_bandwidth, replay_step_s=args.replay_step_time, fixed=fixed)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def _mib_per_s(row: dict[str, Any]) -> str:
    """A probe row's rate as a number, in the unit of :func:`~diffckpt.units.format_rate`."""
    return f"{row['bytes'] / max(row['median_s'], 1e-12) / MiB:.1f}"


def render(r: dict[str, Any]) -> str:
    """The report as text."""
    p, md, est, opt, rec = r["probe"], r["model"], r["estimates"], r["options"], r["recommended"]
    e = rec["estimate"]
    lines = [f"diffckpt tune {r['url']}", f"note: {r['note']}", "",
             f"storage probe ({p['repeats']} writes per size of random data after one warm-up write, "
             f"under {p['prefix']}/, deleted)"]
    lines += table(["size", "median", "MiB/s"], [
        [format_bytes(row["bytes"]), _dur(row["median_s"]), _mib_per_s(row)] for row in p["table"]])
    lines.append(f"  fitted write cost: latency {_dur(p['latency_s'])} + bytes / {format_rate(p['bandwidth_bps'])}")
    for path in p["leftover"]:
        lines.append(f"  warning: could not delete probe object {path}: delete it by hand")
    slots = md["state_slots"]
    stored = "(zstd ratio of a bf16 sample)" if md["diff_bytes"] != md["record_bytes"] else "(uncompressed)"
    lines += ["", "model (given)",
              f"  {format_count(md['params'])} parameters, {md['optimizer']} ({slots} state "
              f"slot{'s' * (slots != 1)}), step {_dur(md['step_s'])}, codec {md['codec_description']}",
              f"  base {format_bytes(md['base_bytes'])} (fp32 weights + optimizer state), step record "
              f"{format_bytes(md['record_bytes'])}, stored {format_bytes(md['diff_bytes'])} per step {stored}",
              f"  MTBF {_dur(opt['mtbf_s'])}, max overhead {_pct(opt['max_overhead'])}, RTO "
              f"{'none' if opt['rto_s'] is None else _dur(opt['rto_s'])}, writer memory "
              f"{format_bytes(md['memory_bytes'])}"
              + "".join(f", {k}={v} (fixed)" for k, v in opt["fixed"].items()),
              "", f"estimated on this machine ({est['device']}), not probed"]
    copy = f"{format_rate(est['copy_bandwidth_bps'])} ({est['copy_bandwidth_source']}"
    copy += f", clone of {format_bytes(COPY_PROBE_BYTES)})" if est["copy_bandwidth_source"] == "measured" else ")"
    zstd = f", zstd-1 {format_rate(est['zstd_bandwidth_bps'])}" if md["codec"] != "none" else ""
    lines += [f"  memory copy {copy}: record {_dur(est['record_s'])} per step, base copy "
              f"{_dur(est['base_capture_s'])}",
              f"  encode {format_rate(1 / est['encode_s_per_byte'])} (XXH3-128 "
              f"{format_rate(est['hash_bandwidth_bps'])}{zstd}), base serialize {_dur(est['base_encode_s'])}",
              f"  {md['optimizer']} step {_dur(est['optimizer_probe_s'])} on "
              f"{format_count(est['optimizer_probe_params'])} parameters -> {_dur(est['optimizer_step_s'])} "
              f"for {format_count(md['params'])} (scaled linearly)"]
    if est["replay_step_source"].startswith("given"):
        lines.append(f"  replay {_dur(est['replay_step_s'])} per step (given)")
    else:
        lines.append(f"  replay {_dur(est['replay_step_s'])} per step (optimizer step + reading the diff back "
                     "at the probed bandwidth + checksum)")
    lines += [f"  base load {_dur(est['base_load_s'])} (latency + base / bandwidth + deserialize)",
              f"  state {_dur(est['state_s'])} per restorable point (a constant)",
              "", "recommended"]
    if e["violations"]:
        lines.append("  no setting meets every constraint (see the limits below); the one that breaks the fewest:")
    lines.append(f"  {rec['snippet']}")
    lines += _breakdown(e)
    lines += [f"  limit: {hint}" for hint in r["limits"]["hints"]]
    lines += ["", f"comparison with fixed settings (base every {FIXED_BASE_EVERY} steps)"]
    rows = []
    for c in [e, *r["comparison"]]:
        rows.append([("* " if c is e else "  ") + str(c["every_n_steps"]), str(c["write_batch"]),
                     str(c["base_every_n_steps"]), _pct(c["loss"]), _pct(c["overhead"]),
                     _dur(c["lost_work_s"]), _dur(c["recovery_s"]), _dur(c["worst_recovery_s"]),
                     f"{c['writer_utilization']:.0%}", format_bytes(c["memory_bytes"]),
                     "; ".join(c["violations"]) or "-"])
    lines += table(["  every_n", "write_batch", "base_every", "loss", "overhead", "lost/failure",
                    "recovery", "worst", "writer", "memory", "violations"], rows)
    lines.append("  (* recommended)")
    return "\n".join(lines)


def _breakdown(e: dict[str, Any]) -> list[str]:
    out = [f"  expected loss {_pct(e['loss'])} of training time ({_dur(e['loss_per_day_s'])} per day): "
           f"overhead {_pct(e['overhead'])} + failures {_pct(e['failures'])}",
           f"  per failure ({e['failures_per_day']:.3g} per day): lost work {_dur(e['lost_work_s'])} expected, "
           f"recovery {_dur(e['recovery_s'])} expected, {_dur(e['worst_recovery_s'])} worst case",
           f"  a segment every {e['segment_steps']} steps, writer busy {e['writer_utilization']:.0%}, "
           f"memory {format_bytes(e['memory_bytes'])}"]
    if e["violations"]:
        out.append("  violations: " + "; ".join(e["violations"]))
    return out
