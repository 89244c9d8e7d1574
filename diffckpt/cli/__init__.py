"""The ``diffckpt`` command: inspect, verify, export, prune and compact runs; plan settings.

- ``diffckpt ls URL``: sessions, bases and segments.
- ``diffckpt verify URL [--deep]``: every checksum and a replay (:mod:`diffckpt.cli.verify`).
- ``diffckpt export URL --step N -o FILE``: a plain checkpoint (:mod:`diffckpt.export`).
- ``diffckpt gc URL`` and ``diffckpt compact URL``: bounded storage and short restores
  (:mod:`diffckpt.cli.lifecycle`).
- ``diffckpt tune URL --params N --step-time T``: probe storage, recommend settings
  (:mod:`diffckpt.tuning.advice`).

Exit codes: 0 success, 1 damage or a failed operation, 2 usage errors and runs or steps that do
not exist.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from ..codecs import codec_from_config
from ..errors import CheckpointNotFoundError, DiffCkptError, UnsupportedConfigurationError
from ..export import FORMATS, export_checkpoint
from ..format import BaseName, decode_commit
from ..replay import replay_progress
from ..runstore import Inventory, RunStore
from ..tuning import advice
from . import lifecycle as cli_lifecycle
from . import verify as cli_verify
from .common import (
    bar,
    human,
    open_run,
    progress,
    reemit,
    storage_options,
    table,
    throughput,
    when,
)

__all__ = ["main"]


# ------------------------------------------------------------------------------ helpers
def _durable(inv: Inventory, gen: int) -> list[list[int]]:
    """Merged step intervals of session ``gen`` that a restore can reach."""
    spans = sorted((b.step, c[-1].last if (c := inv.chain(b)) else b.step)
                   for b in inv.bases if b.gen == gen)
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return merged


# ------------------------------------------------------------------------------------ ls
def _flat(options: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """``retry={"budget_s": 60}`` as ``retry.budget_s=60``, sorted."""
    out: list[tuple[str, Any]] = []
    for key, value in sorted(options.items()):
        out += _flat(value, f"{prefix}{key}.") if isinstance(value, dict) else [(f"{prefix}{key}", value)]
    return out


def _shown(key: str, value: Any, options: dict[str, Any]) -> bool:
    """Settings worth a place in ``ls``: tuning only when tuned, compaction and retention when set."""
    if key.startswith("tuning."):
        return _auto(options)
    if key in ("retention", "compact_every_n_steps"):
        return value is not None
    return key != "compact_device" or options.get("compact_every_n_steps") is not None


def _compacted(store: RunStore, base: BaseName) -> dict[str, Any] | None:
    """What a compacted base's COMMIT says about it (``None``: training wrote it, or unreadable)."""
    try:
        info = decode_commit(store.storage.read(base.commit_path), base.commit_path)
    except DiffCkptError:
        return None
    compacted = info.get("compacted")
    return compacted if isinstance(compacted, dict) else None


def _codec_name(config: dict[str, Any]) -> str:
    try:
        return codec_from_config(config).name
    except (ValueError, TypeError, KeyError):
        return str(config.get("codec"))


def _auto(options: dict[str, Any]) -> bool:
    """Whether a session left a knob to the auto-tuner (its ``tuning`` options matter then)."""
    return "auto" in (options.get("every_n_steps"), options.get("write_batch"), options.get("base_every_n_steps"))


def _every(options: dict[str, Any]) -> str:
    # With every_n_steps > 1, only every n-th step of a durable range is restorable.
    n = options.get("every_n_steps", 1)
    if n == "auto":
        return " every n (auto-tuned)"
    return f" every {n}" if isinstance(n, int) and n > 1 else ""


