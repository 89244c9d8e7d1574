"""Planning advice: ``diffckpt tune URL`` probes a storage location and recommends
``every_n_steps``, ``write_batch`` and ``base_every_n_steps`` for a described model.

What the tuner needs comes from three places:

- **probed** on the storage: the cost of one write, fitted as ``latency + bytes / bandwidth`` over
  a few object sizes (written under ``<URL>/_probe/tune-<id>/`` with random data, deleted
  afterwards; a local directory the probe had to create is removed again);
- **given** by the user: parameter count, optimizer, codec, step time, MTBF, overhead budget,
  recovery-time objective, writer memory;
- **estimated on this machine**: memory-copy bandwidth (gradient copies, base copies), SHA-256
  and zstd speed (encoding), the optimizer step time (replay, scaled linearly to the model size)
  and a constant for the loop state of a restorable point.

The same cost model then runs as in training (:class:`~diffckpt.tuning.model.AutoTuner`). This is for
planning: with ``"auto"`` settings, training measures all of this online and re-tunes.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import StorageError, StorageUnavailableError, UnsupportedConfigurationError
from ..options import CheckpointOptions
from ..storage.fsspec_storage import open_storage
from ..storage.retry import RetryPolicy
from . import model as tuning
from .meter import PROBE_PREFIX, fit_write_cost, probe_storage
from .model import AutoTuner, Estimate, Measurements, Settings, TuningOptions, expected_loss

__all__ = ["add_arguments", "advise", "render", "run"]

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = (4 * KiB, 1 * MiB, 16 * MiB)
DEFAULT_REPEATS = 3
STATE_S = 1e-3  # loop state, schedulers and RNG of a restorable point: about a millisecond
COPY_PROBE_BYTES = 64 * MiB  # tensor cloned to measure memory-copy bandwidth
HASH_PROBE_BYTES = 16 * MiB
ZSTD_PROBE_BYTES = 4 * MiB
OPTIMIZER_PROBE_PARAMS = 1 << 22  # parameters of the timed optimizer step (~4.2M)
FP32 = 4  # bytes per parameter of master weights, optimizer state and dense gradients
STATE_SLOTS = {"adam": 2, "adamw": 2, "sgd-momentum": 1, "sgd": 0}
FIXED_BASE_EVERY = 500
FIXED = [(n, b, FIXED_BASE_EVERY) for n in (1, 10, 100) for b in (1, 16)]
DAY = 86400.0
NOTE = ('planning estimate: with every_n_steps="auto" (and the other knobs on "auto"), training '
        "re-measures all of this online and re-tunes as it goes")


# ------------------------------------------------------------------------------ parsing
_NUM = r"(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?"
_COUNT_UNITS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_SIZE_UNITS = {"": 1, "b": 1, "k": KiB, "m": MiB, "g": 1 << 30, "t": 1 << 40,
               "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
               "kib": KiB, "mib": MiB, "gib": 1 << 30, "tib": 1 << 40}
_TIME_UNITS = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0,
               "h": 3600.0, "hr": 3600.0, "d": DAY, "w": 7 * DAY}


def _number(m: re.Match[str]) -> float:
    return float(m[1]) * 10.0 ** int(m[2] or 0)


def parse_count(text: str) -> int:
    """``125M``, ``1.3B``, ``350000``, ``7e9`` (k, M, B/G, T are powers of 1000)."""
    m = re.fullmatch(rf"\s*{_NUM}\s*([a-zA-Z]?)\s*", text)
    if m is None or m[3].lower() not in _COUNT_UNITS:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (e.g. 350000, 125M, 1.3B)")
    value = round(_number(m) * _COUNT_UNITS[m[3].lower()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"the parameter count must be at least 1, got {text!r}")
    return value


def parse_duration(text: str) -> float:
    """Seconds: ``0.5``, ``500ms``, ``30m`` (minutes), ``24h``, ``7d``, ``1h30m``."""
    s = text.strip().lower()
    if (m := re.fullmatch(_NUM, s)) is not None:
        seconds = _number(m)
    else:
        parts = list(re.finditer(rf"{_NUM}\s*(us|µs|ms|sec|min|hr|s|m|h|d|w)\s*", s))
        if not parts or "".join(p[0] for p in parts) != s:
            raise argparse.ArgumentTypeError(
                f"not a duration: {text!r} (seconds, or with a unit: 500ms, 30s, 30m, 24h, 7d)")
        seconds = sum(_number(p) * _TIME_UNITS[p[3]] for p in parts)
    if not math.isfinite(seconds) or seconds <= 0:
        raise argparse.ArgumentTypeError(f"the duration must be positive, got {text!r}")
    return seconds


def parse_size(text: str) -> int:
    """Bytes: ``4096``, ``4KiB``, ``16M`` (K, M, G alone are binary), ``1GB`` (decimal)."""
    s = text.strip().lower().removesuffix("/s")
    m = re.fullmatch(rf"{_NUM}\s*([a-z]*)", s)
    if m is None or m[3] not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 4KiB, 16MiB, 1GB)")
    value = round(_number(m) * _SIZE_UNITS[m[3]])
    if value < 1:
        raise argparse.ArgumentTypeError(f"the size must be at least one byte, got {text!r}")
    return value


def parse_sizes(text: str) -> list[int]:
    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError("give at least one probe size, e.g. 4KiB,1MiB,16MiB")
    return sizes


def parse_fraction(text: str) -> float:
    """``0.03`` or ``3%``: a share of step time, in (0, 1)."""
    s = text.strip()
    try:
        value = float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        value = math.nan
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"not a fraction in (0, 1): {text!r} (e.g. 0.03 or 3%)")
    return value


def parse_positive(text: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a positive integer: {text!r}")
    return value


def parse_knob(text: str) -> int | str:
    """A knob the user fixes (a positive integer) or leaves to the tuner (``auto``)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return parse_positive(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"not a positive integer or 'auto': {text!r}") from None


