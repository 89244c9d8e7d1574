"""The ``diffckpt`` command: inspect a run, verify every checksum, export a step, plan settings.

``diffckpt ls URL`` lists sessions, bases and segments; ``diffckpt verify URL`` checks every
object and replays a step; ``diffckpt export URL --step N -o FILE`` writes a plain checkpoint
(Lightning ``.ckpt``, ``torch`` or safetensors); ``diffckpt tune URL --params N --step-time T``
probes a storage location and recommends ``every_n_steps``, ``write_batch`` and
``base_every_n_steps`` (see :mod:`diffckpt.advice`). Exit codes: 0 success, 1 damage or a failed
operation, 2 usage errors and runs or steps that do not exist.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import json
import os
import re
import sys
import warnings
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import numpy as np
import safetensors.torch
import torch

from . import advice
from .codecs import codec_from_config
from .errors import CheckpointNotFoundError, DiffCkptError, UnsupportedConfigurationError
from .format import SegmentName, decode_segment
from .loading import load_state
from .storage import FsspecStorage, Storage, open_storage
from .store import RUN_FILE, Inventory, RunStore, session_path

__all__ = ["main"]

_STEP_RE = re.compile(r"^(.*)/step=(\d+)$")


# ------------------------------------------------------------------------------ helpers
def _progress(text: str = "") -> None:
    """Show ``text`` on one refreshed stderr line (``""`` clears it), only on a terminal."""
    # Not when redirected: scripted and tested output stays deterministic.
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K" + text[:120])
        sys.stderr.flush()


def _reemit(caught: list[warnings.WarningMessage]) -> list[str]:
    """Print warnings caught during a replay; return diffckpt's own (damage met on the way)."""
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    return [str(w.message) for w in caught if str(w.message).startswith("diffckpt")]


def _human(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"


def _when(ts: Any) -> str:
    # UTC, so that listings compare across machines and time zones.
    if not isinstance(ts, (int, float)):
        return "?"
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    rows = [headers, *rows]
    # The last column is not padded: it holds paths, whose length must not shift the others.
    widths = [max(len(r[i]) for r in rows) for i in range(len(headers) - 1)]
    return ["  " + "  ".join([*map(str.ljust, r[:-1], widths), r[-1]]).rstrip() for r in rows]


def _split_target(url: str) -> tuple[str, int | None]:
    """Accept what ``ls`` prints as ckpt_path: the root, ``<root>/step=N``, ``<root>/run.json``."""
    url = url.rstrip("/") or url
    if (m := _STEP_RE.match(url)) is not None:
        return m[1], int(m[2])
    return url.removesuffix("/" + RUN_FILE), None


def _storage_options(pairs: list[str]) -> dict[str, Any]:
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


def _open(args: argparse.Namespace) -> tuple[RunStore, Inventory, int | None]:
    """The run named on the command line, its inventory and the step its URL names, if any."""
    root, step = _split_target(args.url)
    # Absolute, so the ckpt_path that `ls` prints works from any working directory.
    root = root if "://" in root else os.path.abspath(root)
    store = RunStore(open_storage(root, **_storage_options(args.storage_option)))
    inv = store.inventory()
    if not (inv.bases or inv.sessions or store.is_run()):
        raise CheckpointNotFoundError(
            f"no diffckpt run under {root}: it holds no {RUN_FILE}, sessions or bases. Pass the "
            "dirpath given to DiffCheckpoint (a local path or fsspec URL)")
    return store, inv, args.step if getattr(args, "step", None) is not None else step


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
         "bytes": sum(n for p, n in sizes.items() if p.startswith(b.dir + "/"))}
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
    lines += _table(["gen", "started", "resumed_from", "durable", "newest", "ckpt_path"], [
        [f"g{s['gen']}", "damaged" if s["damaged"] else _when(s["started"]), str(s["resumed_from"]),
         (", ".join(f"{lo}..{hi}" for lo, hi in s["durable"]) or "-") + _every(s["options"]),
         str(s["newest_step"] if s["newest_step"] is not None else "-"), s["ckpt_path"] or "-"]
        for s in d["sessions"]])
    lines += [f"  g{s['gen']} settings: " + " ".join(f"{k}={v}" for k, v in _flat(s["options"])
                                                 if not k.startswith("tuning.") or _auto(s["options"]))
              + (f" codec={_codec_name(s['codec'])}" if s["codec"] else "")
              for s in d["sessions"] if s["options"]]
    lines += [f"  g{s['gen']} auto-tuned: " + "; ".join(
        f"step {t.get('step')}: " + " ".join(f"{k}={v}" for k, v in (t.get("settings") or {}).items())
        for t in s["tuning"]) for s in d["sessions"] if s.get("tuning")]
    lines += ["", "bases"] + _table(["step", "gen", "size", "path"], [
        [str(b["step"]), f"g{b['gen']}", _human(b["bytes"]), b["path"]] for b in d["bases"]])
    lines += ["", "segments"] + _table(["after..last", "gen", "steps", "size", "path"], [
        [f"{s['after']}..{s['last']}", f"g{s['gen']}", str(s["steps"]), _human(s["bytes"]),
         s["path"]] for s in d["segments"]])
    lines += ["", "totals"] + [f"  {label:<10}  {_human(t[key])} ({t[key]} B)" for label, key in
                               (("on storage", "bytes"), ("bases", "base_bytes"))]
    diffs = f"{_human(t['diff_bytes'])} ({t['diff_bytes']} B)"
    if t["diff_steps"]:
        avg = _human(t["avg_diff_bytes_per_step"])
        diffs += f" over {t['diff_steps']} steps, {avg} per step"
    lines += [f"  diffs       {diffs}",
              f"  other       {_human(t['other_bytes'])} ({t['other_bytes']} B)", "",
              "resume any durable step N with " + (
                  "DiffCheckpointer(...).restore(N)" if accelerate else f'ckpt_path="{url}/step=N"')]
    return "\n".join(lines)


