"""``diffckpt gc`` and ``diffckpt compact``: keep a run's storage bounded and its restores short.

``gc`` shows what a retention policy would delete and deletes it only with ``--apply``;
``compact`` rolls a base forward from stored diffs, from any process or machine.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..lifecycle.compaction import compact
from ..lifecycle.retention import GcPlan, RetentionPolicy, apply_gc, plan_gc, recorded_policy
from ..tuning import advice
from .common import bar, human, open_run, progress, table, throughput

__all__ = ["add_compact_arguments", "add_gc_arguments", "cmd_compact", "cmd_gc"]


# ------------------------------------------------------------------------------------ gc
def add_gc_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep-last-bases", type=advice.parse_positive, metavar="N",
                   help="keep the N newest bases and every step from the oldest of them on")
    p.add_argument("--keep-every-n-steps", type=advice.parse_positive, metavar="K",
                   help="keep one restorable step per K steps (a base in the window if any)")
    p.add_argument("--keep-newer-than", type=advice.parse_duration, metavar="AGE",
                   help="keep everything written within AGE (e.g. 12h, 7d)")
    p.add_argument("--min-age", type=_age, default=3600.0, metavar="AGE",
                   help="remove leftovers of interrupted writes once this old (default 1h)")
    p.add_argument("--apply", action="store_true", help="delete (default: dry run, only show what would go)")


def _age(text: str) -> float:
    """A duration that may be zero (remove every leftover now, when no writer is at work)."""
    return 0.0 if text.strip().rstrip("smhd") in ("0", "0.0") else advice.parse_duration(text)


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
    lines += table(["steps", "gen", "why"], [[f"{k.base}..{k.step}" if k.base < k.step else str(k.step),
                                              f"g{k.gen}", "; ".join(k.reasons)] for k in plan.kept])
    verb = "deleted" if applied else "would delete"
    lines += ["", f"{verb} {plan.objects} object{'s' * (plan.objects != 1)}, {human(plan.bytes)} ({plan.bytes} B)"]
    rows = [[f"base {b.step} (g{b.gen})", human(sum(plan.sizes.get(p, 0) for p in plan.base_files[b])), b.dir]
            for b in plan.bases]
    rows += [["segment", human(plan.sizes.get(s.path, 0)), s.path] for s in plan.segments]
    rows += [[x.kind, human(x.size), x.path] for x in plan.leftovers]
    if rows:
        lines += table(["what", "size", "path"], rows)
    for path in plan.kept_beyond_gaps:
        lines.append(f"note: kept {path}: it lies beyond a gap in its session's chain (restores cannot "
                     "reach it); delete it by hand once the missing segment is gone for good")
    return "\n".join(lines)


def cmd_gc(args: argparse.Namespace) -> int:
    store, _, _ = open_run(args)
    policy, source = _policy(args, store)
    plan = plan_gc(store, policy)
    if args.apply and plan.objects:
        apply_gc(store, plan, lambda i, n, path: bar(i, n, "deleting", path))
        plan.applied = True
        progress()
    if args.json:
        print(json.dumps({**plan.to_json(), "policy": _describe_policy(policy)}, indent=2))
    else:
        print(_render_gc(plan, policy, source, plan.applied))
    return 0


# ------------------------------------------------------------------------------- compact
def add_compact_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--to", type=int, metavar="STEP",
                   help="step to write a base at (a segment end; default: the newest durable step)")
    p.add_argument("--device", default="cpu",
                   help="replay on this device; use the device type training ran on for a bit-exact base")
    p.add_argument("--allow-module", action="append", default=["torch."], metavar="MODULE",
                   help="also import optimizer classes from MODULE (default: torch.)")


def cmd_compact(args: argparse.Namespace) -> int:
    store, _, step = open_run(args)
    to = args.to if args.to is not None else step
    progress(f"replaying to step {'newest' if to is None else to}")
    result = compact(store.storage, to, device=args.device, allow_modules=tuple(args.allow_module))
    progress()
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return 0
    path = f"bases/{result.step:012d}.g{result.gen:06d}"
    if not result.written:
        print(f"step {result.step} of g{result.gen} already has a base ({path}); nothing to do")
        return 0
    print(f"compacted step {result.step} of g{result.gen} from base {result.from_base}: replayed "
          f"{result.replayed} steps; wrote {path} ({human(result.bytes)})")
    print(throughput(result.replayed, result.replay_s))
    if result.verified_at_step:
        print(f"verified: it matches the fingerprint recorded in training at step {result.step}")
    elif result.verified_through is not None:
        print(f"verified: replay matched the fingerprints recorded in training through step "
              f"{result.verified_through}; step {result.step} itself has none (fingerprint_every_n_steps)")
    else:
        print("not verified: the run recorded no fingerprints on this chain")
    return 0