def parse_base_knob(text: str) -> int | str | None:
    """``base_every_n_steps``: as :func:`parse_knob`, or ``none`` (only the starting base)."""
    if text.strip().lower() == "none":
        return None
    try:
        return parse_knob(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"not a positive integer, 'none' or 'auto': {text!r}") from None


@dataclass(frozen=True)
class CodecSpec:
    """A gradient codec as far as sizes go (``kind``: none, topk, powersgd, lowprec)."""

    kind: str
    value: float = 0.0
    text: str = "none"

    def record_bytes(self, params: int) -> float:
        """Bytes a step's record holds (the codec's payload; dense fp32 gradients without one)."""
        if self.kind == "topk":  # an int32 index delta and a float32 value per kept entry
            return max(1.0, math.ceil(self.value * params)) * 8
        if self.kind == "powersgd":
            # P (rows x r) and Q (cols x r) in float32 per matrix. For transformer-shaped
            # matrices of width h (attention h x h, MLP h x 4h, embeddings V x h) that is about
            # 6 r / h bytes per parameter, with h from params ~ 12 L h^2 and L ~ h / 64.
            width = (params / 0.1875) ** (1 / 3)
            return min(FP32, 6 * self.value / width) * params
        if self.kind == "lowprec":
            return 2.0 * params
        return float(FP32 * params)

    def extra_base_bytes(self, params: int) -> float:
        """Codec state saved with bases: PowerSGD's error-feedback residuals (on by default)."""
        return float(FP32 * params) if self.kind == "powersgd" else 0.0

    def snippet(self) -> str | None:
        if self.kind == "topk":
            return f"TopK({self.value:g})"
        if self.kind == "powersgd":
            return f"PowerSGD({int(self.value)})"
        if self.kind == "lowprec":
            return f'LowPrecision("{self.text}")'
        return None

    def describe(self) -> str:
        return {"topk": f"topk {self.value:g} (index + value per kept entry)",
                "powersgd": f"powersgd rank {int(self.value)} (approximate: transformer-shaped matrices)",
                "lowprec": f"{self.text} gradients",
                }.get(self.kind, "none (dense fp32 gradients)")


