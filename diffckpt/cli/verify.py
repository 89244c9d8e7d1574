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

from .. import planning
from ..errors import CheckpointNotFoundError, DiffCkptError, UnsupportedConfigurationError
from ..format import BaseName, SegmentName
from ..inventory import Inventory, RestorePlan
from ..keptsteps import is_kept_path, read_kept
from ..loading import load_state
from ..offline import replay_plan
from ..runstore import RunStore, session_path
from ..segment import decode_segment
from ..storage import Storage
from .common import Progress, open_run, progress, reemit, table, throughput
from .sharded import Sharded, Stream, open_sharded, sharded_notes

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
        plan = planning.plan_for(inv, base, end if upto is None else upto.step)
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


Bad = Callable[..., None]


def _check_objects(store: RunStore, inv: Inventory, bad: Bad, label: str = "") -> tuple[int, set[BaseName], list[str]]:
    """Check one run's (or one rank stream's) session files and the checksums of every base and
    segment: ``(intact step records, unusable bases, uncommitted base folders)``."""
    unusable: set[BaseName] = set()  # what --deep leaves out: already reported
    for gen in sorted(set(inv.sessions) | {b.gen for b in inv.bases}):  # replay needs each one
        try:
            store.session_meta(gen)
        except (ValueError, DiffCkptError) as exc:
            bad(session_path(gen), f"cannot be read: {exc}")
            unusable.update(b for b in inv.bases if b.gen == gen)
    for marker, damage in read_kept(store.storage, [p for p in inv.sizes if is_kept_path(p)])[1].items():
        bad(marker, f"{damage}; retention keeps every step until it is repaired or deleted")
    committed = {b.dir for b in inv.bases}
    stray = sorted({p.rsplit("/", 1)[0] for p in inv.sizes if p.startswith("bases/")} - committed)
    total = len(inv.bases) + len(inv.segments)
    bar = Progress(f"{label}checksums", unit="file")
    for i, base in enumerate(inv.bases):
        bar.update_to(i, total, base.dir)
        try:  # the checksum through a bounded buffer: verify holds no base in memory
            store.open_base(base)[1].verify()
        except DiffCkptError as exc:
            bad(base.state_path, str(exc))
            unusable.add(base)
    records = 0
    for i, seg in enumerate(inv.segments):
        bar.update_to(len(inv.bases) + i, total, seg.path)
        count, problem = _check_segment(store.storage, seg)
        records += count
        if problem is not None:
            bad(seg.path, problem)
    bar.close()
    return records, unusable, stray


def _target(store: RunStore, inv: Inventory, sh: Sharded | None, step: int | None) -> dict[str, Any]:
    """``{"target", "base_step", "world_size"}`` to replay, or ``{"unresolved": why}``: of the
    sharded session that holds ``step`` (with its world size; the base step is then each rank's
    own), else of the plain run. Nothing durable on every rank of a sharded root while some rank
    holds a base is damage to report, not a usage error."""
    if sh is not None and sh.sessions:
        try:
            res = sh.run.resolve(step)
        except CheckpointNotFoundError as exc:
            if step is not None or not any(s.inv.bases for s in sh.streams):
                raise
            return {"unresolved": str(exc)}
        if res is not None:
            return {"target": res.step, "base_step": None, "world_size": res.world_size}
    plan = planning.plan(store, step, inv)  # a step that is not durable is a usage error (exit 2): first
    return {"target": plan.target, "base_step": plan.base.step}


def _for_rank(st: Stream, bad: Bad) -> Bad:
    """``bad`` for rank ``st.rank``'s stream: paths named from the run root, the rank recorded."""
    def report(obj: str, message: str) -> None:
        message = message.removeprefix(f"{obj}: ").removeprefix(f"{obj} ")
        bad(st.prefix + obj if "/" in obj else obj, message, st.rank)
    return report


def _check_stream(st: Stream, sh: Sharded, bad: Bad) -> dict[str, Any]:
    """Check rank ``st.rank``'s stream as a run of its own, and that each sharded session it
    took part in left it a shard table (without one its pieces cannot be reassembled)."""
    mine = _for_rank(st, bad)
    records, unusable, stray = _check_objects(st.store, st.inv, mine, f"rank {st.rank} ")
    for gen, world in sorted(sh.sessions.items()):
        if st.rank >= world or gen not in st.inv.sessions:
            continue
        try:
            meta = st.store.session_meta(gen)
        except (ValueError, DiffCkptError):
            continue  # reported above
        if not isinstance(meta.get("shards"), dict) or not meta["shards"]:
            mine(session_path(gen), f"has no shard table: session g{gen}'s pieces on rank {st.rank} cannot be "
                                    "placed in the full tensors")
    return {"rank": st.rank, "path": st.prefix, "bases": len(st.inv.bases), "segments": len(st.inv.segments),
            "records": records, "sessions": len(st.inv.sessions), "uncommitted": [st.prefix + d for d in stray],
            "unusable": unusable}


