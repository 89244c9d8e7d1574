"""Host microbenchmarks for planning: memory-copy bandwidth, checksum (XXH3-128) and zstd speed,
and the time of one real optimizer step, measured on this machine (:func:`measure_host`).

``diffckpt tune`` runs before any training, so it times these small stand-ins for what the
engine and the writer do to every byte of a step's record and of a base.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..checksums import CURRENT
from ..errors import UnsupportedConfigurationError
from ..units import MiB

__all__ = ["COPY_PROBE_BYTES", "HostCosts", "measure_host"]

COPY_PROBE_BYTES = 64 * MiB  # tensor cloned to measure memory-copy bandwidth
HASH_PROBE_BYTES = 16 * MiB
ZSTD_PROBE_BYTES = 4 * MiB
OPTIMIZER_PROBE_PARAMS = 1 << 22  # parameters of the timed optimizer step (~4.2M)


def _median_time(fn: Callable[[], object], repeats: int, sync: Callable[[], None] | None = None) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if sync is not None:  # CUDA work is asynchronous: wait for it, or only the launch is timed
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
    """Time a tensor clone, the checksum the writer computes (XXH3-128), zstd level 1 and one
    real optimizer step on ``device``."""
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
    hash_s = _median_time(lambda: CURRENT.digest(buf), 2)
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