def parse_codec(text: str) -> CodecSpec:
    """``none``, ``topk:0.01``, ``powersgd:4``, ``bf16`` / ``fp16`` (or ``lowprec:bf16``)."""
    s = text.strip().lower()
    kind, _, arg = s.partition(":")
    try:
        if kind in ("none", "dense") and not arg:
            return CodecSpec("none")
        if kind == "topk":
            ratio = float(arg or "0.01")
            if 0 < ratio <= 1:
                return CodecSpec("topk", ratio, s)
        elif kind == "powersgd":
            rank = int(arg or "4")
            if rank >= 1:
                return CodecSpec("powersgd", rank, s)
        elif kind in ("bf16", "fp16") and not arg:
            return CodecSpec("lowprec", 2, kind)
        elif kind == "lowprec" and arg in ("bf16", "fp16", "bfloat16", "float16"):
            return CodecSpec("lowprec", 2, "bf16" if arg.startswith("b") else "fp16")
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(
        f"unknown codec {text!r}: use none, topk:RATIO (e.g. topk:0.01), powersgd:RANK (e.g. "
        "powersgd:4), bf16 or fp16")


# ----------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class Model:
    """What the user says about training."""

    params: int
    step_s: float
    optimizer: str = "adamw"
    codec: CodecSpec = CodecSpec("none")
    memory_bytes: int = CheckpointOptions.max_pending_bytes

    @property
    def slots(self) -> int:
        return STATE_SLOTS[self.optimizer]

    @property
    def base_bytes(self) -> float:
        """fp32 master weights plus the optimizer's state slots (plus codec state)."""
        return FP32 * self.params * (1 + self.slots) + self.codec.extra_base_bytes(self.params)

    @property
    def record_bytes(self) -> float:
        return self.codec.record_bytes(self.params)


# ---------------------------------------------------------------------- host estimates
def _median_time(fn: Any, repeats: int, sync: Any = None) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass(frozen=True)
class HostCosts:
    """Per-byte and per-parameter costs measured on this machine (``device`` for copies and the
    optimizer step)."""

    device: str
    copy_bps: float
    hash_bps: float
    zstd_bps: float
    optimizer_probe_params: int
    optimizer_probe_s: float
    zstd_ratio_bf16: float = 1.0  # compressed / raw size of a random bf16 sample at level 1

    def optimizer_s(self, params: int) -> float:
        return self.optimizer_probe_s * params / self.optimizer_probe_params


