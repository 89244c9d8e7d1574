"""``diffckpt gc URL``: show what a retention policy would delete (the policy given on the command
line, else the one the run's newest session recorded) and delete it only with ``--apply``."""

from __future__ import annotations

import argparse
import json
import os
import posixpath
import sys
from typing import Any

from ..lifecycle.retention import GcPlan, RetentionPolicy, apply_gc, plan_gc, recorded_policy
from ..localtier import LocalTier, read_local_tier
from ..shardedrun import ShardedRun
from ..units import format_bytes, parse_age, parse_duration, parse_positive
from .common import Progress, open_run, table

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``gc`` command's own arguments: the run (or ``--local``), a retention policy, the age of
    leftovers, ``--apply``."""
    p.add_argument("url", metavar="URL", nargs="?",
                   help="run root (local path or fsspec URL); omit it with --local")
    p.add_argument("--local", action="store_true",
                   help="instead of one run: this host's node-local tier, every run at once (journals and "
                        "spools no resume can use, and what dead processes left)")
    p.add_argument("--keep-last-bases", type=parse_positive, metavar="N",
                   help="keep the N newest bases and every step from the oldest of them on")
    p.add_argument("--keep-every-n-steps", type=parse_positive, metavar="K",
                   help="keep one restorable step per K steps (a base in the window if any)")
    p.add_argument("--keep-newer-than", type=parse_duration, metavar="AGE",
                   help="keep everything written within AGE (e.g. 12h, 7d)")
    p.add_argument("--min-age", type=parse_age, default=3600.0, metavar="AGE",
                   help="remove leftovers of interrupted writes once this old (default 1h)")
    p.add_argument("--local-dir", default="auto", metavar="DIR",
                   help="also remove this host's journals of the run (its node-local tier, "
                        "CheckpointOptions.local_dir) that no resume can use; 'none' to leave them (default: auto)")
    p.add_argument("--apply", action="store_true", help="delete (default: dry run, only show what would go)")


def _policy(args: argparse.Namespace, store: Any) -> tuple[RetentionPolicy, str]:
    given = {"keep_last_bases": args.keep_last_bases, "keep_every_n_steps": args.keep_every_n_steps,
             "keep_newer_than_s": args.keep_newer_than}
    if any(v is not None for v in given.values()):
        return RetentionPolicy(**given, min_age_s=args.min_age), "given"
    recorded = recorded_policy(store)
    if recorded is None:
        return RetentionPolicy(min_age_s=args.min_age), "none given or recorded: every step is kept"
    return recorded, "recorded by the run's newest session"


def _describe_policy(policy: RetentionPolicy) -> str:
    parts = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in
             (("keep_last_bases", policy.keep_last_bases), ("keep_every_n_steps", policy.keep_every_n_steps),
              ("keep_newer_than_s", policy.keep_newer_than_s), ("min_age_s", policy.min_age_s)) if v is not None]
    return " ".join(parts)


def _render_gc(plan: GcPlan, policy: RetentionPolicy, source: str, applied: bool) -> str:
    head = "" if applied else " (dry run: nothing deleted; pass --apply to delete)"
    lines = [f"gc {plan.url}{head}", f"policy: {_describe_policy(policy)} ({source})", "", "kept restorable steps"]
    subs = [("", plan), *plan.streams.items()]
    lines += table(["stream", "steps", "gen", "why"] if plan.streams else ["steps", "gen", "why"],
                   [([prefix.rstrip("/") or "."] if plan.streams else [])
                    + [f"{k.base}..{k.step}" if k.base < k.step else str(k.step), f"g{k.gen}", "; ".join(k.reasons)]
                    for prefix, sub in subs for k in sub.kept])
    verb = "deleted" if applied else "would delete"
    lines += ["", f"{verb} {plan.objects} object{'s' * (plan.objects != 1)}, "
                  f"{format_bytes(plan.bytes)} ({plan.bytes} B)"]
    rows = []
    for prefix, sub in subs:
        rows += [[f"base {b.step} (g{b.gen})", format_bytes(sum(sub.sizes.get(p, 0) for p in sub.base_files[b])),
                  prefix + b.dir] for b in sub.bases]
        rows += [["segment", format_bytes(sub.sizes.get(s.path, 0)), prefix + s.path] for s in sub.segments]
        rows += [[x.kind, format_bytes(x.size), prefix + x.path] for x in sub.leftovers]
    if rows:
        lines += table(["what", "size", "path"], rows)
    for path in [prefix + p for prefix, sub in subs for p in sub.kept_beyond_gaps]:
        lines.append(f"note: kept {path}: it lies beyond a gap in its session's chain (restores cannot "
                     "reach it); delete it by hand once the missing segment is gone for good")
    return "\n".join(lines)


def _local_tiers(args: argparse.Namespace, store: Any) -> list[LocalTier]:
    """What this host's journals hold of the run's streams (root and ranks)."""
    if args.local_dir == "none":
        return []
    run = ShardedRun(store.storage)
    ranks = sorted({int(p.split("/")[1][1:]) for p in store.storage.list("ranks/") if p.count("/") >= 2
                    and p.split("/")[1][1:].isdigit()})
    return [read_local_tier(s, args.local_dir, fence=store.storage) for s in [store] + [run.stream(r) for r in ranks]]


def _spare(plan: GcPlan, spools: set[str]) -> None:
    """Keep the spools on a local run root that a resume on this host can still take back."""
    for sub in [plan, *plan.streams.values()]:
        sub.leftovers = [x for x in sub.leftovers if posixpath.basename(x.path) not in spools]


def run(args: argparse.Namespace) -> int:
    """Plan what the policy no longer keeps; delete it with ``--apply``."""
    if args.local or args.url is None:
        if args.url is not None or not args.local:
            print("error: give a run's URL, or --local for this host's node-local tier", file=sys.stderr)
            return 2
        from .gclocal import run as run_local  # what only the host-wide sweep needs

        return run_local(args)
    store, _, _ = open_run(args)
    policy, source = _policy(args, store)
    plan = plan_gc(store, policy)
    tiers = _local_tiers(args, store)
    # journals no resume can use go; the spools of those a resume can use stay, however old
    journals = [j for t in tiers for j in t.stale + (t.used if t.step is None else [])]
    _spare(plan, {os.path.basename(j.spool) for t in tiers if t.step is not None for j in t.used})
    if args.apply and plan.objects:
        with Progress("deleting", unit="file") as bar:
            apply_gc(store, plan, bar.update_to)
        plan.applied = True
    if args.apply:
        for journal in journals:
            journal.remove()
    if args.json:
        print(json.dumps({**plan.to_json(), "policy": _describe_policy(policy),
                          "local_journals": [j.path for j in journals]}, indent=2))
    else:
        text = _render_gc(plan, policy, source, plan.applied)
        if journals:
            verb = "deleted" if args.apply else "would delete"
            text += (f"\n{verb} {len(journals)} journal{'s' * (len(journals) != 1)} of this host's local tier "
                     "that no resume can use (a superseded session's, or already in the run root):\n"
                     + "\n".join(f"  {j.path}" for j in journals))
        print(text)
    return 0
