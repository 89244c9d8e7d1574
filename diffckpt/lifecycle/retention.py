"""Retention: which objects of a run are still needed, and deleting the rest without ever
leaving the run unrestorable.

A policy names the restorable steps to keep. Each kept step needs one committed base and the
segments from it up to the step (its *chain*); everything no kept step needs may go. The newest
durable step is always kept, so deletion only ever follows newer state that is already durable.

Deletion order makes a kill at any instant harmless: segments go first (a base whose chain is
cut short still restores the steps before the cut), then each base's ``COMMIT`` marker (the
base stops being committed), then its files. Whatever a killed run leaves behind is unneeded by
the same rules and goes on the next run. Leftovers of interrupted writes (uncommitted base
files, local temporary files, incomplete multipart uploads, tuning probes) go once they are older
than ``min_age_s``, so a writer still at work is never disturbed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..deprecation import renamed_kwargs
from ..errors import CorruptRecordError, DiffCkptError
from ..format import BaseName, SegmentName
from ..inventory import Inventory
from ..keptsteps import is_kept_path, read_kept
from ..planning import continuations, newest_continuing
from ..policyoptions import RetentionPolicy
from ..rankstreams import RANKS_DIR
from ..runstore import RunStore, session_path
from ..shardedrun import ShardedRun, rank_streams
from ..storage import Storage, open_storage
from ..storage.prefixed import substorage
from .leftovers import Leftover, details_of, hidden, leftovers

__all__ = ["GcPlan", "RetentionPolicy", "apply_gc", "collect_garbage", "plan_gc"]

RANKS_PREFIX = RANKS_DIR + "/"
log = logging.getLogger("diffckpt")


@dataclass
class Kept:
    """A restorable step the policy keeps, the base it restores from, and why."""

    gen: int
    step: int
    base: int
    reasons: list[str]


@dataclass
class GcPlan:
    """What a garbage collection keeps and deletes, computed from one listing."""

    url: str
    kept: list[Kept] = field(default_factory=list)
    segments: list[SegmentName] = field(default_factory=list)
    bases: list[BaseName] = field(default_factory=list)
    base_files: dict[BaseName, list[str]] = field(default_factory=dict)
    leftovers: list[Leftover] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)
    kept_beyond_gaps: list[str] = field(default_factory=list)
    applied: bool = False  # whether the deletions were carried out
    # Sharded runs: the plan of each rank's stream, by its folder under the root (``ranks/r00000/``).
    streams: dict[str, GcPlan] = field(default_factory=dict)

    @property
    def objects(self) -> int:
        own = len(self.segments) + sum(len(f) for f in self.base_files.values()) + len(self.leftovers)
        return own + sum(p.objects for p in self.streams.values())

    @property
    def bytes(self) -> int:
        files = [s.path for s in self.segments] + [p for f in self.base_files.values() for p in f]
        own = sum(self.sizes.get(p, 0) for p in files) + sum(x.size for x in self.leftovers)
        return own + sum(p.bytes for p in self.streams.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url, "objects": self.objects, "bytes": self.bytes,
            "kept": [{"gen": k.gen, "step": k.step, "base": k.base, "reasons": k.reasons} for k in self.kept],
            "delete": {
                "segments": [{"path": s.path, "bytes": self.sizes.get(s.path, 0)} for s in self.segments],
                "bases": [{"path": b.dir, "step": b.step, "gen": b.gen,
                           "bytes": sum(self.sizes.get(p, 0) for p in self.base_files[b])} for b in self.bases],
                "leftovers": [{"path": x.path, "kind": x.kind, "bytes": x.size} for x in self.leftovers],
            },
            "kept_beyond_gaps": self.kept_beyond_gaps, "applied": self.applied,
            **({"streams": {k: p.to_json() for k, p in self.streams.items()}} if self.streams else {}),
        }


# ------------------------------------------------------------------------------ planning
def _ends(inv: Inventory, bases: list[BaseName]) -> set[int]:
    """Restorable steps of the chains of ``bases`` that need no partial segment: each base's own
    step and every segment end (segments are cut at restorable steps)."""
    ends = {b.step for b in bases}
    seen: set[SegmentName] = set()
    for base in bases:
        for seg in inv.chains[base]:
            if seg in seen:  # chains that meet go on alike: the rest is counted already
                break
            seen.add(seg)
            ends.add(seg.last)
    return ends


def _targets(inv: Inventory, policy: RetentionPolicy, mtimes: dict[str, float | None], now: float,
             also: Sequence[tuple[int, int, str]] = (), everything: str | None = None,
             links: dict[int, tuple[int, int]] | None = None, routes: list[tuple[int, int, int]] | None = None
             ) -> dict[tuple[int, int, int], list[str]]:
    """``{(gen, step, base step): reasons}`` of every step to keep restorable (``also``: more
    ``(gen, step, reason)`` to keep, which the policy does not know of; ``everything``: why every
    step is kept whatever the policy). ``links``: the ``(session, step)`` that sessions continue
    (``diffckpt.planning``); a step of one that none of its bases reaches is kept as the step it
    continues, and ``(gen, from, to)`` of its own segments to keep is appended to ``routes``."""
    out: dict[tuple[int, int, int], list[str]] = {}
    links = links or {}
    reaches: dict[int, list[tuple[BaseName, int]]] = {}  # per session: (base, chain end), newest first
    for b in sorted(inv.bases, reverse=True):
        reaches.setdefault(b.gen, []).append((b, inv.chain_end(b)))

    def keep(gen: int, step: int, reason: str, base: BaseName | None = None) -> bool:
        # Without a base named: the newest committed base of ``gen`` whose chain reaches ``step``
        # (the least replay), else, for a session that continues another, through that one.
        base = base or next((b for b, end in reaches.get(gen, ()) if b.step <= step <= end), None)
        if base is not None:
            out.setdefault((gen, step, base.step), []).append(reason)
            return True
        link = links.get(gen)
        if link is None or not link[1] < step <= inv.chain_end(BaseName(link[1], gen)):
            return False
        if not keep(link[0], link[1], f"{reason} (continued by session g{gen})"):
            return False
        if routes is not None:
            routes.append((gen, link[1], step))
        return True

    for gen, step, reason in also:
        # A save made after its session ended may name a step of an earlier session: the newest
        # earlier session that holds it.
        any(keep(g, step, reason) for g in [gen, *sorted((g for g in reaches if g < gen), reverse=True)])
    if not inv.bases:
        return out
    for gen in inv.gens():  # the newest session with a durable step: its own base's, or through a link
        newest = inv.newest_step(gen)
        if newest is None and gen in links:
            newest = inv.chain_end(BaseName(links[gen][1], gen))
        if newest is not None and keep(gen, newest, "newest durable step"):
            break
    if policy.keeps_everything or everything is not None:
        for base in inv.bases:
            keep(base.gen, inv.chain_end(base), everything or "no keep_* policy: everything is kept", base)
        return out
    if policy.keep_last_bases is not None:
        n = policy.keep_last_bases
        why = "within the newest base" if n == 1 else f"within the last {n} bases"
        for base in sorted(inv.bases, key=lambda b: (b.gen, b.step), reverse=True)[:n]:
            keep(base.gen, inv.chain_end(base), why, base)
    if policy.keep_every_n_steps is not None:
        k, claimed = policy.keep_every_n_steps, set[int]()
        for gen in inv.gens():  # the newest session's history wins where sessions overlap
            bases = sorted(b for b in inv.bases if b.gen == gen)
            first: dict[int, int] = {}  # window -> its first restorable step
            for step in _ends(inv, bases):
                first[step // k] = min(first.get(step // k, step), step)
            base_in = {}
            for b in reversed(bases):  # the oldest base in each window wins
                base_in[b.step // k] = b
            for w in sorted(set(first) - claimed):
                in_window = base_in.get(w)
                keep(gen, in_window.step if in_window else first[w], f"one per {k} steps", in_window)
            claimed |= set(first)
    if policy.keep_newer_than_s is not None:
        cutoff = now - policy.keep_newer_than_s
        young = {p for p, t in mtimes.items() if t is None or t >= cutoff}
        why = f"written in the last {policy.keep_newer_than_s:g} s"
        for base in inv.bases:
            if base.commit_path in young or base.state_path in young:
                keep(base.gen, base.step, why, base)
        for seg in inv.segments:
            if seg.path in young:
                keep(seg.gen, seg.last, why)
    return out


def plan_gc(store: RunStore, policy: RetentionPolicy, now: float | None = None,
            also: Sequence[tuple[int, int, str]] = ()) -> GcPlan:
    """Decide what to delete under ``policy`` from one listing of the run (deletes nothing).

    Besides the policy's steps, the steps that kept markers name (``kept/``, the saves of
    frameworks: :mod:`diffckpt.keptsteps`) are kept, and ``also``: more ``(gen, step, reason)``.
    A marker that cannot be read names a step nobody can tell: every step is then kept (and
    leftovers still go) until it is repaired or deleted. A sharded run's rank streams are planned
    each on its own, under the same policy and markers, and each also keeps the newest step
    durable on every rank (a rank ahead of the others must not drop what a restore of that step
    needs from it).
    """
    now = time.time() if now is None else now
    details = details_of(store)
    marked, damaged = read_kept(store.storage, [p for p in details if is_kept_path(p)])
    everything = None
    if damaged:
        problems = "; ".join(damaged.values())
        everything = f"every step is kept: {problems} (repair or delete it)"
        log.warning("diffckpt: retention keeps every step of %s: %s", store.storage.url, problems)
    also = [*also, *((k.gen, k.step, k.why) for k in marked)]
    return _plan(store, policy, now, also, details, everything)


def _plan(store: RunStore, policy: RetentionPolicy, now: float, also: Sequence[tuple[int, int, str]],
          details: dict[str, tuple[int, float | None]], everything: str | None) -> GcPlan:
    streams = any(p.startswith(RANKS_PREFIX) for p in details)
    details = {p: v for p, v in details.items() if not p.startswith(RANKS_PREFIX)}
    inv = store.inventory({p: size for p, (size, _) in details.items() if not hidden(p)})
    links = continuations(store, inv)
    waiting = newest_continuing(store, inv, links)  # its steps need those it continues, whatever the policy
    everything = everything or (waiting and f"every step is kept: session g{waiting[0]} continues step "
                                f"{waiting[2]} of session g{waiting[1]} and has no base of its own yet")
    routes: list[tuple[int, int, int]] = []
    mtimes = {p: t for p, (_, t) in details.items()}
    plan = GcPlan(url=store.storage.url.rstrip("/"), sizes={p: s for p, (s, _) in details.items()})
    needed: set[str] = set()  # base directories
    reach: dict[BaseName, int] = {}  # kept base -> the furthest kept step restored from it
    by_key: dict[tuple[int, int], Kept] = {}
    for (gen, step, base_step), reasons in sorted(
            _targets(inv, policy, mtimes, now, also, everything, links, routes).items()):
        base = BaseName(base_step, gen)
        needed.add(base.dir)
        reach[base] = max(reach.get(base, step), step)
        kept = by_key.setdefault((gen, step), Kept(gen, step, base_step, []))
        kept.reasons += [r for r in reasons if r not in kept.reasons]
    plan.kept = sorted(by_key.values(), key=lambda k: (k.gen, k.step))
    routed = _routed(inv, reach) | {seg for gen, after, to in routes for seg in inv.chain(BaseName(after, gen))
                                    if seg.after < to}
    reachable = _reachable(inv)
    newest_gen = max(inv.gens(), default=0)
    newest = {gen: inv.newest_step(gen) for gen in {s.gen for s in inv.segments}}
    for seg in inv.segments:
        if seg in routed:
            continue
        if seg in reachable:
            plan.segments.append(seg)
            continue
        # Beyond a gap in its chain: unrestorable now, but never delete what may be newer than
        # the session's durable state (a missing segment may yet appear, or be restored).
        end = newest[seg.gen]
        if (end is not None and seg.last <= end) or (end is None and seg.gen < newest_gen and waiting is None):
            plan.segments.append(seg)
        else:
            plan.kept_beyond_gaps.append(seg.path)
    committed = {b.dir for b in inv.bases}
    by_dir: dict[str, list[str]] = {}
    for path in details:
        if path.startswith("bases/"):
            by_dir.setdefault(path.rsplit("/", 1)[0], []).append(path)
    for base in inv.bases:
        if base.dir not in needed:
            # COMMIT first: the base stops being committed before any of its files go.
            plan.bases.append(base)
            plan.base_files[base] = sorted(by_dir.get(base.dir, []), key=lambda p: (p != base.commit_path, p))
    planned = {p for files in plan.base_files.values() for p in files}
    plan.leftovers = [x for x in leftovers(store, details, committed, now - policy.min_age_s)
                      if x.path not in planned and not x.path.startswith(RANKS_PREFIX)]
    if streams:
        plan.streams = _plan_streams(store, policy, now, also, everything)
    return plan


def _plan_streams(store: RunStore, policy: RetentionPolicy, now: float,
                  also: Sequence[tuple[int, int, str]], everything: str | None) -> dict[str, GcPlan]:
    run = ShardedRun(store.storage)
    sessions = run.sessions()
    floors = []
    for gen, world in sorted(sessions.items(), reverse=True):
        durable = run.durable(gen, run.inventories(world))
        if durable is not None:  # the newest session with a step durable everywhere
            floors.append((gen, durable, "newest step durable on every rank"))
            break
    plans = {}
    for prefix in rank_streams(store.storage):
        sub = RunStore(substorage(store.storage, prefix))  # a sharded step lies in every stream
        plans[prefix] = _plan(sub, policy, now, [*floors, *also], details_of(sub), everything)
    return plans


def _routed(inv: Inventory, reach: dict[BaseName, int]) -> set[SegmentName]:
    """The segments from each kept base up to the one holding its furthest kept step.

    Linear in the segments however many steps are kept: the route to a nearer step is a prefix
    of the route to the furthest, and chains that meet go on alike, so with the furthest routes
    walked first a walk stops at the first segment an earlier one took.
    """
    routed: set[SegmentName] = set()
    for base, step in sorted(reach.items(), key=lambda item: -item[1]):
        for seg in inv.chains[base]:
            if seg.after >= step or seg in routed:
                break
            routed.add(seg)
    return routed


def _reachable(inv: Inventory) -> set[SegmentName]:
    """Segments on some committed base's chain (a chain that meets one already taken is done)."""
    reachable: set[SegmentName] = set()
    for chain in inv.chains.values():
        for seg in chain:
            if seg in reachable:
                break
            reachable.add(seg)
    return reachable