def _describe(store: RunStore, inv: Inventory) -> dict[str, Any]:
    """Everything ``ls`` shows, as plain JSON-able data (``--json`` prints it as is)."""
    url, sizes = store.storage.url.rstrip("/"), inv.sizes
    sessions = []
    for gen in sorted(set(inv.sessions) | {b.gen for b in inv.bases}):
        try:
            meta: dict[str, Any] = store.session_meta(gen)
        except (ValueError, DiffCkptError):
            meta = {"damaged": True}  # `verify` names it; listing the rest is still useful
        newest = inv.newest_step(gen)
        sessions.append({
            "gen": gen, "started": meta.get("started"), "resumed_from": meta.get("resumed_from"),
            "options": meta.get("options", {}), "optimizers": meta.get("optimizers", []),
            "framework": meta.get("framework"), "codec": meta.get("codec"), "durable": _durable(inv, gen),
            "newest_step": newest, "ckpt_path": None if newest is None else f"{url}/step={newest}",
            "damaged": bool(meta.get("damaged")), "tuning": store.tuning_log(gen)})
    bases: list[dict[str, Any]] = [
        {"step": b.step, "gen": b.gen, "path": b.dir,
         "bytes": sum(n for p, n in sizes.items() if p.startswith(b.dir + "/")),
         "compacted": _compacted(store, b)}
        for b in sorted(inv.bases, key=lambda b: (b.gen, b.step))]  # grouped by session
    segments: list[dict[str, Any]] = [
        {"after": s.after, "last": s.last, "gen": s.gen, "steps": s.last - s.after,
         "bytes": sizes.get(s.path, 0), "path": s.path}
        for s in sorted(inv.segments, key=lambda s: (s.gen, s.after, s.last))]
    base_bytes = sum(b["bytes"] for b in bases)
    diff_bytes = sum(s["bytes"] for s in segments)
    diff_steps = sum(s["steps"] for s in segments)
    total = sum(sizes.values())
    # What ckpt_path=<root> resumes: the newest session with a base, as RunStore.plan decides.
    newest_run = next(({"gen": g, "step": n, "ckpt_path": url} for g in inv.gens()
                       if (n := inv.newest_step(g)) is not None), None)
    avg = round(diff_bytes / diff_steps) if diff_steps else None
    return {
        "url": url, "newest": newest_run, "sessions": sessions, "bases": bases,
        "segments": segments,
        "totals": {"bytes": total, "base_bytes": base_bytes, "diff_bytes": diff_bytes,
                   "other_bytes": total - base_bytes - diff_bytes, "diff_steps": diff_steps,
                   "avg_diff_bytes_per_step": avg},
    }


def _render_ls(d: dict[str, Any]) -> str:
    url, newest, t = d["url"], d["newest"], d["totals"]
    accelerate = any(str(s["framework"] or "").startswith("accelerate") for s in d["sessions"][-1:])
    how = (f'DiffCheckpointer(accelerator, "{url}").restore("last")' if accelerate else
           f'ckpt_path="{url}" (or "last" with DiffCheckpoint)')
    lines = [f"run {url}", "no durable step yet (no committed base)" if newest is None else
             f'newest durable step {newest["step"]} (g{newest["gen"]}): {how}', "", "sessions"]
    lines += table(["gen", "started", "resumed_from", "durable", "newest", "ckpt_path"], [
        [f"g{s['gen']}", "damaged" if s["damaged"] else when(s["started"]), str(s["resumed_from"]),
         (", ".join(f"{lo}..{hi}" for lo, hi in s["durable"]) or "-") + _every(s["options"]),
         str(s["newest_step"] if s["newest_step"] is not None else "-"), s["ckpt_path"] or "-"]
        for s in d["sessions"]])
    lines += [f"  g{s['gen']} settings: " + " ".join(f"{k}={v}" for k, v in _flat(s["options"])
                                                 if _shown(k, v, s["options"]))
              + (f" codec={_codec_name(s['codec'])}" if s["codec"] else "")
              for s in d["sessions"] if s["options"]]
    lines += [f"  g{s['gen']} auto-tuned: " + "; ".join(
        f"step {t.get('step')}: " + " ".join(f"{k}={v}" for k, v in (t.get("settings") or {}).items())
        for t in s["tuning"]) for s in d["sessions"] if s.get("tuning")]
    lines += ["", "bases"] + table(["step", "gen", "size", "path"], [
        [str(b["step"]), f"g{b['gen']}", human(b["bytes"]), b["path"]] for b in d["bases"]])
    lines += [f"  compacted: {b['step']} (g{b['gen']}) from base {c.get('from_base')}, "
              + (f"verified at step {b['step']}" if c.get("verified_through") == b["step"] else
                 f"fingerprints matched through step {c.get('verified_through')}")
              for b in d["bases"] if (c := b["compacted"])]
    lines += ["", "segments"] + table(["after..last", "gen", "steps", "size", "path"], [
        [f"{s['after']}..{s['last']}", f"g{s['gen']}", str(s["steps"]), human(s["bytes"]),
         s["path"]] for s in d["segments"]])
    lines += ["", "totals"] + [f"  {label:<10}  {human(t[key])} ({t[key]} B)" for label, key in
                               (("on storage", "bytes"), ("bases", "base_bytes"))]
    diffs = f"{human(t['diff_bytes'])} ({t['diff_bytes']} B)"
    if t["diff_steps"]:
        avg = human(t["avg_diff_bytes_per_step"])
        diffs += f" over {t['diff_steps']} steps, {avg} per step"
    lines += [f"  diffs       {diffs}",
              f"  other       {human(t['other_bytes'])} ({t['other_bytes']} B)", "",
              "resume any durable step N with " + (
                  "DiffCheckpointer(...).restore(N)" if accelerate else f'ckpt_path="{url}/step=N"')]
    return "\n".join(lines)


