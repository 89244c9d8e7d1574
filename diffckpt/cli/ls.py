"""``diffckpt ls URL``: a run's sessions (with the settings they ran with and what the auto-tuner
chose), its bases and segments, the sizes they take, how to resume its newest durable step, and
which tier holds which steps: the run root, or the node-local tier of this host (``--local-dir``)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..errors import DiffCkptError
from ..format import BaseName, decode_commit
from ..inventory import Inventory
from ..keptsteps import is_kept_path, read_kept
from ..localtier import read_local_tier
from ..planning import session_spans
from ..policyoptions import BY_BYTES
from ..runstore import RunStore
from ..tuning.risk import say_risk
from ..units import format_bytes, format_duration
from .common import open_run, table, when
from .sharded import describe_streams, open_sharded, render_streams

__all__ = ["add_arguments", "describe", "render", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--local-dir", default="auto", metavar="DIR",
                        help="where the run's node-local tier is kept on this host (CheckpointOptions.local_dir; "
                             "default: auto, the system temporary folder)")


def _flat(options: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """``retry={"budget_s": 60}`` as ``retry.budget_s=60``, sorted."""
    out: list[tuple[str, Any]] = []
    for key, value in sorted(options.items()):
        out += _flat(value, f"{prefix}{key}.") if isinstance(value, dict) else [(f"{prefix}{key}", value)]
    return out


def _human(key: str, value: Any) -> str:
    """A setting as people read it: ``max_pending_bytes=256 MiB``, ``retry.budget_s=60 s`` (``--json``
    keeps the raw numbers)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if key.endswith("_bytes"):
            return format_bytes(value).replace(".0 ", " ")
        if key.endswith("_s"):
            return format_duration(value) if value > 0 else "0 s"
    return str(value)


def _shown(key: str, value: Any, options: dict[str, Any]) -> bool:
    """Settings worth a place in ``ls``: tuning only when tuned, compaction and retention when set,
    the byte ratio of bases when it sizes them, the local tier's bound when given or paced."""
    if key.startswith("tuning."):
        return _auto(options)
    if key in ("retention", "compact_every_n_steps", "local_max_bytes"):
        return value is not None
    if key == "base_every_diff_bytes_ratio":
        return options.get("base_every_n_steps") == BY_BYTES
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
    # Imported here: codecs need torch, which listing a run without a codec does without.
    from ..codecs import codec_from_config

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


def _local(store: RunStore, local_dir: str | None, streams: list[tuple[str, RunStore]]) -> list[dict[str, Any]]:
    """What the node-local tier of this host holds of each stream beyond the run root."""
    out = []
    for name, stream in streams:
        tier = read_local_tier(stream, local_dir, fence=store.storage)
        if tier.step is not None or tier.live:
            out.append({"stream": name, "gen": tier.gen, "after": tier.after, "step": tier.step,
                        "bytes": sum(e["length"] for _, _, e in tier.records),
                        "in_use": [j.pid for j in tier.live], "journals": len(tier.used) + len(tier.stale)})
    return out