def _cmd_ls(args: argparse.Namespace) -> int:
    d = _describe(*_open(args)[:2])
    print(json.dumps(d, indent=2) if args.json else _render_ls(d))
    return 0


# -------------------------------------------------------------------------------- verify
def _check_segment(storage: Storage, seg: SegmentName) -> tuple[int, str | None]:
    """Return ``(intact records, problem)`` for one segment, checking every checksum."""
    try:
        header, records, problem = decode_segment(storage.read(seg.path), seg.path)
    except DiffCkptError as exc:
        return 0, str(exc)
    if problem is not None:
        return len(records), problem
    named = (header.get("after"), header.get("last"), header.get("gen"))
    if named != (seg.after, seg.last, seg.gen):
        return len(records), (f"{seg.path}: its header says steps {named[0]}..{named[1]} of "
                              f"g{named[2]}, not what its name says (renamed or copied?)")
    prev = seg.after
    for record in records:
        if record.get("prev") != prev:
            return len(records), f"{seg.path}: step {record.get('step')} does not follow {prev}"
        prev = record.get("step")
    if prev != seg.last:
        return len(records), f"{seg.path}: records end at step {prev}, its name says {seg.last}"
    return len(records), None


def _cmd_verify(args: argparse.Namespace) -> int:
    store, inv, step = _open(args)
    plan = store.plan(step, inv)  # a step that is not durable is a usage error (exit 2): first
    problems: list[dict[str, str]] = []

    def bad(obj: str, message: str) -> None:
        # Core messages usually start with the object's path already; do not repeat it.
        message = message.removeprefix(f"{obj}: ").removeprefix(f"{obj} ")
        problems.append({"object": obj, "problem": message})

    for gen in sorted(set(inv.sessions) | {b.gen for b in inv.bases}):  # replay needs each one
        try:
            store.session_meta(gen)
        except (ValueError, DiffCkptError) as exc:
            bad(session_path(gen), f"cannot be read: {exc}")
    committed = {b.dir for b in inv.bases}
    stray = sorted({p.rsplit("/", 1)[0] for p in inv.sizes if p.startswith("bases/")} - committed)
    total = len(inv.bases) + len(inv.segments)
    for i, base in enumerate(inv.bases):
        _progress(f"[{i + 1}/{total}] {base.dir}")
        try:
            store.load_base(base)
        except DiffCkptError as exc:
            bad(base.state_path, str(exc))
    records = 0
    for i, seg in enumerate(inv.segments):
        _progress(f"[{len(inv.bases) + i + 1}/{total}] {seg.path}")
        count, problem = _check_segment(store.storage, seg)
        records += count
        if problem is not None:
            bad(seg.path, problem)
    _progress(f"replaying step {plan.target} from base {plan.base.step}")
    replay: dict[str, Any] = {"target": plan.target, "base_step": plan.base.step}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = load_state(store.storage, step, device=args.device, allow_modules=tuple(args.allow_module))
        for message in _reemit(caught):
            bad("replay", message)
        replay.update(step=result["step"], replayed=result["replayed"])
        if result["step"] != plan.target:
            bad("replay", f"reached step {result['step']}, not the durable step {plan.target}")
    except UnsupportedConfigurationError:
        raise  # needs --allow-module: a usage matter, not damage
    except (DiffCkptError, ValueError) as exc:  # ValueError: a damaged session file
        msg = str(exc)
        bad("replay", msg if f"step {plan.target}" in msg else f"step {plan.target}: {msg}")
    _progress()
    report = {"url": store.storage.url, "ok": not problems, "bases": len(inv.bases),
              "segments": len(inv.segments), "records": records, "sessions": len(inv.sessions),
              "uncommitted": stray, "replay": replay, "problems": problems}
    if args.json:
        print(json.dumps(report, indent=2))
        return int(bool(problems))
    print(f"checked {store.storage.url}: bases {len(inv.bases)}, segments {len(inv.segments)} "
          f"({records} intact step records), sessions {len(inv.sessions)}")
    for d in stray:
        print(f"note: {d} has no COMMIT (an interrupted base write); restores ignore it")
    if "step" in replay:
        print(f"replayed step {replay['step']} from base {replay['base_step']} "
              f"({replay['replayed']} steps) with the fingerprints recorded in training checked")
    for p in problems:
        print(f"BAD {p['object']}: {p['problem']}")
    print(f"FAILED: {len(problems)} problem(s)" if problems else "OK: every checksum matches")
    return int(bool(problems))