def _cmd_ls(args: argparse.Namespace) -> int:
    d = _describe(*open_run(args)[:2])
    print(json.dumps(d, indent=2) if args.json else _render_ls(d))
    return 0


# -------------------------------------------------------------------------------- export
def _cmd_export(args: argparse.Namespace) -> int:
    store, _, step = open_run(args)
    progress(f"replaying step {'newest' if step is None else step}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        done = export_checkpoint(store.storage, args.output, step, format=args.format, device=args.device,
                                 verify=not args.no_verify, allow_modules=tuple(args.allow_module))
    progress()
    reemit(caught)
    if args.json:
        print(json.dumps(done, indent=2))
        return 0
    print(f"wrote {args.output}: step {done['step']} ({done['format']}, {human(done['bytes'])}, "
          f"{done['bytes']} B; base {done['base_step']} + {done['replayed']} replayed steps)")
    print(throughput(done["replayed"], done["replay_s"]))
    return 0


# ---------------------------------------------------------------------------------- tune
def _cmd_tune(args: argparse.Namespace) -> int:
    return advice.run(args, storage_options(args.storage_option))


# ---------------------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diffckpt", description="Inspect, verify and export diffckpt runs; plan their settings.",
        epilog="exit codes: 0 ok, 1 damage or failed operation, 2 usage error, no such run/step")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("url", metavar="URL",
                        help="run root (local path or fsspec URL); <URL>/step=N names a step")
    common.add_argument("-O", "--storage-option", action="append", default=[], metavar="KEY=VALUE",
                        help="fsspec storage option (repeatable; VALUE may be JSON)")
    common.add_argument("--retry-budget", type=float, default=60.0, metavar="SECONDS",
                        help="how long transient storage failures are retried (default 60)")
    replaying = argparse.ArgumentParser(add_help=False)
    replaying.add_argument("--step", type=int, help="step to rebuild (default: newest durable)")
    replaying.add_argument("--allow-module", action="append", default=["torch."], metavar="MODULE",
                           help="also import optimizer classes from MODULE (default: torch.)")
    replaying.add_argument("--device", default="cpu",
                           help="replay on this device; use the device type training ran on (e.g. cuda) "
                                "for a bit-exact result")
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print JSON for scripts")

    p = sub.add_parser("ls", parents=[common, as_json], help="list sessions, bases and segments")
    p.set_defaults(func=_cmd_ls)
    p = sub.add_parser("verify", parents=[common, replaying, as_json],
                       help="check every checksum and replay a step with its fingerprints")
    p.add_argument("--deep", action="store_true",
                   help="also replay every segment once and check that each base equals the replay "
                        "of the one before")
    p.set_defaults(func=cli_verify.cmd_verify)
    p = sub.add_parser("export", parents=[common, replaying, as_json], help="write a step as a checkpoint")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="file or URL to write")
    p.add_argument("--format", choices=FORMATS,
                   help="default from FILE: .ckpt lightning, .safetensors safetensors, else torch")
    p.add_argument("--no-verify", action="store_true", help="skip the fingerprint checks")
    p.set_defaults(func=_cmd_export)
    p = sub.add_parser("gc", parents=[common, as_json],
                       help="delete what a retention policy no longer keeps (dry run unless --apply)")
    cli_lifecycle.add_gc_arguments(p)
    p.set_defaults(func=cli_lifecycle.cmd_gc)
    p = sub.add_parser("compact", parents=[common, as_json],
                       help="roll a base forward from stored diffs (no training process needed)")
    cli_lifecycle.add_compact_arguments(p)
    p.set_defaults(func=cli_lifecycle.cmd_compact)
    p = sub.add_parser("tune", help="probe storage and recommend every_n_steps, write_batch, base_every_n_steps")
    advice.add_arguments(p)
    p.set_defaults(func=_cmd_tune)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``diffckpt`` command line and return its exit code.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        0 on success, 1 when damage is found or an operation fails, 2 on usage errors and when
        the run or step does not exist.
    """
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits; in-process callers want a return code
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    try:
        with replay_progress(lambda done, total: bar(done, total, "replaying", unit="steps")):
            return int(args.func(args))
    except (CheckpointNotFoundError, UnsupportedConfigurationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except DiffCkptError as exc:
        # The library names its option; on the command line it is a flag.
        print(f"error: {str(exc).replace('RetryPolicy.budget_s sets', '--retry-budget sets')}", file=sys.stderr)
        return 1
    except json.JSONDecodeError as exc:  # session and run files carry no checksum of their own
        print(f"error: a JSON file of the run is damaged: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # `diffckpt ls URL | head` closed stdout: stop quietly, as a SIGPIPE would.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
