"""``diffckpt verify``: every checksum of a run, a replay of one step with the fingerprints
recorded in training, and with ``--deep`` a replay of every segment that compares each base with
the replay of the one before it."""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..errors import DiffCkptError, UnsupportedConfigurationError
from ..format import BaseName, SegmentName, decode_segment
from ..inventory import Inventory
from ..loading import load_state, replay_plan
from ..runstore import RestorePlan, RunStore, session_path
from ..storage import Storage
from .common import open_run, progress, reemit, throughput

__all__ = ["add_arguments", "run"]


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


def _deep_plans(inv: Inventory, usable: list[BaseName]) -> list[tuple[RestorePlan, BaseName | None]]:
    """One replay per base with segments after it: up to the next usable base of its session that
    its chain reaches (returned too, to compare with), else to the end of its chain.

    Together they replay every segment of a chain once. A damaged base is not in ``usable``:
    the base before it replays on past it, so its segments are still checked.
    """
    out = []
    for base in usable:
        end = inv.chain_end(base)
        if end == base.step:  # no segment continues it: nothing to replay
            continue
        after = [b for b in usable if b.gen == base.gen and base.step < b.step <= end]
        upto = min(after) if after else None
        plan = RunStore._plan_for(inv, base, end if upto is None else upto.step)
        assert plan is not None  # the target lies on the chain
        out.append((plan, upto))
    return out


def _first_difference(replayed: Any, stored: Any, path: str) -> str | None:
    """Where two state trees first differ (``None``: every tensor ``torch.equal``, all else ``==``)."""
    if isinstance(stored, torch.Tensor):
        same = (isinstance(replayed, torch.Tensor) and replayed.dtype == stored.dtype
                and replayed.shape == stored.shape and torch.equal(replayed.cpu(), stored.cpu()))
        return None if same else f"tensor {path}"
    if isinstance(stored, dict):
        if not isinstance(replayed, dict) or set(replayed) != set(stored):
            return f"{path} (other keys)"
        diffs = (_first_difference(replayed[k], v, f"{path}/{k}".lstrip("/")) for k, v in stored.items())
    elif isinstance(stored, (list, tuple)):  # a tree may hold a tuple as a list
        if not isinstance(replayed, (list, tuple)) or len(replayed) != len(stored):
            return f"{path} (another length)"
        diffs = (_first_difference(r, s, f"{path}/{i}".lstrip("/"))
                 for i, (r, s) in enumerate(zip(replayed, stored)))
    else:
        return None if replayed == stored else path
    return next((d for d in diffs if d is not None), None)


