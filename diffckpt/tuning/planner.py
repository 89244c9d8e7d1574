"""Planning before training: ``every_n_steps``, ``write_batch`` and ``base_every_n_steps`` for a
described model on a storage location (:func:`advise`, what ``diffckpt tune`` reports).

What the tuner needs comes from three places:

- **probed** on the storage: the cost of one write, fitted as ``latency + bytes / bandwidth`` over
  a few object sizes (:func:`~diffckpt.tuning.probe.probe`);
- **given** by the user: parameter count, optimizer, codec, step time, MTBF, overhead budget,
  recovery-time objective, writer memory (:class:`~diffckpt.tuning.sizing.ModelSpec`);
- **estimated on this machine**: memory-copy bandwidth (gradient copies, base copies), checksum
  (XXH3-128) and zstd speed (encoding), the optimizer step time (replay, scaled linearly to the
  model size) and a constant for the loop state of a restorable point
  (:mod:`~diffckpt.tuning.host`).

The same cost model then runs as in training (:class:`~diffckpt.tuning.model.AutoTuner`). This is for
planning: with ``"auto"`` settings, training measures all of this online and re-tunes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

from ..options import BY_BYTES, DEFAULT_BASE_EVERY_DIFF_BYTES_RATIO, CheckpointOptions
from ..policies import bytes_interval
from ..storage import RetryPolicy
from ..units import DAY, format_bytes, format_duration, format_percent, format_rate
from .host import HostCosts, measure_host
from .model import (
    WRITER_HEADROOM,
    AutoTuner,
    Estimate,
    Measurements,
    Settings,
    TuningOptions,
    expected_loss,
)
from .probe import DEFAULT_REPEATS, DEFAULT_SIZES, PROBE_RETRY, local_path, probe
from .sizing import ModelSpec

__all__ = ["FIXED", "FIXED_BASE_EVERY", "NOTE", "STATE_S", "advise", "build_measurements", "snippet"]

STATE_S = 1e-3  # loop state, schedulers and RNG of a restorable point: about a millisecond
FIXED_BASE_EVERY = 500  # the comparison's fixed rows: a round step count, the same for every model
FIXED = [(n, b, FIXED_BASE_EVERY) for n in (1, 10, 100) for b in (1, 16)]  # the comparison's rows
NOTE = ('planning estimate: with every_n_steps="auto" (and the other knobs on "auto"), training '
        "re-measures all of this online and re-tunes as it goes")


def build_measurements(model: ModelSpec, latency_s: float, bandwidth_bps: float, host: HostCosts,
                       replay_step_s: float | None = None, local_tier: bool = True
                       ) -> tuple[Measurements, dict[str, Any]]:
    """The tuner's measurements for ``model`` on a storage of this write cost; also returns how
    each figure was obtained (for the report). ``local_tier``: training journals records on the
    node, as by default (``CheckpointOptions.local_dir="auto"``)."""
    P = model.params
    record = model.record_bytes
    # Dense fp32 gradients are stored as they are (compression="auto" finds they do not pay);
    # low-precision payloads shrink as the sample did; other payloads are assumed not to.
    diff = record * (min(1.0, host.zstd_ratio_bf16) if model.codec.kind == "lowprec" else 1.0)
    per_byte = 1 / host.hash_bps + (1 / host.zstd_bps if model.codec.kind != "none" else 0.0)
    base = model.base_bytes
    base_capture = base / host.copy_bps
    base_encode = base * (1 / host.copy_bps + 1 / host.hash_bps)  # serialize, then checksum
    optimizer_s = host.optimizer_s(P)
    replay = replay_step_s if replay_step_s is not None else (
        optimizer_s + diff / bandwidth_bps + per_byte * record)
    load = latency_s + base / bandwidth_bps + base_encode
    m = Measurements(
        step_s=model.step_s, record_s=record / host.copy_bps, state_s=STATE_S, diff_bytes=diff,
        record_bytes=record, encode_s_per_byte=per_byte, latency_s=latency_s,
        bandwidth_bps=bandwidth_bps, base_bytes=base, base_capture_s=base_capture,
        base_encode_s=base_encode, replay_step_s=replay, base_load_s=load,
        memory_bytes=float(model.memory_bytes), steps=0, local_tier=local_tier)
    how = {"optimizer_step_s": optimizer_s,
           "replay_step_source": "given (--replay-step-time)" if replay_step_s is not None else "estimated"}
    return m, how


def _estimate(e: Estimate, mtbf_s: float) -> dict[str, Any]:
    s = e.settings
    return {"every_n_steps": s.every_n_steps, "write_batch": s.write_batch,
            "base_every_n_steps": s.base_every_n_steps, "segment_steps": s.segment_steps,
            "loss": e.loss, "loss_per_day_s": e.loss * DAY, "overhead": e.overhead,
            "failures": e.loss - e.overhead, "lost_work_s": e.lost_work_s, "lost_steps": e.lost_steps,
            "worst_lost_steps": e.worst_lost_steps,
            "recovery_s": e.recovery_s, "worst_recovery_s": e.worst_recovery_s,
            "writer_utilization": e.writer_utilization, "memory_bytes": e.memory_bytes,
            "failures_per_day": DAY / mtbf_s, "feasible": not e.violations,
            "violations": list(e.violations)}


def snippet(url: str, settings: Settings, model: ModelSpec, storage_options: dict[str, Any]) -> str:
    """The recommendation as a ``DiffCheckpoint(...)`` call to paste."""
    args = [json.dumps(url), f"every_n_steps={settings.every_n_steps}",
            f"write_batch={settings.write_batch}", f"base_every_n_steps={settings.base_every_n_steps}"]
    if model.memory_bytes != CheckpointOptions.max_pending_bytes:
        args.append(f"max_pending_bytes={model.memory_bytes}")
    if (codec := model.codec.snippet()) is not None:
        args.append(f"codec={codec}")
    if storage_options:  # not echoed: they may hold credentials
        args.append("storage_options=...")
    return f"DiffCheckpoint({', '.join(args)})"


def advise(url: str, model: ModelSpec, options: TuningOptions, *, storage_options: dict[str, Any] | None = None,
           sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = DEFAULT_REPEATS,
           retry: RetryPolicy = PROBE_RETRY, device: str = "cpu", copy_bps: float | None = None,
           replay_step_s: float | None = None, fixed: dict[str, Any] | None = None) -> dict[str, Any]:
    """Probe ``url``, estimate the rest on this machine and run the tuner: the whole report as
    JSON-able data (what ``--json`` prints). ``retry`` is the probe's retry policy."""
    storage_options = dict(storage_options or {})
    if local_path(url) is not None and "://" not in url:
        url = os.path.abspath(url)
    host = measure_host(model.optimizer, device)  # first: a bad --device fails before any write
    probed = probe(url, storage_options, sizes, repeats, retry)
    copy_source = "measured"
    if copy_bps is not None:
        host = dataclasses.replace(host, copy_bps=copy_bps)
        copy_source = "given (--copy-bandwidth)"
    m, how = build_measurements(model, probed["latency_s"], probed["bandwidth_bps"], host, replay_step_s)
    fixed = dict(fixed or {})
    if fixed.get("base_every_n_steps") == BY_BYTES:  # the interval training's "bytes" sizes for this model
        fixed["base_every_n_steps"] = bytes_interval(DEFAULT_BASE_EVERY_DIFF_BYTES_RATIO, model.base_bytes,
                                                     model.record_bytes)
    tuner = AutoTuner(options, **fixed)
    decision = tuner.decide(m)
    best = decision.estimate
    comparison = [_estimate(expected_loss(Settings(n, b, base), m, options), options.mtbf_s)
                  for n, b, base in FIXED]
    return {
        "url": url, "note": NOTE, "probe": probed, "limits": _limits(m, options, copy_source, model.codec.kind),
        "model": {"params": model.params, "optimizer": model.optimizer, "state_slots": model.slots,
                  "codec": model.codec.text, "codec_description": model.codec.describe(),
                  "step_s": model.step_s, "base_bytes": model.base_bytes,
                  "record_bytes": model.record_bytes, "diff_bytes": m.diff_bytes,
                  "memory_bytes": model.memory_bytes},
        "options": {"mtbf_s": options.mtbf_s, "max_overhead": options.max_overhead, "rto_s": options.rto_s,
                    "fixed": {k: v for k, v in fixed.items() if v != "auto"}},
        "estimates": {
            "device": host.device, "copy_bandwidth_bps": host.copy_bps, "copy_bandwidth_source": copy_source,
            "hash_bandwidth_bps": host.hash_bps, "zstd_bandwidth_bps": host.zstd_bps,
            "zstd_ratio_bf16": host.zstd_ratio_bf16,
            "optimizer_probe_params": host.optimizer_probe_params,
            "optimizer_probe_s": host.optimizer_probe_s, "optimizer_step_s": how["optimizer_step_s"],
            "replay_step_s": m.replay_step_s, "replay_step_source": how["replay_step_source"],
            "record_s": m.record_s, "state_s": m.state_s, "encode_s_per_byte": m.encode_s_per_byte,
            "base_capture_s": m.base_capture_s, "base_encode_s": m.base_encode_s,
            "base_load_s": m.base_load_s, "read_bandwidth": "assumed equal to the probed write bandwidth"},
        "measurements": m.as_dict(),
        "recommended": {**best.settings.as_dict(), "snippet": snippet(url, best.settings, model, storage_options),
                        "estimate": _estimate(best, options.mtbf_s)},
        "comparison": comparison,
    }