# ------------------------------------------------------------------------------ applying
@renamed_kwargs(url="dirpath")
def collect_garbage(dirpath: str | os.PathLike[str] | Storage, policy: RetentionPolicy | None = None, *,
                    dry_run: bool = True, storage_options: dict[str, Any] | None = None,
                    progress: Callable[[int, int, str], None] | None = None) -> GcPlan:
    """Plan (and unless ``dry_run``, carry out) the deletions ``policy`` allows on the run at
    ``dirpath`` (path, fsspec URL or :class:`Storage`; ``url=`` is a deprecated spelling).

    Safe while training writes to the run: only committed objects no kept step needs, and
    leftovers older than ``policy.min_age_s``, are deleted; the newest durable step always stays.
    ``policy`` defaults to the one the run's newest session was started with, and without one
    to :class:`RetentionPolicy` ``()``: every step is kept, only leftovers go.
    """
    store = RunStore(open_storage(dirpath, **(storage_options or {})))
    policy = policy or recorded_policy(store) or RetentionPolicy()
    plan = plan_gc(store, policy)
    if not dry_run:
        apply_gc(store, plan, progress)
        plan.applied = True
    return plan


def recorded_policy(store: RunStore) -> RetentionPolicy | None:
    """The retention the newest session was configured with (``None`` if none)."""
    for gen in sorted(store.inventory().sessions, reverse=True):
        try:
            options = store.session_meta(gen).get("options")
        except (ValueError, DiffCkptError):
            continue
        recorded = options.get("retention") if isinstance(options, dict) else None
        if not isinstance(recorded, dict):
            return None
        try:
            return RetentionPolicy(**recorded)
        except (TypeError, ValueError) as exc:  # damaged, or written by another version
            raise CorruptRecordError(
                f"{store.storage.url.rstrip('/')}/{session_path(gen)} records a retention policy that "
                f"cannot be used ({exc}); pass a policy explicitly") from None
    return None