def measure_host(optimizer: str = "adamw", device: str = "cpu") -> HostCosts:
    """Time a tensor clone, SHA-256, zstd level 1 and one real optimizer step on ``device``."""
    import torch
    import zstandard

    try:
        dev = torch.device(device)
        torch.empty(1, device=dev)
    except (RuntimeError, AssertionError) as exc:  # a bad name, or no such device here
        raise UnsupportedConfigurationError(f"--device {device}: {exc}") from exc
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    x = torch.empty(COPY_PROBE_BYTES // 4, dtype=torch.float32, device=dev)
    x.clone()  # first touch
    copy_s = _median_time(x.clone, 3, sync)
    del x
    buf = bytes(HASH_PROBE_BYTES)
    hash_s = _median_time(lambda: hashlib.sha256(buf).digest(), 2)
    gen = torch.Generator().manual_seed(0)
    payload = torch.randn(ZSTD_PROBE_BYTES // 2, generator=gen).bfloat16().view(torch.uint8).numpy().tobytes()
    compressor = zstandard.ZstdCompressor(level=1)
    zstd_s = _median_time(lambda: compressor.compress(payload), 2)
    ratio = len(compressor.compress(payload)) / len(payload)
    p = torch.nn.Parameter(torch.randn(OPTIMIZER_PROBE_PARAMS, generator=gen).to(dev))
    p.grad = torch.randn(OPTIMIZER_PROBE_PARAMS, generator=gen).to(dev)
    opt = {"adam": lambda: torch.optim.Adam([p], lr=1e-3),
           "adamw": lambda: torch.optim.AdamW([p], lr=1e-3),
           "sgd-momentum": lambda: torch.optim.SGD([p], lr=1e-3, momentum=0.9),
           "sgd": lambda: torch.optim.SGD([p], lr=1e-3)}[optimizer]()
    opt.step()  # creates the state
    step_s = _median_time(opt.step, 3, sync)
    return HostCosts(str(dev), COPY_PROBE_BYTES / max(copy_s, 1e-9), HASH_PROBE_BYTES / max(hash_s, 1e-9),
                     ZSTD_PROBE_BYTES / max(zstd_s, 1e-9), OPTIMIZER_PROBE_PARAMS, step_s, ratio)


def build_measurements(model: Model, latency_s: float, bandwidth_bps: float, host: HostCosts,
                       replay_step_s: float | None = None) -> tuple[Measurements, dict[str, Any]]:
    """The tuner's measurements for ``model`` on a storage of this write cost; also returns how
    each figure was obtained (for the report)."""
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
        memory_bytes=float(model.memory_bytes), steps=0)
    how = {"optimizer_step_s": optimizer_s,
           "replay_step_source": "given (--replay-step-time)" if replay_step_s is not None else "estimated"}
    return m, how


# --------------------------------------------------------------------------- the probe
def _local_root(url: str) -> str | None:
    if "://" not in url:
        return url
    return url.split("://", 1)[1] if url.startswith(("file://", "local://")) else None


def probe(url: str, storage_options: dict[str, Any], sizes: Sequence[int], repeats: int,
          retry_budget_s: float) -> dict[str, Any]:
    """Time writes of ``sizes`` to ``url`` (``repeats`` each, after one warm-up write) and fit
    their cost. Objects go under ``_probe/tune-<id>/`` and are deleted; on a local disk the
    directories the probe created are removed too, so the location is left as it was found."""
    policy = RetryPolicy(budget_s=retry_budget_s, initial_backoff_s=0.1, max_backoff_s=1.0)
    try:
        storage = open_storage(url, retry=policy, **storage_options)
    except (ValueError, ImportError, TypeError) as exc:
        raise UnsupportedConfigurationError(f"cannot open {url}: {exc}") from exc
    prefix = f"{PROBE_PREFIX}/tune-{uuid.uuid4().hex[:12]}"
    local = _local_root(url)
    created: list[str] = []  # directories the probe creates, deepest first
    if local is not None:
        d = os.path.join(local, *prefix.split("/"))
        while d and not os.path.exists(d) and os.path.dirname(d) != d:
            created.append(d)
            d = os.path.dirname(d)
    try:
        probe_storage(storage, (min(sizes),), 1, prefix)  # warm-up: connection, credentials, dirs
        samples = probe_storage(storage, sizes, repeats, prefix)
        leftover = sorted(storage.list(prefix))
    except StorageError as exc:
        # The storage layer words its fixes for DiffCheckpoint(dirpath=..., retry=...).
        why = str(exc).replace("RetryPolicy.budget_s sets how long to retry",
                               "--retry-budget sets how long to retry").replace("dirpath", "the URL")
        if isinstance(exc, StorageUnavailableError) and "--retry-budget" not in why:
            why += " (--retry-budget sets how long to retry)"
        raise StorageError(f"cannot probe {url} (tune writes and deletes a few objects under "
                           f"{url.rstrip('/')}/{PROBE_PREFIX}/): {why}") from exc
    except TypeError as exc:  # a storage option the backend does not take
        raise UnsupportedConfigurationError(f"cannot open {url}: {exc}") from exc
    finally:
        for d in created:
            try:
                os.rmdir(d)
            except OSError:
                break  # not empty (or never made): leave it and everything above
    table = []
    for size in sorted(set(sizes)):
        times = [t for s, t in samples if s == size]
        med = statistics.median(times)
        table.append({"bytes": size, "median_s": med, "mb_per_s": size / max(med, 1e-12) / 1e6})
    # Medians: one slow request (a new connection, a hiccup) must not tilt the fit.
    latency, bandwidth = fit_write_cost([(r["bytes"], r["median_s"]) for r in table])
    return {"url": url, "prefix": prefix, "sizes": list(sizes), "repeats": repeats,
            "samples": [[s, t] for s, t in samples], "table": table,
            "latency_s": latency, "bandwidth_bps": bandwidth,
            "leftover": [f"{url.rstrip('/')}/{prefix}/{p}" for p in leftover]}


# ------------------------------------------------------------------------------ advice
def _estimate(e: Estimate, mtbf_s: float) -> dict[str, Any]:
    s = e.settings
    return {"every_n_steps": s.every_n_steps, "write_batch": s.write_batch,
            "base_every_n_steps": s.base_every_n_steps, "segment_steps": s.segment_steps,
            "loss": e.loss, "loss_per_day_s": e.loss * DAY, "overhead": e.overhead,
            "failures": e.loss - e.overhead, "lost_work_s": e.lost_work_s,
            "recovery_s": e.recovery_s, "worst_recovery_s": e.worst_recovery_s,
            "writer_utilization": e.writer_utilization, "memory_bytes": e.memory_bytes,
            "failures_per_day": DAY / mtbf_s, "feasible": not e.violations,
            "violations": list(e.violations)}


def snippet(url: str, settings: Settings, model: Model, storage_options: dict[str, Any]) -> str:
    args = [json.dumps(url), f"every_n_steps={settings.every_n_steps}",
            f"write_batch={settings.write_batch}", f"base_every_n_steps={settings.base_every_n_steps}"]
    if model.memory_bytes != CheckpointOptions.max_pending_bytes:
        args.append(f"max_pending_bytes={model.memory_bytes}")
    if (codec := model.codec.snippet()) is not None:
        args.append(f"codec={codec}")
    if storage_options:  # not echoed: they may hold credentials
        args.append("storage_options=...")
    return f"DiffCheckpoint({', '.join(args)})"


def advise(url: str, model: Model, options: TuningOptions, *, storage_options: dict[str, Any] | None = None,
           sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = DEFAULT_REPEATS,
           retry_budget_s: float = 10.0, device: str = "cpu", copy_bps: float | None = None,
           replay_step_s: float | None = None, fixed: dict[str, Any] | None = None) -> dict[str, Any]:
    """Probe ``url``, estimate the rest on this machine and run the tuner: the whole report as
    JSON-able data (what ``--json`` prints)."""
    storage_options = dict(storage_options or {})
    if _local_root(url) is not None and "://" not in url:
        url = os.path.abspath(url)
    host = measure_host(model.optimizer, device)  # first: a bad --device fails before any write
    probed = probe(url, storage_options, sizes, repeats, retry_budget_s)
    copy_source = "measured"
    if copy_bps is not None:
        host = dataclasses.replace(host, copy_bps=copy_bps)
        copy_source = "given (--copy-bandwidth)"
    m, how = build_measurements(model, probed["latency_s"], probed["bandwidth_bps"], host, replay_step_s)
    tuner = AutoTuner(options, **(fixed or {}))
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
                    "fixed": {k: v for k, v in (fixed or {}).items() if v != "auto"}},
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
    headroom = float(getattr(tuning, "WRITER_HEADROOM", 0.8))
    per_step_write = m.encode_s_per_byte * m.record_bytes + m.diff_bytes / m.bandwidth_bps
    hints = []
    codec = ("use a codec (e.g. --codec topk:0.01 or bf16)" if codec_kind == "none"
             else "use a smaller payload (e.g. --codec topk:0.01)")
    record_share = m.record_s / m.step_s
    if record_share > o.max_overhead:
        hints.append(
            f"copying each step's record ({_size(m.record_bytes)}) takes {_pct(record_share)} of the step "
            f"whatever the settings, above max_overhead {_pct(o.max_overhead)}: {codec}, allow more with "
            "--max-overhead"
            + (", or, for training on a GPU, time it there (--device cuda) or pass --copy-bandwidth"
               if copy_source == "measured" else ""))
    writer_share = per_step_write / m.step_s
    if writer_share > headroom:
        need = m.diff_bytes / max(headroom * m.step_s - m.encode_s_per_byte * m.record_bytes, 1e-9)
        fix = (f"storage writing at least {_rate(need)}" if headroom * m.step_s > m.encode_s_per_byte * m.record_bytes
               else "a faster writer (encoding alone takes longer than the step)")
        hints.append(
            f"the writer needs {_dur(per_step_write)} per step for {_size(m.diff_bytes)} of diffs (encode + "
            f"bandwidth, before any latency) against a {_dur(m.step_s)} step: busy {_pct(writer_share)} at "
            f"any write_batch, above its {headroom:.0%} limit. It cannot keep up: {codec}, or {fix}")
    return {"record_overhead": record_share, "writer_utilization_floor": writer_share,
            "writer_headroom": headroom, "hints": hints}


