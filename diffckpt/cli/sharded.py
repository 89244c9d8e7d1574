"""What the ``diffckpt`` commands share on a sharded run root (FSDP2 training): the root's sharded
sessions, the stream each rank wrote under ``ranks/r<rank>/`` (an ordinary run each, with its own
bases and segments) and the steps durable on every rank.

``ls`` describes the streams here (:func:`describe_streams`, :func:`render_streams`); ``verify``
and ``compact`` run their plain-run work on each stream; ``verify`` and ``export`` rebuild a step
as :func:`diffckpt.load_state` does (which names the rank whose stream is damaged);
``gc`` plans the streams in :func:`diffckpt.lifecycle.retention.plan_gc` and checks here that the
plan keeps the newest step durable on every rank (:func:`gc_losses`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import DiffCkptError
from ..inventory import Inventory
from ..rankstreams import RANKS_DIR, rank_prefix
from ..runstore import RunStore
from ..shardedrun import ShardedRun
from ..units import format_bytes
from .common import table

__all__ = ["Sharded", "Stream", "describe_streams", "open_sharded", "render_streams",
           "sharded_notes"]


@dataclass
class Stream:
    """One rank's stream: its folder under the root, a store on it and its inventory."""

    rank: int
    prefix: str
    store: RunStore
    inv: Inventory


@dataclass
class Sharded:
    """The sharded part of a run root, from one listing of the root."""

    run: ShardedRun
    sessions: dict[int, int]  # gen -> world size
    streams: list[Stream]  # by rank: every stream present, and every one a session expects

    def invs(self, gen: int) -> list[Inventory]:
        """The inventories of session ``gen``'s ranks, in rank order."""
        return [s.inv for s in self.streams[: self.sessions[gen]]]

    def newest(self, gen: int) -> int | None:
        """The newest step of ``gen`` that every rank's stream rebuilds (``None``: none).

        Usually the smallest of the ranks' newest steps (:meth:`ShardedRun.durable`), but not
        when a rank that is ahead lost what rebuilds that step (say, to retention)."""
        spans = self.spans(gen)
        return spans[-1][1] if spans else None

    def spans(self, gen: int) -> list[tuple[int, int]]:
        """The steps of ``gen`` that every rank's stream rebuilds, as merged intervals."""
        out: list[tuple[int, int]] | None = None
        for inv in self.invs(gen):
            mine = inv.durable_spans(gen)
            out = mine if out is None else _intersect(out, mine)
        return out or []

    def behind(self, gen: int) -> list[tuple[int, int | None]]:
        """``(rank, its newest step)`` of the ranks that hold up ``gen``'s durable step."""
        ends = [inv.newest_step(gen) for inv in self.invs(gen)]
        if len(set(ends)) <= 1:
            return []
        low = min((-1 if e is None else e) for e in ends)
        return [(r, e) for r, e in enumerate(ends) if (-1 if e is None else e) == low]


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _rank_of(prefix: str) -> int | None:
    try:
        return int(prefix.rstrip("/").rsplit("/", 1)[-1].removeprefix("r"))
    except ValueError:
        return None


def open_sharded(store: RunStore, inv: Inventory) -> Sharded | None:
    """The sharded sessions and rank streams of the root ``store`` (``None``: it has neither).

    Each stream's inventory is classified from the root's listing ``inv``: no listing per rank.
    """
    run = ShardedRun(store.storage, inv.sizes)
    sessions = run.sessions(inv)
    folders = {"/".join(p.split("/", 2)[:2]) for p in inv.sizes if p.startswith(RANKS_DIR + "/") and p.count("/") >= 2}
    present = {r for p in folders if (r := _rank_of(p)) is not None}
    if not sessions and not present:
        return None
    streams = []
    for rank in range(max([max(sessions.values(), default=0) - 1, *present]) + 1):
        streams.append(Stream(rank, rank_prefix(rank), run.stream(rank), run.inventory(rank)))
    return Sharded(run, sessions, streams)


