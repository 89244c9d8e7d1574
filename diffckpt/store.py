"""The run layout on storage: sessions, bases, segments, and how a restorable chain is found.

Readers trust only committed objects: a base exists once its COMMIT marker does, a segment once
its single object does. A chain is a committed base followed by segments whose ``after`` equals
the previous ``last``; it ends at the first gap.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .errors import CheckpointNotFoundError, CorruptRecordError
from .format import FORMAT_VERSION, BaseName, SegmentName, decode_commit, decode_segment, sha256
from .storage import Storage
from .tree import unpack_tree

__all__ = ["RunStore", "Inventory", "RestorePlan", "RUN_FILE"]

log = logging.getLogger("diffckpt")
RUN_FILE = "run.json"


@dataclass
class Inventory:
    """One listing of a run root, classified."""

    sessions: dict[int, dict[str, Any]] = field(default_factory=dict)
    bases: list[BaseName] = field(default_factory=list)
    segments: list[SegmentName] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)

    def chain(self, base: BaseName) -> list[SegmentName]:
        """Segments that continue ``base`` without a gap, oldest first."""
        by_after: dict[int, SegmentName] = {}
        for seg in self.segments:
            if seg.gen == base.gen:
                current = by_after.get(seg.after)
                if current is None or seg.last > current.last:
                    by_after[seg.after] = seg
        out = []
        step = base.step
        while step in by_after:
            out.append(by_after[step])
            step = by_after[step].last
        return out

    def newest_step(self, gen: int) -> int | None:
        """Newest durable step of session ``gen`` (``None`` if it has no committed base)."""
        ends = [b.step if not (c := self.chain(b)) else c[-1].last for b in self.bases if b.gen == gen]
        return max(ends) if ends else None

    def gens(self) -> list[int]:
        return sorted({b.gen for b in self.bases} | set(self.sessions), reverse=True)


@dataclass
class RestorePlan:
    """What to read to rebuild ``target``: one base and the segments after it."""

    base: BaseName
    segments: list[SegmentName]
    target: int
    latest: bool


class RunStore:
    """Reads and writes the layout of one run root."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    # ----------------------------------------------------------------- listing
    def inventory(self) -> Inventory:
        inv = Inventory()
        listing = self.storage.list("")
        inv.sizes = listing
        for path in listing:
            if (seg := SegmentName.parse(path)) is not None:
                inv.segments.append(seg)
            elif (base := BaseName.parse(path)) is not None:
                inv.bases.append(base)
            elif path.startswith("sessions/g") and path.endswith(".json"):
                try:
                    inv.sessions[int(path[len("sessions/g") : -len(".json")])] = {}
                except ValueError:
                    continue
        inv.bases.sort()
        inv.segments.sort()
        return inv

    def is_run(self) -> bool:
        return self.storage.exists(RUN_FILE)

    def session_meta(self, gen: int) -> dict[str, Any]:
        return json.loads(self.storage.read(f"sessions/g{gen:06d}.json"))

    def start_session(self, meta: dict[str, Any]) -> int:
        """Register a new writer session and return its generation number."""
        inv = self.inventory()
        gen = max(inv.gens(), default=0) + 1
        run = {"format": "diffckpt", "version": FORMAT_VERSION, "updated": time.time()}
        self.storage.write(RUN_FILE, json.dumps(run, sort_keys=True).encode())
        body = dict(meta, gen=gen, started=time.time())
        self.storage.write(f"sessions/g{gen:06d}.json", json.dumps(body, indent=1, sort_keys=True).encode())
        return gen

    # --------------------------------------------------------------- planning
    def plan(self, step: int | None = None, inv: Inventory | None = None) -> RestorePlan:
        """Choose the base and segments for ``step`` (``None``: the newest durable step).

        The newest session with a committed base wins for ``None``; an explicit step is looked
        up from the newest session to the oldest.
        """
        inv = inv or self.inventory()
        if not inv.bases:
            raise CheckpointNotFoundError(
                f"no committed checkpoint under {self.storage.url}: train with DiffCheckpoint first "
                "or check the path")
        for gen in inv.gens():
            bases = [b for b in inv.bases if b.gen == gen]
            if not bases:
                continue
            if step is None:
                target = inv.newest_step(gen)
                assert target is not None
                return self._plan_for(inv, bases, target, latest=True)
            plan = self._plan_for(inv, bases, step, latest=False)
            if plan is not None:
                return plan
        durable = self.durable_ranges(inv)
        raise CheckpointNotFoundError(
            f"step {step} is not durable under {self.storage.url}; durable steps: {durable}. "
            "Pick one of those (see `diffckpt ls`).")

    @staticmethod
    def _plan_for(inv: Inventory, bases: list[BaseName], step: int, latest: bool) -> RestorePlan | None:
        for base in sorted(bases, reverse=True):
            if base.step > step:
                continue
            if base.step == step:
                return RestorePlan(base, [], step, latest)
            segs = []
            for seg in inv.chain(base):
                segs.append(seg)
                if seg.last >= step:
                    return RestorePlan(base, segs, step, latest)
        return None

    def durable_ranges(self, inv: Inventory) -> str:
        parts = []
        for gen in sorted({b.gen for b in inv.bases}):
            lo = min(b.step for b in inv.bases if b.gen == gen)
            parts.append(f"g{gen}: {lo}..{inv.newest_step(gen)}")
        return ", ".join(parts) or "none"

    # ---------------------------------------------------------------- reading
    def load_base(self, base: BaseName) -> tuple[dict[str, Any], Any]:
        """Return ``(commit info, state tree)`` of a committed base, verifying its checksum."""
        info = decode_commit(self.storage.read(base.commit_path), base.commit_path)
        if info.get("step") != base.step or info.get("gen") != base.gen:
            raise CorruptRecordError(f"{base.commit_path} describes step {info.get('step')} of session "
                                     f"{info.get('gen')}, not its own directory")
        expected = info["files"]["state.safetensors"]
        try:
            data = self.storage.read(base.state_path)
        except CheckpointNotFoundError:
            raise CorruptRecordError(
                f"{base.state_path} is missing although its COMMIT exists; the base is unusable. "
                "Restore an earlier step or remove the damaged base directory") from None
        if len(data) != expected["size"] or sha256(data) != expected["sha256"]:
            raise CorruptRecordError(
                f"{base.state_path} fails its checksum (size {len(data)}, expected {expected['size']}); "
                "the base is damaged. Restore an earlier step or verify the storage")
        return info, unpack_tree(data)

    def read_records(self, plan: RestorePlan) -> Iterator[tuple[dict[str, Any] | None, str | None]]:
        """Yield ``(record, None)`` for each record after the base up to the target, in order.

        On damage it yields ``(None, problem)`` once and stops: the caller decides whether
        the newest good step is acceptable.
        """
        expected_after = plan.base.step
        for seg in plan.segments:
            try:
                header, records, problem = decode_segment(self.storage.read(seg.path), seg.path)
            except (CorruptRecordError, CheckpointNotFoundError) as exc:
                yield None, str(exc)
                return
            if header.get("after") != expected_after or header.get("gen") != seg.gen:
                yield None, f"{seg.path}: header does not continue the chain at step {expected_after}"
                return
            prev = expected_after
            for record in records:
                if record.get("prev") != prev:
                    yield None, f"{seg.path}: record {record.get('step')} does not follow step {prev}"
                    return
                if record["step"] > plan.target:
                    return
                yield record, None
                prev = record["step"]
            if problem is not None:
                yield None, problem
                return
            if prev != seg.last or header.get("last") != seg.last:
                yield None, f"{seg.path}: ends at step {prev}, not at step {seg.last} as its name says"
                return
            expected_after = seg.last