def _verify_deep(store: RunStore, inv: Inventory, usable: list[BaseName], args: argparse.Namespace,
                 bad: Callable[[str, str], None]) -> dict[str, Any]:
    """Replay every chain segment once and compare each base with the replay that reaches it.

    Checksums prove that bytes are as written, not that a base holds the state training had: a
    base written wrong (or replaced by a valid one of another run) passes them, and a plain
    restore from it would go unquestioned. Each base must equal the replay of the one before.
    """
    started = time.monotonic()
    plans = _deep_plans(inv, sorted(usable, key=lambda b: (b.gen, b.step)))
    replayed = compared = 0
    carried: tuple[BaseName, tuple[dict[str, Any], Any]] | None = None  # a compared base, reused
    for i, (plan, upto) in enumerate(plans):
        progress(f"[{i + 1}/{len(plans)}] replaying base {plan.base.step} -> {plan.target}")
        loaded = carried[1] if carried is not None and carried[0] == plan.base else None
        carried = None
        try:
            result = replay_plan(store, plan, device=args.device, allow_modules=tuple(args.allow_module),
                                 loaded=loaded)
            replayed += result["replayed"]
            if upto is not None:
                carried = (upto, store.load_base(upto))
        except UnsupportedConfigurationError:
            raise  # needs --allow-module: a usage matter, not damage
        except (DiffCkptError, ValueError) as exc:  # ValueError: a damaged session file
            bad(f"deep replay g{plan.base.gen} {plan.base.step}..{plan.target}", str(exc))
            continue
        if carried is None:
            continue
        reached, (_, stored) = carried
        compared += 1
        where = _first_difference({"model": result["model"], "optimizers": result["optimizers"]},
                                  {"model": stored["model"], "optimizers": stored["optimizers"]}, "")
        if where is not None:
            bad(reached.state_path, f"differs from the replay of base {plan.base.step} at {where}")
    return {"replayed_steps": replayed, "bases_compared": compared, "chains": len(plans),
            "seconds": round(time.monotonic() - started, 3)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``verify`` command's own argument (the step and the device come with replaying ones)."""
    p.add_argument("--deep", action="store_true",
                   help="also replay every segment once and check that each base equals the replay "
                        "of the one before")


def run(args: argparse.Namespace) -> int:
    """Check the run named by ``args.url``; exit 1 when anything is damaged."""
    store, inv, step = open_run(args)
    plan = store.plan(step, inv)  # a step that is not durable is a usage error (exit 2): first
    problems: list[dict[str, str]] = []

    def bad(obj: str, message: str) -> None:
        # Core messages usually start with the object's path already; do not repeat it.
        message = message.removeprefix(f"{obj}: ").removeprefix(f"{obj} ")
        problems.append({"object": obj, "problem": message})

    unusable: set[BaseName] = set()  # what --deep leaves out: already reported
    for gen in sorted(set(inv.sessions) | {b.gen for b in inv.bases}):  # replay needs each one
        try:
            store.session_meta(gen)
        except (ValueError, DiffCkptError) as exc:
            bad(session_path(gen), f"cannot be read: {exc}")
            unusable.update(b for b in inv.bases if b.gen == gen)
    committed = {b.dir for b in inv.bases}
    stray = sorted({p.rsplit("/", 1)[0] for p in inv.sizes if p.startswith("bases/")} - committed)
    total = len(inv.bases) + len(inv.segments)
    for i, base in enumerate(inv.bases):
        progress(f"[{i + 1}/{total}] {base.dir}")
        try:
            store.load_base(base)
        except DiffCkptError as exc:
            bad(base.state_path, str(exc))
            unusable.add(base)
    records = 0
    for i, seg in enumerate(inv.segments):
        progress(f"[{len(inv.bases) + i + 1}/{total}] {seg.path}")
        count, problem = _check_segment(store.storage, seg)
        records += count
        if problem is not None:
            bad(seg.path, problem)
    progress(f"replaying step {plan.target} from base {plan.base.step}")
    replay: dict[str, Any] = {"target": plan.target, "base_step": plan.base.step}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = load_state(store.storage, step, device=args.device, allow_modules=tuple(args.allow_module))
        for message in reemit(caught):
            bad("replay", message)
        replay.update(step=result["step"], replayed=result["replayed"],
                      replay_s=round(result["result"].replay_s, 4))
        if result["step"] != plan.target:
            bad("replay", f"reached step {result['step']}, not the durable step {plan.target}")
    except UnsupportedConfigurationError:
        raise  # needs --allow-module: a usage matter, not damage
    except (DiffCkptError, ValueError) as exc:  # ValueError: a damaged session file
        msg = str(exc)
        bad("replay", msg if f"step {plan.target}" in msg else f"step {plan.target}: {msg}")
    found = len(problems)
    usable = [b for b in inv.bases if b not in unusable]
    deep = _verify_deep(store, inv, usable, args, bad) if args.deep else None
    progress()
    report = {"url": store.storage.url, "ok": not problems, "bases": len(inv.bases),
              "segments": len(inv.segments), "records": records, "sessions": len(inv.sessions),
              "uncommitted": stray, "replay": replay, "deep": deep, "problems": problems}
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
        print(throughput(replay["replayed"], replay["replay_s"]))
    if deep is not None:
        print(f"deep: replayed {deep['replayed_steps']} steps across {deep['chains']} chains; " + (
            "every base equals the replay of the one before" if len(problems) == found else
            f"{len(problems) - found} problem(s), listed below"))
    for p in problems:
        print(f"BAD {p['object']}: {p['problem']}")
    print(f"FAILED: {len(problems)} problem(s)" if problems else "OK: every checksum matches")
    return int(bool(problems))