def describe(store: RunStore, inv: Inventory, local_dir: str | None = None) -> dict[str, Any]:
    """Everything ``ls`` shows, as plain JSON-able data (``--json`` prints it as is).
    ``local_dir``: look for the node-local tier there too (``CheckpointOptions.local_dir``)."""
    url, sizes = store.storage.url.rstrip("/"), inv.sizes
    sessions, spans = [], session_spans(store, inv)  # with steps rebuilt through a session continued
    for gen in sorted(set(inv.sessions) | {b.gen for b in inv.bases}):
        try:
            meta: dict[str, Any] = store.session_meta(gen)
        except (ValueError, DiffCkptError):
            meta = {"damaged": True}  # `verify` names it; listing the rest is still useful
        durable = spans.get(gen, [])
        newest = durable[-1][1] if durable else None
        sessions.append({
            "gen": gen, "started": meta.get("started"), "resumed_from": meta.get("resumed_from"),
            "options": meta.get("options", {}), "optimizers": meta.get("optimizers", []),
            "framework": meta.get("framework"), "codec": meta.get("codec"), "durable": durable,
            "newest_step": newest, "ckpt_path": None if newest is None else f"{url}/step={newest}",
            "damaged": bool(meta.get("damaged")), "tuning": store.tuning_log(gen), "loss": store.loss_statement(gen)})
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
    # What ckpt_path=<root> resumes: the newest session with a durable step, as planning.plan decides.
    newest_run = next(({"gen": s["gen"], "step": s["newest_step"], "ckpt_path": url} for s in reversed(sessions)
                       if s["newest_step"] is not None), None)
    avg = round(diff_bytes / diff_steps) if diff_steps else None
    marked, damaged = read_kept(store.storage, [p for p in sizes if is_kept_path(p)])
    d = {
        "url": url, "newest": newest_run, "sessions": sessions, "bases": bases,
        "segments": segments,
        "kept": [{"step": k.step, "gen": k.gen, "why": k.why, "path": k.path}
                 for k in sorted(marked, key=lambda k: (k.gen, k.step, k.why))],
        "kept_damaged": list(damaged.values()),
        "totals": {"bytes": total, "base_bytes": base_bytes, "diff_bytes": diff_bytes,
                   "other_bytes": total - base_bytes - diff_bytes, "diff_steps": diff_steps,
                   "avg_diff_bytes_per_step": avg},
    }
    sharded = open_sharded(store, inv)
    if sharded is not None:  # sharded sessions: their steps are durable in the ranks' streams
        describe_streams(d, sharded)
    if local_dir is not None:
        streams = [("root", store)] + [(f"rank {st.rank}", st.store) for st in (sharded.streams if sharded else [])]
        d["local_tier"] = _local(store, local_dir, streams)
    return d


