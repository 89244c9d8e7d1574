"""``diffckpt gc --local``: this host's node-local tier, every run at once.

``gc URL`` cleans the journals of one run; journals of runs never resumed on this host, or whose
URL nobody remembers, would stay in ``local_dir`` forever. This sweep needs no URL: it removes
what is provably dead (spools no journal names, journals killed before their header, each only
once no process holds its lock), and for each journal of a dead writer it asks the run root its
header names whether a resume could still take it back. A journal whose run root says no (a later
session superseded it, the run root already holds its records, the run is gone) goes; one a
resume can use, one still being written, and one whose run root cannot be reached, stay.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import defaultdict
from typing import Any

from ..errors import DiffCkptError
from ..journal import remove_folder, resolve_local_dir
from ..journalfile import JournalFile, read_journal, stream_folders, sweep
from ..localtier import LocalTier, read_local_tier
from ..runstore import RunStore
from ..storage import open_storage
from ..storage.retry import RetryPolicy
from .common import storage_options, table

__all__ = ["run"]

_RANK_STREAM = re.compile(r"^(?P<root>.+)/ranks/r\d+/?$")


def run(args: argparse.Namespace) -> int:
    """Sweep this host's local tier (see the module); delete only with ``--apply``."""
    if args.local_dir == "none":
        print("error: --local needs a local folder (--local-dir DIR, or the default 'auto')")
        return 2
    local_dir = resolve_local_dir(args.local_dir)
    retry = RetryPolicy(budget_s=args.retry_budget, max_backoff_s=min(10.0, max(0.2, args.retry_budget / 4)),
                        budget_setting="--retry-budget")
    options = storage_options(args.storage_option)
    rows: list[dict[str, Any]] = []
    for folder in stream_folders(local_dir):
        rows += [{"path": p, "url": None, "status": "dead leftover"} for p in sweep(folder, args.apply)]
        by_url: dict[str, list[JournalFile]] = defaultdict(list)
        for name in sorted(os.listdir(folder)):
            journal = read_journal(os.path.join(folder, name)) if name.endswith(".journal") else None
            if journal is not None:
                by_url[journal.url].append(journal)
        for url, found in by_url.items():
            rows += _judge(url, found, local_dir, args.apply, retry, options)
        if args.apply:
            remove_folder(folder)
    removed = [r for r in rows if r["status"] in ("dead leftover", "no resume can use it")]
    if args.json:
        print(json.dumps({"local_dir": local_dir, "applied": bool(args.apply), "entries": rows}, indent=2))
        return 0
    verb = "removed" if args.apply else "would remove"
    head = "" if args.apply else " (dry run: nothing deleted; pass --apply to delete)"
    lines = [f"gc --local {local_dir}{head}"]
    if rows:
        lines += table(["status", "run", "path"], [[r["status"], r["url"] or "-", r["path"]] for r in rows])
    lines.append(f"{verb} {len(removed)} file{'s' * (len(removed) != 1)} of this host's local tier")
    print("\n".join(lines))
    return 0


def _judge(url: str, found: list[JournalFile], local_dir: str, apply: bool, retry: RetryPolicy,
           options: dict[str, Any]) -> list[dict[str, Any]]:
    """What becomes of the journals of the stream at ``url`` (the run root decides)."""
    def rows(status: str, journals: list[JournalFile]) -> list[dict[str, Any]]:
        return [{"path": j.path, "url": url, "gen": j.gen, "status": status,
                 "steps": [j.entries[0]["step"], j.entries[-1]["step"]] if j.entries else None} for j in journals]

    root = _RANK_STREAM.match(url)
    try:
        store = RunStore(open_storage(url, retry=retry, **options))
        fence = open_storage(root["root"], retry=retry, **options) if root else None
        tier: LocalTier = read_local_tier(store, local_dir, fence, claim=apply)
    except (DiffCkptError, OSError) as exc:
        return rows(f"kept: its run root cannot be read ({type(exc).__name__}: {exc})", found)
    try:
        useless = tier.stale + (tier.used if tier.step is None else [])
        usable = [] if tier.step is None else tier.used
        if apply:
            for journal in useless:
                journal.remove()
        taken = f"kept: a resume on this host takes back steps {(tier.after or 0) + 1}..{tier.step}"
        return (rows("no resume can use it", useless) + rows(taken, usable)
                + rows("kept: in use", [j for j in tier.live if j.pid != os.getpid()])
                + rows("kept: another host's", [j for j in found if not j.local]))
    finally:
        tier.release()
