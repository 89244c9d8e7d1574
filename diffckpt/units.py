"""Units for people: parsers for what they type (counts, sizes, durations, fractions) and
formatters for what they read (bytes, rates, durations, shares, counts).

One convention for bytes, IEC as ``ls`` uses (B, KiB, MiB, GiB, TiB), so a size reads the same
in ``diffckpt ls``, ``diffckpt tune`` and the auto-tuner's log. The parsers raise
:class:`argparse.ArgumentTypeError`, which argparse reports as a usage error (exit 2).
"""

from __future__ import annotations

import argparse
import math
import re

__all__ = [
    "DAY", "GiB", "KiB", "MiB", "TiB",
    "format_bytes", "format_count", "format_duration", "format_percent", "format_rate",
    "parse_age", "parse_count", "parse_duration", "parse_fraction", "parse_positive", "parse_size",
]

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
DAY = 86400.0

# ------------------------------------------------------------------------------ parsing
_NUM = r"(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?"
_COUNT_UNITS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
# K, M, G, T alone are binary (what people mean by "16M" of memory); kB, MB... are decimal, as
# storage vendors quote them.
_SIZE_UNITS = {"": 1, "b": 1, "k": KiB, "m": MiB, "g": GiB, "t": TiB,
               "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
               "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB}
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


def parse_age(text: str) -> float:
    """A duration that may be zero (``0``, ``0s``): how old something must be before it goes."""
    return 0.0 if text.strip().lower().rstrip("smhd") in ("0", "0.0") else parse_duration(text)


def parse_size(text: str) -> int:
    """Bytes: ``4096``, ``4KiB``, ``16M`` (K, M, G alone are binary), ``1GB`` (decimal).

    A trailing ``/s`` is accepted, so the same parser reads bandwidths."""
    s = text.strip().lower().removesuffix("/s")
    m = re.fullmatch(rf"{_NUM}\s*([a-z]*)", s)
    if m is None or m[3] not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 4KiB, 16MiB, 1GB)")
    value = round(_number(m) * _SIZE_UNITS[m[3]])
    if value < 1:
        raise argparse.ArgumentTypeError(f"the size must be at least one byte, got {text!r}")
    return value


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
    """A positive integer."""
    try:
        value = int(text.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a positive integer: {text!r}")
    return value


# ---------------------------------------------------------------------------- formatting
def format_bytes(n: float) -> str:
    """``512 B``, ``4.0 KiB``, ``1.4 GiB``: powers of 1024 with IEC names."""
    if n < KiB:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= KiB
        if n < KiB or unit == "TiB":
            break
    return f"{n:.1f} {unit}"


def format_rate(bytes_per_s: float) -> str:
    """``118.3 MiB/s``: a bandwidth in the units of :func:`format_bytes`."""
    return f"{format_bytes(bytes_per_s)}/s"


def format_duration(s: float) -> str:
    """``250 us``, ``12.5 ms``, ``3.2 s``, ``45 min``, ``6 h``, ``7 d``: three significant digits."""
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


def format_percent(x: float) -> str:
    """A share as a percentage: two decimals below 10%, where small differences matter."""
    return f"{x:.2%}" if x < 0.1 else f"{x:.1%}"


def format_count(n: int) -> str:
    """``125M``, ``1.3B``: the notation :func:`parse_count` reads."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return str(n)