# ----------------------------------------------------------------------------- output
def _size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"


def _rate(bps: float) -> str:
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} B/s"


def _dur(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    if s < 120:
        return f"{s:.3g} s"
    if s < 2 * 3600:
        return f"{s / 60:.3g} min"
    if s < 2 * DAY:
        return f"{s / 3600:.3g} h"
    return f"{s / DAY:.3g} d"


def _pct(x: float) -> str:
    return f"{x:.2%}" if x < 0.1 else f"{x:.1%}"


def _count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return str(n)


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    rows = [headers, *rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(headers) - 1)]
    return ["  " + "  ".join([*map(str.ljust, r[:-1], widths), r[-1]]).rstrip() for r in rows]


def render(r: dict[str, Any]) -> str:
    """The report as text."""
    p, md, est, opt, rec = r["probe"], r["model"], r["estimates"], r["options"], r["recommended"]
    e = rec["estimate"]
    lines = [f"diffckpt tune {r['url']}", f"note: {r['note']}", "",
             f"storage probe ({p['repeats']} writes per size of random data after one warm-up write, "
             f"under {p['prefix']}/, deleted)"]
    lines += _table(["size", "median", "MB/s"], [
        [_size(row["bytes"]), _dur(row["median_s"]), f"{row['mb_per_s']:.1f}"] for row in p["table"]])
    lines.append(f"  fitted write cost: latency {_dur(p['latency_s'])} + bytes / {_rate(p['bandwidth_bps'])}")
    for path in p["leftover"]:
        lines.append(f"  warning: could not delete probe object {path}: delete it by hand")
    slots = md["state_slots"]
    lines += ["", "model (given)",
              f"  {_count(md['params'])} parameters, {md['optimizer']} ({slots} state slot{'s' * (slots != 1)}), "
              f"step {_dur(md['step_s'])}, codec {md['codec_description']}",
              f"  base {_size(md['base_bytes'])} (fp32 weights + optimizer state), step record "
              f"{_size(md['record_bytes'])}, stored {_size(md['diff_bytes'])} per step "
              + ("(zstd ratio of a bf16 sample)" if md["diff_bytes"] != md["record_bytes"] else "(uncompressed)"),
              f"  MTBF {_dur(opt['mtbf_s'])}, max overhead {_pct(opt['max_overhead'])}, RTO "
              f"{'none' if opt['rto_s'] is None else _dur(opt['rto_s'])}, writer memory "
              f"{_size(md['memory_bytes'])}"
              + "".join(f", {k}={v} (fixed)" for k, v in opt["fixed"].items()),
              "", f"estimated on this machine ({est['device']}), not probed"]
    copy = f"{_rate(est['copy_bandwidth_bps'])} ({est['copy_bandwidth_source']}"
    copy += f", clone of {_size(COPY_PROBE_BYTES)})" if est["copy_bandwidth_source"] == "measured" else ")"
    lines += [f"  memory copy {copy}: record {_dur(est['record_s'])} per step, base copy "
              f"{_dur(est['base_capture_s'])}",
              f"  encode {_rate(1 / est['encode_s_per_byte'])} (SHA-256 {_rate(est['hash_bandwidth_bps'])}"
              + (f", zstd-1 {_rate(est['zstd_bandwidth_bps'])}" if md["codec"] != "none" else "")
              + f"), base serialize {_dur(est['base_encode_s'])}",
              f"  {md['optimizer']} step {_dur(est['optimizer_probe_s'])} on {_count(est['optimizer_probe_params'])} "
              f"parameters -> {_dur(est['optimizer_step_s'])} for {_count(md['params'])} (scaled linearly)"]
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
                     f"{c['writer_utilization']:.0%}", _size(c["memory_bytes"]),
                     "; ".join(c["violations"]) or "-"])
    lines += _table(["  every_n", "write_batch", "base_every", "loss", "overhead", "lost/failure",
                     "recovery", "worst", "writer", "memory", "violations"], rows)
    lines.append("  (* recommended)")
    return "\n".join(lines)