def _replay(store: RunStore, step: int | None, target: int | None, args: argparse.Namespace,
            replay: dict[str, Any], bad: Bad) -> None:
    """Replay ``step`` as a restore would (every rank's stream, for a sharded session), with
    the fingerprints recorded in training checked, into ``replay``; damage met goes to ``bad``."""
    progress(f"replaying step {target}")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = load_state(store.storage, step, device=args.device, allow_modules=tuple(args.allow_module))
        for message in reemit(caught):
            bad("replay", message)
        replay.update(step=result["step"], replayed=result["replayed"], replay_s=round(result["result"].replay_s, 4))
        if replay["base_step"] is None:  # sharded: rank 0's base (every rank's is at the same step)
            replay["base_step"] = result["base_step"]
        if result["step"] != target:
            bad("replay", f"reached step {result['step']}, not the durable step {target}")
    except UnsupportedConfigurationError:
        raise  # needs --allow-module: a usage matter, not damage
    except (DiffCkptError, ValueError) as exc:  # ValueError: a damaged session file
        msg = str(exc)
        bad("replay", msg if f"step {target}" in msg else f"step {target}: {msg}")


def run(args: argparse.Namespace) -> int:
    """Check the run named by ``args.url`` (and each rank's stream of a sharded run); exit 1 when
    anything is damaged."""
    store, inv, step = open_run(args)
    sh = open_sharded(store, inv)
    replay = _target(store, inv, sh, step)
    unresolved, target = replay.pop("unresolved", None), replay.get("target")
    problems: list[dict[str, Any]] = []

    def bad(obj: str, message: str, rank: int | None = None) -> None:
        # Core messages usually start with the object's path already; do not repeat it.
        message = message.removeprefix(f"{obj}: ").removeprefix(f"{obj} ")
        problems.append({"object": obj, "problem": message, **({} if rank is None else {"rank": rank})})

    records, unusable, stray = _check_objects(store, inv, bad)
    streams = [_check_stream(st, sh, bad) for st in sh.streams] if sh is not None else []
    notes = sharded_notes(sh) if sh is not None else []
    if unresolved is not None:
        bad("replay", unresolved)
    else:
        _replay(store, step, target, args, replay, bad)
    found = len(problems)
    deep = None
    if args.deep:
        deep = _verify_deep(store, inv, [b for b in inv.bases if b not in unusable], args, bad)
        for st, report in zip(sh.streams if sh is not None else [], streams):
            unusable_here = report.pop("unusable")
            mine = _verify_deep(st.store, st.inv, [b for b in st.inv.bases if b not in unusable_here],
                                args, _for_rank(st, bad))
            report["deep"] = mine
            for key in ("replayed_steps", "bases_compared", "chains", "seconds"):
                deep[key] += mine[key]
        deep["seconds"] = round(deep["seconds"], 3)
    for report in streams:
        report.pop("unusable", None)
        report["problems"] = sum(p.get("rank") == report["rank"] for p in problems)
    progress()
    url = store.storage.url
    bases, segments = len(inv.bases) + sum(r["bases"] for r in streams), len(inv.segments) + sum(
        r["segments"] for r in streams)
    records += sum(r["records"] for r in streams)
    report = {"url": url, "ok": not problems, "bases": bases, "segments": segments, "records": records,
              "sessions": len(inv.sessions), "uncommitted": stray + [u for r in streams for u in r["uncommitted"]],
              "replay": replay, "deep": deep, "problems": problems}
    if sh is not None:
        report.update(ranks=streams, notes=notes, sharded={str(g): w for g, w in sorted(sh.sessions.items())})
    if args.json:
        print(json.dumps(report, indent=2))
        return int(bool(problems))
    print(f"checked {url}: bases {bases}, segments {segments} ({records} intact step records), "
          f"sessions {len(inv.sessions)}" + (f"; {len(streams)} rank streams" if sh is not None else ""))
    if streams:
        print("\n".join(table(["rank", "bases", "segments", "records", "problems", "path"], [
            [str(r["rank"]), str(r["bases"]), str(r["segments"]), str(r["records"]), str(r["problems"]), r["path"]]
            for r in streams])))
    for d in report["uncommitted"]:
        print(f"note: {d} has no COMMIT (an interrupted base write); restores ignore it")
    for note in notes:
        print(f"note: {note}")
    if "step" in replay:
        on = (f" on each of the {replay['world_size']} ranks, reassembled into full tensors"
              if replay.get("world_size") else "")
        if replay["replayed"]:
            print(f"replayed step {replay['step']} from base {replay['base_step']} "
                  f"({replay['replayed']} steps){on} with the fingerprints recorded in training checked")
            print(throughput(replay["replayed"], replay["replay_s"]))
        else:  # said once: the step is a base, loaded as written
            print(f"step {replay['step']} is a base: loaded{on} without replay, its checksums checked")
    if deep is not None:
        where = f" of {len(streams)} rank streams" if streams else ""
        print(f"deep: replayed {deep['replayed_steps']} steps across {deep['chains']} chains{where}; " + (
            "every base equals the replay of the one before" if len(problems) == found else
            f"{len(problems) - found} problem(s), listed below"))
    for p in problems:
        rank = "" if p.get("rank") is None else f"rank {p['rank']} "
        print(f"BAD {rank}{p['object']}: {p['problem']}")
    print(f"FAILED: {len(problems)} problem(s)" if problems else "OK: every checksum matches")
    return int(bool(problems))