def apply_gc(store: RunStore, plan: GcPlan,
             progress: Callable[[int, int, str], None] | None = None) -> dict[str, int]:
    """Delete what ``plan`` names, in the crash-safe order; return counts and bytes deleted."""
    steps: list[tuple[str, Callable[[], None]]] = []
    for prefix, sub in [("", plan), *plan.streams.items()]:
        storage = substorage(store.storage, prefix) if prefix else store.storage
        steps += [(prefix + s.path, _deleter(storage, s.path)) for s in sub.segments]
        for base in sub.bases:
            steps += [(prefix + p, _deleter(storage, p)) for p in sub.base_files[base]]
        for x in sub.leftovers:
            if x.upload_id is not None:
                steps.append((prefix + x.path, _aborter(storage, x.path, x.upload_id)))
            else:
                steps.append((prefix + x.path, _deleter(storage, x.path)))
    for i, (path, step) in enumerate(steps):
        if progress is not None:
            progress(i, len(steps), path)
        step()
    if progress is not None:
        progress(len(steps), len(steps), "")
    subs = [plan, *plan.streams.values()]
    return {"objects": len(steps), "bytes": plan.bytes, "segments": sum(len(p.segments) for p in subs),
            "bases": sum(len(p.bases) for p in subs), "leftovers": sum(len(p.leftovers) for p in subs)}


def _deleter(storage: Any, path: str) -> Callable[[], None]:
    return lambda: storage.delete(path)


def _aborter(storage: Any, path: str, upload_id: str) -> Callable[[], None]:
    # Only planned for a storage that listed the upload, so one that is an InspectableStorage.
    return lambda: storage.abort_upload(path, upload_id)