def _limits(m: Measurements, o: TuningOptions, copy_source: str, codec_kind: str) -> dict[str, Any]:
    """What no choice of the three knobs can change: the share of step time the gradient copy
    takes, and the writer's per-byte time per step (batching amortizes only the latency)."""
    headroom = WRITER_HEADROOM
    per_step_write = m.encode_s_per_byte * m.record_bytes + m.diff_bytes / m.bandwidth_bps
    hints = []
    codec = ("use a codec (e.g. --codec topk:0.01 or bf16)" if codec_kind == "none"
             else "use a smaller payload (e.g. --codec topk:0.01)")
    record_share = m.record_s / m.step_s
    if record_share > o.max_overhead:
        hints.append(
            f"copying each step's record ({format_bytes(m.record_bytes)}) takes {format_percent(record_share)} "
            f"of the step whatever the settings, above max_overhead {format_percent(o.max_overhead)}: {codec}, "
            "allow more with --max-overhead"
            + (", or, for training on a GPU, time it there (--device cuda) or pass --copy-bandwidth"
               if copy_source == "measured" else ""))
    writer_share = per_step_write / m.step_s
    if writer_share > headroom:
        encode = m.encode_s_per_byte * m.record_bytes
        need = m.diff_bytes / max(headroom * m.step_s - encode, 1e-9)
        fix = (f"storage writing at least {format_rate(need)}" if headroom * m.step_s > encode
               else "a faster writer (encoding alone takes longer than the step)")
        hints.append(
            f"the writer needs {format_duration(per_step_write)} per step for {format_bytes(m.diff_bytes)} of "
            f"diffs (encode + bandwidth, before any latency) against a {format_duration(m.step_s)} step: busy "
            f"{format_percent(writer_share)} at any write_batch, above its {headroom:.0%} limit. It cannot keep "
            f"up: {codec}, or {fix}")
    return {"record_overhead": record_share, "writer_utilization_floor": writer_share,
            "writer_headroom": headroom, "hints": hints}