# ------------------------------------------------------------------------------------ ls
def describe_streams(d: dict[str, Any], sh: Sharded) -> None:
    """Add what ``ls`` shows of the streams to ``d`` (:func:`diffckpt.cli.ls.describe`'s result):
    each sharded session's world size and steps durable on every rank, each rank's bases and
    segments, what ``ckpt_path=<root>`` resumes, and totals over the streams too."""
    url = d["url"]
    for s in d["sessions"]:
        world = sh.sessions.get(s["gen"])
        if world is None:
            continue
        newest = sh.newest(s["gen"])
        if not s["optimizers"] and sh.streams and s["gen"] in sh.streams[0].inv.sessions:
            try:  # the root's session names none: every rank's stream records them
                s["optimizers"] = sh.streams[0].store.session_meta(s["gen"]).get("optimizers", [])
            except (ValueError, DiffCkptError):
                pass
        s.update(durable=sh.spans(s["gen"]), newest_step=newest,
                 ckpt_path=None if newest is None else f"{url}/step={newest}",
                 sharded={"world_size": world,
                          "rank_newest": [inv.newest_step(s["gen"]) for inv in sh.invs(s["gen"])]})
    ranks: list[dict[str, Any]] = []
    for st in sh.streams:
        sizes = st.inv.sizes
        bases: list[dict[str, Any]] = [{"step": b.step, "gen": b.gen, "path": st.prefix + b.dir,
                  "bytes": sum(n for p, n in sizes.items() if p.startswith(b.dir + "/"))} for b in st.inv.bases]
        segments: list[dict[str, Any]] = [{"after": g.after, "last": g.last, "gen": g.gen, "steps": g.last - g.after,
                     "bytes": sizes.get(g.path, 0), "path": st.prefix + g.path} for g in st.inv.segments]
        gens = sorted({b.gen for b in st.inv.bases} | set(st.inv.sessions))
        ranks.append({"rank": st.rank, "path": st.prefix, "present": bool(sizes),
                      "sessions": [{"gen": g, "durable": st.inv.durable_spans(g), "newest_step": st.inv.newest_step(g)}
                                   for g in gens],
                      "bases": bases, "segments": segments, "bytes": sum(sizes.values()),
                      "base_bytes": sum(b["bytes"] for b in bases),
                      "diff_bytes": sum(g["bytes"] for g in segments)})
    d["ranks"] = ranks
    # What ckpt_path=<root> resumes: the newest session with a step durable on every rank, unless
    # an unsharded session of the root is newer (as ShardedRun.resolve decides).
    plain = d["newest"]
    for gen in sorted(sh.sessions, reverse=True):
        newest = sh.newest(gen)
        if plain is not None and plain["gen"] > gen:
            break
        if newest is not None:
            d["newest"] = {"gen": gen, "step": newest, "ckpt_path": url, "world_size": sh.sessions[gen]}
            break
    t = d["totals"]
    t["base_bytes"] += sum(r["base_bytes"] for r in ranks)
    t["diff_bytes"] += sum(r["diff_bytes"] for r in ranks)
    # Steps are counted once, however many ranks recorded them: the average is per step, all ranks.
    t["diff_steps"] += sum(s["steps"] for s in _grouped(d, "segments").values())
    t["other_bytes"] = t["bytes"] - t["base_bytes"] - t["diff_bytes"]
    t["avg_diff_bytes_per_step"] = round(t["diff_bytes"] / t["diff_steps"]) if t["diff_steps"] else None


def _grouped(d: dict[str, Any], kind: str) -> dict[tuple[int, ...], dict[str, Any]]:
    """The ranks' bases or segments, one entry per object name: the ranks holding it, bytes summed."""
    out: dict[tuple[int, ...], dict[str, Any]] = {}
    for r in d["ranks"]:
        for x in r[kind]:
            key = (x["gen"], x["step"]) if kind == "bases" else (x["gen"], x["after"], x["last"])
            entry = out.setdefault(key, dict(x, ranks=[], bytes=0, path="ranks/r*/" + x["path"][len(r["path"]):]))
            entry["ranks"].append(r["rank"])
            entry["bytes"] += x["bytes"]
    return dict(sorted(out.items()))


