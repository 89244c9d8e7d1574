"""The storage probe: timed writes of random objects under ``_probe/`` (:func:`probe_storage`), the
write-cost fit ``seconds = latency + bytes / bandwidth`` (:func:`fit_write_cost`), and the probe of
a storage location by URL for ``diffckpt tune`` (:func:`probe`).

Training probes its storage once per session to seed the :class:`~diffckpt.tuning.meter.Meter`;
``diffckpt tune`` probes a location before any run exists.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import StorageError, StorageUnavailableError, UnsupportedConfigurationError
from ..storage import RetryPolicy, open_storage
from ..storage.nodelocal import local_path  # re-exported: it was defined here
from ..units import KiB, MiB

__all__ = ["DEFAULT_REPEATS", "DEFAULT_SIZES", "PROBE_PREFIX", "PROBE_RETRY", "fit_write_cost", "local_path",
           "probe", "probe_storage"]

PROBE_PREFIX = "_probe"
PROBE_SIZES = (1 << 10, 1 << 20)  # what training writes to seed its bandwidth estimate
DEFAULT_BANDWIDTH = 100e6  # bytes/s assumed until writes of different sizes have been timed
DEFAULT_SIZES = (4 * KiB, 1 * MiB, 16 * MiB)  # what `diffckpt tune` writes
DEFAULT_REPEATS = 3
# `diffckpt tune` waits for an answer: give up on an unreachable storage sooner than training does.
PROBE_RETRY = RetryPolicy(budget_s=10.0, initial_backoff_s=0.1, max_backoff_s=1.0)


def fit_write_cost(samples: Sequence[tuple[int, float]], prior_bandwidth: float | None = None) -> tuple[float, float]:
    """Fit ``seconds = latency + bytes / bandwidth`` to ``(bytes, seconds)`` samples.

    Least squares when the sizes differ enough (the largest at least twice the smallest and
    4 KiB apart); otherwise the bandwidth is ``prior_bandwidth`` (or ``DEFAULT_BANDWIDTH``) and
    the latency is what remains. Returns ``(latency_s, bandwidth_bps)``.
    """
    if not samples:
        raise ValueError("no write samples to fit")
    sizes = [float(s) for s, _ in samples]
    times = [float(t) for _, t in samples]
    n = len(samples)
    ms, mt = sum(sizes) / n, sum(times) / n
    if max(sizes) >= 2 * min(sizes) and max(sizes) - min(sizes) >= 4096:
        var = sum((s - ms) ** 2 for s in sizes)
        slope = sum((s - ms) * (t - mt) for s, t in zip(sizes, times, strict=True)) / var
        if slope > 0:
            latency = max(0.0, mt - slope * ms)
            return latency, 1.0 / slope
    bandwidth = prior_bandwidth or DEFAULT_BANDWIDTH
    latency = max(0.0, mt - ms / bandwidth)
    return latency, bandwidth


def probe_storage(storage: Any, sizes: Sequence[int] = PROBE_SIZES, repeats: int = 2,
                  prefix: str = PROBE_PREFIX,
                  on_sample: Callable[[int, float], None] | None = None) -> list[tuple[int, float]]:
    """Time writes of a few object sizes to ``storage`` (under ``prefix``, removed after).

    Returns ``(bytes, seconds)`` per write, for :func:`fit_write_cost`; ``on_sample`` gets each
    one as soon as it is measured. The data is random so that compression on the way cannot
    flatter the figures.
    """
    samples = []
    tag = uuid.uuid4().hex[:12]
    written = []
    try:
        for r in range(repeats):
            for size in sizes:
                path = f"{prefix}/{tag}-{r}-{size}"
                data = os.urandom(size)
                start = time.perf_counter()
                storage.write(path, data)
                samples.append((size, time.perf_counter() - start))
                written.append(path)
                if on_sample is not None:
                    on_sample(*samples[-1])
    finally:
        for path in written:
            try:
                storage.delete(path)
            except Exception:  # a leftover probe object is harmless; the probe's result is not
                pass
    return samples


def probe(url: str, storage_options: dict[str, Any], sizes: Sequence[int], repeats: int,
          retry: RetryPolicy = PROBE_RETRY) -> dict[str, Any]:
    """Time writes of ``sizes`` to ``url`` (``repeats`` each, after one warm-up write) and fit
    their cost. Objects go under ``_probe/tune-<id>/`` and are deleted; on a local disk the
    directories the probe created are removed too, so the location is left as it was found."""
    try:
        storage = open_storage(url, retry=retry, **storage_options)
    except UnsupportedConfigurationError:  # it names the URL already
        raise
    except (ValueError, ImportError, TypeError) as exc:
        raise UnsupportedConfigurationError(f"cannot open {url}: {exc}") from exc
    prefix = f"{PROBE_PREFIX}/tune-{uuid.uuid4().hex[:12]}"
    local = local_path(url)
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
        # The storage layer words its fixes for DiffCheckpoint(dirpath=...); here it is a URL.
        why = str(exc).replace("dirpath", "the URL")
        if isinstance(exc, StorageUnavailableError) and retry.budget_setting not in why:
            why += f" ({retry.budget_setting} sets how long to retry)"  # given up without saying so
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
    # Medians: one slow request (a new connection, a hiccup) must not tilt the fit.
    medians = [(size, statistics.median(t for s, t in samples if s == size)) for size in sorted(set(sizes))]
    table = [{"bytes": size, "median_s": med, "mb_per_s": size / max(med, 1e-12) / 1e6}
             for size, med in medians]
    latency, bandwidth = fit_write_cost(medians)
    return {"url": url, "prefix": prefix, "sizes": list(sizes), "repeats": repeats,
            "samples": [[s, t] for s, t in samples], "table": table,
            "latency_s": latency, "bandwidth_bps": bandwidth,
            "leftover": [f"{url.rstrip('/')}/{prefix}/{p}" for p in leftover]}