# -------------------------------------------------------------------------------- export
def _plain(obj: Any) -> Any:
    """Replace numpy values by torch tensors and Python scalars.

    ``torch.load(weights_only=True)`` (what ``LightningModule.load_from_checkpoint`` uses) refuses
    numpy objects, and the recorded state holds some (DiffCheckpoint's numpy RNG state, for one).
    """
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj).copy())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {_plain(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    return obj


def _lightning_version() -> str:
    # Lightning's loader requires this key and runs recorded without Lightning lack it. Read it
    # from package metadata: the core never imports a framework.
    try:
        return importlib.metadata.version("lightning")
    except importlib.metadata.PackageNotFoundError:
        return "2.0.0"


def _serialize(result: dict[str, Any], fmt: str) -> bytes:
    model, step = result["model"], result["step"]
    if fmt == "safetensors":
        return safetensors.torch.save(model, metadata={"format": "pt", "diffckpt.step": str(step)})
    if fmt == "lightning":
        state = result["state"]
        obj: dict[str, Any] = dict(state) if isinstance(state, dict) else {"state": state}
        obj.setdefault("global_step", step)
        obj.setdefault("pytorch-lightning_version", _lightning_version())
        obj.update(state_dict=model, optimizer_states=result["optimizers"])
    else:
        obj = {"model": model, "optimizers": result["optimizers"], "step": step}
    buf = io.BytesIO()
    torch.save(_plain(obj), buf)
    return buf.getvalue()


def _cmd_export(args: argparse.Namespace) -> int:
    store, _, step = _open(args)
    ext = os.path.splitext(args.output)[1].lower()
    fmt = args.format or {".ckpt": "lightning", ".safetensors": "safetensors"}.get(ext, "torch")
    _progress(f"replaying step {'newest' if step is None else step}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = load_state(store.storage, step, verify=not args.no_verify, device=args.device,
                            allow_modules=tuple(args.allow_module))
    _progress(f"writing {args.output}")
    data = _serialize(result, fmt)
    # Through Storage.write: the whole file or nothing, never a truncated checkpoint.
    if "://" in args.output:
        directory, _, name = args.output.rpartition("/")
    else:
        directory, name = os.path.split(os.path.abspath(args.output))
    FsspecStorage(directory).write(name, data)
    _progress()
    _reemit(caught)
    print(f"wrote {args.output}: step {result['step']} ({fmt}, {_human(len(data))}, "
          f"{len(data)} B; base {result['base_step']} + {result['replayed']} replayed steps)")
    return 0


# ---------------------------------------------------------------------------------- tune
def _cmd_tune(args: argparse.Namespace) -> int:
    return advice.run(args, _storage_options(args.storage_option))


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
    p.set_defaults(func=_cmd_verify)
    p = sub.add_parser("export", parents=[common, replaying], help="write a step as a checkpoint")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="file or URL to write")
    p.add_argument("--format", choices=("lightning", "torch", "safetensors"),
                   help="default from FILE: .ckpt lightning, .safetensors safetensors, else torch")
    p.add_argument("--no-verify", action="store_true", help="skip the fingerprint checks")
    p.set_defaults(func=_cmd_export)
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
        return int(args.func(args))
    except (CheckpointNotFoundError, UnsupportedConfigurationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except DiffCkptError as exc:
        print(f"error: {exc}", file=sys.stderr)
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