def render_streams(d: dict[str, Any]) -> dict[str, list[str]]:
    """Text of ``ls`` for the streams: ``"sessions"`` (lines under the sessions table),
    ``"ranks"`` (a section), ``"bases"`` and ``"segments"`` (tables with a ranks column, the
    root's own objects first)."""
    world = {s["gen"]: s["sharded"]["world_size"] for s in d["sessions"] if s.get("sharded")}
    notes = []
    for s in d["sessions"]:
        if not s.get("sharded"):
            continue
        ends, n = s["sharded"]["rank_newest"], s["sharded"]["world_size"]
        line = f"  g{s['gen']} sharded over {n} rank{'s' * (n != 1)} (a stream each under ranks/r<rank>/): "
        line += ("no step durable on every rank" if s["newest_step"] is None else
                 f"durable on every rank up to step {s['newest_step']}")
        known = [e for e in ends if e is not None]
        if len(set(ends)) > 1:
            low = min(known) if len(known) == len(ends) else None
            late = [str(r) for r, e in enumerate(ends) if e == low][:8]
            many = len(late) > 1
            line += (f"; rank{'s' * many} {', '.join(late)} "
                     + (f"hold{'s' * (not many)} nothing durable" if low is None else f"end{'s' * (not many)} at step {low}")
                     + f", the others reach up to {max(known, default=0)}")
        notes.append(line)
    newest_gen = max(world, default=None)
    rows = []
    for r in d["ranks"]:
        mine = {x["gen"]: x for x in r["sessions"]}.get(newest_gen) if newest_gen is not None else None
        step = mine["newest_step"] if mine else None
        rows.append([str(r["rank"]), "-" if step is None else f"{step} (g{newest_gen})", str(len(r["bases"])),
                     str(len(r["segments"])), format_bytes(r["bytes"]) if r["present"] else "missing", r["path"]])
    ranks = ["", f"ranks ({len(d['ranks'])} stream{'s' * (len(d['ranks']) != 1)}; newest: each rank's newest "
                 "durable step of the newest sharded session)",
             *table(["rank", "newest", "bases", "segments", "size", "path"], rows)]

    def share(x: dict[str, Any]) -> str:
        n = world.get(x["gen"])
        return f"{len(x['ranks'])}/{n}" if n else str(len(x["ranks"]))

    # The root's own objects (unsharded sessions) and the ranks' ones, by session and step.
    base_rows = sorted([(b["gen"], b["step"], "-", b) for b in d["bases"]]
                       + [(b["gen"], b["step"], share(b), b) for b in _grouped(d, "bases").values()],
                       key=lambda r: r[:2])
    bases = table(["step", "gen", "ranks", "size", "path"], [
        [str(b["step"]), f"g{g}", who, format_bytes(b["bytes"]), b["path"]] for g, _, who, b in base_rows])
    seg_rows = sorted([(s["gen"], s["after"], "-", s) for s in d["segments"]]
                      + [(s["gen"], s["after"], share(s), s) for s in _grouped(d, "segments").values()],
                      key=lambda r: r[:2])
    segments = table(["after..last", "gen", "steps", "ranks", "size", "path"], [
        [f"{s['after']}..{s['last']}", f"g{g}", str(s["steps"]), who, format_bytes(s["bytes"]), s["path"]]
        for g, _, who, s in seg_rows])
    return {"sessions": notes, "ranks": ranks, "bases": bases, "segments": segments}


def sharded_notes(sh: Sharded) -> list[str]:
    """What ``verify`` says of ranks that are behind, or missing from a session, in each sharded
    session: not damage by itself (ranks write on their own, a kill leaves them at different
    steps), but it bounds what is durable on every rank."""
    notes = []
    for gen, world in sorted(sh.sessions.items()):
        absent = [s.rank for s in sh.streams[:world] if gen not in s.inv.sessions and
                  not any(b.gen == gen for b in s.inv.bases)]
        if absent:
            notes.append(f"g{gen} ran on {world} ranks but rank{'s' * (len(absent) > 1)} "
                         f"{', '.join(map(str, absent[:8]))} hold nothing of it "
                         f"({', '.join(rank_prefix(r) for r in absent[:3])}): no step of g{gen} is durable on every rank")
            continue
        behind = sh.behind(gen)
        if behind:
            reach = max((e for e in (inv.newest_step(gen) for inv in sh.invs(gen)) if e is not None), default=None)
            low = behind[0][1]
            one = len(behind) == 1
            notes.append(f"g{gen}: rank{'s' * (not one)} {', '.join(str(r) for r, _ in behind[:8])} "
                         + (f"hold{'s' * one} no durable step" if low is None else f"end{'s' * one} at step {low}")
                         + f" ({', '.join(rank_prefix(r) for r, _ in behind[:3])}), the others reach {reach}; "
                         + ("no step" if (common := sh.newest(gen)) is None else f"step {common}")
                         + " is durable on every rank")
    return notes