def render(d: dict[str, Any]) -> str:
    url, newest, t = d["url"], d["newest"], d["totals"]
    framework = next((str(s["framework"] or "") for s in d["sessions"][-1:]), "")
    how, any_step = _resume_hints(framework, url)
    streams = render_streams(d) if "ranks" in d else None  # a sharded run root: its rank streams
    if newest is None:
        head = "no step durable on every rank (see ranks)" if streams else "no durable step yet (no committed base)"
    elif "world_size" in newest:
        head = (f'newest step durable on every rank {newest["step"]} (g{newest["gen"]}, {newest["world_size"]} '
                f"ranks): {how}")
    else:
        head = f'newest durable step {newest["step"]} (g{newest["gen"]}): {how}'
    lines = [f"run {url}", head]
    for tier in d.get("local_tier", []):  # which tier holds which steps: what each failure loses
        where = "" if tier["stream"] == "root" else f" ({tier['stream']})"
        if tier["step"] is not None:
            lines.append(f"local tier on this host{where}: steps {tier['after'] + 1}..{tier['step']} of g{tier['gen']} "
                         f"({format_bytes(tier['bytes'])}) are not in the run root yet: a resume on this host takes "
                         "them back; the loss of this host loses them")
        if tier["in_use"]:
            lines.append(f"local tier on this host{where}: being written by process "
                         + ", ".join(str(p) for p in tier["in_use"]))
    lines += ["", "sessions"]
    lines += table(["gen", "started", "resumed_from", "durable", "newest", "ckpt_path"], [
        [f"g{s['gen']}", "damaged" if s["damaged"] else when(s["started"]), str(s["resumed_from"]),
         (", ".join(f"{lo}..{hi}" for lo, hi in s["durable"]) or "-") + _every(s["options"]),
         str(s["newest_step"] if s["newest_step"] is not None else "-"), s["ckpt_path"] or "-"]
        for s in d["sessions"]])
    lines += streams["sessions"] if streams else []
    lines += [f"  g{s['gen']} settings: " + " ".join(f"{k}={_human(k, v).replace(' ', '')}" for k, v in _flat(s["options"])
                                                 if _shown(k, v, s["options"]))
              + (f" codec={_codec_name(s['codec'])}" if s["codec"] else "")
              for s in d["sessions"] if s["options"]]
    lines += [f"  g{s['gen']} loss per failure (measured at its first step): {s['loss']['text']}"
              for s in d["sessions"] if s.get("loss")]
    lines += [f"  g{s['gen']} auto-tuned: " + "; ".join(
        f"step {t.get('step')}: " + " ".join(f"{k}={v}" for k, v in (t.get("settings") or {}).items())
        + (f" ({say_risk(t['loss_per_failure'])})" if t.get("loss_per_failure") else "")
        for t in s["tuning"]) for s in d["sessions"] if s.get("tuning")]
    lines += streams["ranks"] if streams else []
    lines += ["", "bases", *(streams["bases"] if streams else table(["step", "gen", "size", "path"], [
        [str(b["step"]), f"g{b['gen']}", format_bytes(b["bytes"]), b["path"]] for b in d["bases"]]))]
    lines += [f"  compacted: {b['step']} (g{b['gen']}) from base {c.get('from_base')}, "
              + (f"verified at step {b['step']}" if c.get("verified_through") == b["step"] else
                 f"fingerprints matched through step {c.get('verified_through')}")
              for b in d["bases"] if (c := b["compacted"])]
    lines += ["", "segments", *(streams["segments"] if streams else table(
        ["after..last", "gen", "steps", "size", "path"],
        [[f"{s['after']}..{s['last']}", f"g{s['gen']}", str(s["steps"]), format_bytes(s["bytes"]), s["path"]]
         for s in d["segments"]]))]
    if d["kept"] or d["kept_damaged"]:  # steps that saves name: retention keeps them, in every session
        lines += ["", "kept for saves (until the save is removed)"]
        lines += table(["step", "gen", "why", "marker"],
                       [[str(k["step"]), f"g{k['gen']}", k["why"], k["path"]] for k in d["kept"]])
        lines += [f"  {problem}: retention keeps every step until it is repaired or deleted"
                  for problem in d["kept_damaged"]]
    lines += ["", "totals"] + [f"  {label:<10}  {format_bytes(t[key])} ({t[key]} B)" for label, key in
                               (("on storage", "bytes"), ("bases", "base_bytes"))]
    diffs = f"{format_bytes(t['diff_bytes'])} ({t['diff_bytes']} B)"
    if t["diff_steps"]:
        avg = format_bytes(t["avg_diff_bytes_per_step"])
        diffs += f" over {t['diff_steps']} steps, {avg} per step"
    lines += [f"  diffs       {diffs}",
              f"  other       {format_bytes(t['other_bytes'])} ({t['other_bytes']} B)", "",
              "resume any durable step N with " + any_step]
    return "\n".join(lines)


def _resume_hints(framework: str, url: str) -> tuple[str, str]:
    """How the integration that wrote the newest session resumes its newest step, and step N."""
    if framework.startswith("accelerate"):
        return f'DiffCheckpointer(accelerator, "{url}").restore("last")', "DiffCheckpointer(...).restore(N)"
    if framework.startswith("transformers"):
        return ("trainer.train(resume_from_checkpoint=True) with DiffCheckpointCallback",
                "trainer.train(resume_from_checkpoint=callback.checkpoint(N))")
    return f'ckpt_path="{url}" (or "last" with DiffCheckpoint)', f'ckpt_path="{url}/step=N"'


def run(args: argparse.Namespace) -> int:
    """Print the run named by ``args.url``: as text, or as JSON with ``--json``."""
    d = describe(*open_run(args)[:2], local_dir=None if args.local_dir == "none" else args.local_dir)
    print(json.dumps(d, indent=2) if args.json else render(d))
    return 0