def _breakdown(e: dict[str, Any]) -> list[str]:
    out = [f"  expected loss {_pct(e['loss'])} of training time ({_dur(e['loss_per_day_s'])} per day): "
           f"overhead {_pct(e['overhead'])} + failures {_pct(e['failures'])}",
           f"  per failure ({e['failures_per_day']:.3g} per day): lost work {_dur(e['lost_work_s'])} expected, "
           f"recovery {_dur(e['recovery_s'])} expected, {_dur(e['worst_recovery_s'])} worst case",
           f"  a segment every {e['segment_steps']} steps, writer busy {e['writer_utilization']:.0%}, "
           f"memory {_size(e['memory_bytes'])}"]
    if e["violations"]:
        out.append("  violations: " + "; ".join(e["violations"]))
    return out


# ---------------------------------------------------------------------------- command
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
    p.add_argument("--base-every-n-steps", type=parse_base_knob, default="auto", metavar="N|none|auto",
                   help="fix this knob and tune the others")
    p.add_argument("--probe-sizes", type=parse_sizes, default=list(DEFAULT_SIZES), metavar="SIZES",
                   help="comma-separated object sizes to write (default 4KiB,1MiB,16MiB)")
    p.add_argument("--repeats", type=parse_positive, default=DEFAULT_REPEATS, metavar="N",
                   help=f"writes per size (default {DEFAULT_REPEATS}); the median counts")
    p.add_argument("--retry-budget", type=parse_duration, default=10.0, metavar="DURATION",
                   help="give up on an unreachable storage after retrying this long (default 10s)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")


def run(args: argparse.Namespace, storage_options: dict[str, Any]) -> int:
    """Run ``diffckpt tune`` with parsed ``args``; print the report."""
    model = Model(args.params, args.step_time, args.optimizer, args.codec, args.memory)
    options = TuningOptions(mtbf_s=args.mtbf, max_overhead=args.max_overhead, rto_s=args.rto)
    fixed = {"every_n_steps": args.every_n_steps, "write_batch": args.write_batch,
             "base_every_n_steps": args.base_every_n_steps}
    report = advise(args.url, model, options, storage_options=storage_options, sizes=args.probe_sizes,
                    repeats=args.repeats, retry_budget_s=args.retry_budget, device=args.device,
                    copy_bps=args.copy_bandwidth, replay_step_s=args.replay_step_time, fixed=fixed)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0

