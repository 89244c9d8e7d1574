"""What every ``diffckpt`` subcommand shares: opening the run named on the command line, times,
tables and progress on the terminal (sizes and rates: :mod:`diffckpt.units`)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings
from datetime import datetime, timezone
from typing import Any

from tqdm import tqdm

from ..errors import CheckpointNotFoundError, UnsupportedConfigurationError
from ..inventory import Inventory
from ..runstore import RUN_FILE, RunStore
from ..storage import RetryPolicy, open_storage

__all__ = ["Progress", "open_run", "progress", "reemit", "split_target", "storage_options", "table", "throughput",
           "when"]

_STEP_RE = re.compile(r"^(.*)/step=(\d+)$")


def progress(text: str = "") -> None:
    """Show ``text`` on one refreshed stderr line (``""`` clears it), only on a terminal."""
    # Not when redirected: scripted and tested output stays deterministic.
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K" + text[:120])
        sys.stderr.flush()


class Progress:
    """A progress bar with rate and ETA on stderr (tqdm), shown only when stderr is a terminal:
    redirected output and ``--json`` stay clean. A count that starts again at 0 starts a new bar
    (``verify`` replays from each base in turn)."""

    def __init__(self, label: str, unit: str = "it") -> None:
        self.label, self.unit = label, unit
        self._bar: tqdm[Any] | None = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update_to(self, done: int, total: int, detail: str = "") -> None:
        """``done`` of ``total`` finished; ``detail`` (a path) shown after the bar."""
        if not sys.stderr.isatty():
            return
        if self._bar is None or done < self._bar.n:
            self.close()
            progress()  # clear a status line left by progress()
            self._bar = tqdm(total=total, desc=self.label, unit=self.unit, file=sys.stderr, leave=False,
                             dynamic_ncols=True)
        self._bar.total = total
        self._bar.n = done
        if detail:
            self._bar.set_postfix_str(detail[-60:], refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def throughput(steps: int, seconds: float) -> str:
    """``replay: 24 steps in 0.01 s (1700 steps/s)`` for the text output of replaying commands;
    ``""`` when nothing was replayed (the step is a base, which the command's own line says)."""
    if not steps:
        return ""
    rate = f" ({steps / seconds:.0f} steps/s)" if seconds > 0 else ""
    return f"replay: {steps} step{'s' * (steps != 1)} in {seconds:.2f} s{rate}"


def reemit(caught: list[warnings.WarningMessage]) -> list[str]:
    """Print warnings caught during a replay; return diffckpt's own (damage met on the way)."""
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    return [str(w.message) for w in caught if str(w.message).startswith("diffckpt")]


def when(ts: Any) -> str:
    # UTC, so that listings compare across machines and time zones.
    if not isinstance(ts, (int, float)):
        return "?"
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """Rows under headers, columns aligned, each line indented by two spaces."""
    rows = [headers, *rows]
    # The last column is not padded: it holds paths, whose length must not shift the others.
    widths = [max(len(r[i]) for r in rows) for i in range(len(headers) - 1)]
    return ["  " + "  ".join([*map(str.ljust, r[:-1], widths), r[-1]]).rstrip() for r in rows]


def split_target(url: str) -> tuple[str, int | None]:
    """Accept what ``ls`` prints as ckpt_path: the root, ``<root>/step=N``, ``<root>/run.json``."""
    url = url.rstrip("/") or url
    if (m := _STEP_RE.match(url)) is not None:
        return m[1], int(m[2])
    return url.removesuffix("/" + RUN_FILE), None


def storage_options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UnsupportedConfigurationError(f"--storage-option wants KEY=VALUE, got {pair!r}")
        try:  # numbers, booleans and nested dicts (client_kwargs) arrive as JSON
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def open_run(args: argparse.Namespace) -> tuple[RunStore, Inventory, int | None]:
    """The run named on the command line, its inventory and the step its URL names, if any."""
    root, step = split_target(args.url)
    # Absolute, so the ckpt_path that `ls` prints works from any working directory.
    root = root if "://" in root else os.path.abspath(root)
    # Storage errors name the setting that bounds retries; on the command line it is the flag.
    retry = RetryPolicy(budget_s=args.retry_budget, max_backoff_s=min(10.0, max(0.2, args.retry_budget / 4)),
                        budget_setting="--retry-budget")
    store = RunStore(open_storage(root, retry=retry, **storage_options(args.storage_option)))
    inv = store.inventory()
    if not (inv.bases or inv.sessions or store.is_run()):
        raise CheckpointNotFoundError(
            f"no diffckpt run under {root}: it holds no {RUN_FILE}, sessions or bases. Pass the "
            "dirpath given to DiffCheckpoint (a local path or fsspec URL)")
    return store, inv, args.step if getattr(args, "step", None) is not None else step
