"""Resuming from the node-local tier: what a crashed session journaled on this node and the run
root did not get, checked and committed to the run root before the restore locates its step.

A journal counts only when it continues the run root's newest durable chain of its session, and
that session is the newest on the run root (fencing: a journal of a session that a later job
superseded is stale). A journal whose process still runs is another job's, left alone. Every
record is checked against the checksum its journal recorded; a damaged or torn one ends what is
taken. What is taken is written as one segment of the crashed session, up to its newest
restorable step, through the same fenced, atomic write as any segment, so a restore (here or on
another node) sees an ordinary run root. Then the journals of that session go.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from .errors import DiffCkptError
from .format import CHECKSUMS, FORMAT_VERSION, SegmentName
from .journal import JournalFile, journals, place_for, remove_folder, sweep, verified_records
from .runstore import RunStore
from .segment import SegmentEncoder
from .shardedrun import ShardedRun
from .storage import Storage
from .storage.spool import open_spool

__all__ = ["LocalTier", "merge_for_rank", "merge_local_tier", "read_local_tier"]

log = logging.getLogger("diffckpt")
_COPY = 8 << 20


@dataclass
class LocalTier:
    """What this node's journals hold for one stream, against its run root.

    Attributes:
        gen: the session the usable records belong to (``None``: none usable).
        after: the run root's newest durable step of that session, which they continue.
        records: ``(journal, lead, entry)`` of each usable record, in order, up to the newest
            restorable one.
        stale: journals of superseded sessions, or whose records the run root holds already.
        live: journals of processes still running (another job's session: never touched).
    """

    gen: int | None = None
    after: int | None = None
    records: list[tuple[JournalFile, dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    stale: list[JournalFile] = field(default_factory=list)
    live: list[JournalFile] = field(default_factory=list)
    used: list[JournalFile] = field(default_factory=list)

    @property
    def step(self) -> int | None:
        """The newest restorable step the local tier adds to the run root (``None``: none)."""
        return self.records[-1][2]["step"] if self.records else None


def read_local_tier(store: RunStore, local_dir: str | None, fence: Storage | None = None) -> LocalTier:
    """What this node's journals add to ``store``'s run root, read only (``diffckpt ls``).
    ``fence``: where the sessions are (the run root, for a rank's stream)."""
    tier = LocalTier()
    place = place_for(local_dir, store.storage.url)
    found = journals(place.folder, place.url) if place is not None else []
    if not found:
        return tier
    newest: dict[int, bool] = {}
    mine: list[JournalFile] = []
    for journal in found:
        if not journal.local:  # a shared local_dir: another host's, for a resume there
            continue
        if journal.in_use:
            tier.live.append(journal)
            continue
        if journal.gen not in newest:
            newest[journal.gen] = store.newer_session(journal.gen, fence) is None
        (mine if newest[journal.gen] else tier.stale).append(journal)
    if not mine:
        return tier
    gen = max(j.gen for j in mine)
    tier.stale += [j for j in mine if j.gen != gen]
    mine = [j for j in mine if j.gen == gen]
    durable = store.inventory().newest_step(gen)
    if durable is None:  # the session's first base never became durable: nothing to continue
        tier.stale += mine
        return tier
    runs = []
    for journal in mine:
        lead, good = verified_records(journal)
        if lead.get("gen") == gen and good:
            runs.append((journal, lead, good))
    chain: list[tuple[JournalFile, dict[str, Any], dict[str, Any]]] = []
    current = durable
    while True:  # the longest run of records that continues the chain, then the next one
        best: tuple[JournalFile, dict[str, Any], list[dict[str, Any]]] | None = None
        for journal, lead, good in runs:
            steps = [e["step"] for e in good]
            start = 0 if journal.after == current else steps.index(current) + 1 if current in steps else None
            # Each run of records in one compression becomes a segment of its own, which must end
            # at a restorable step: the writer decides compression per segment, at a cut.
            changes = bool(chain) and lead.get("compression") != chain[-1][1].get("compression")
            if start is None or (changes and not chain[-1][2]["restorable"]):
                continue
            if good[start:] and (best is None or len(good) - start > len(best[2])):
                best = (journal, lead, good[start:])
        if best is None:
            break
        chain += [(best[0], best[1], e) for e in best[2]]
        current = best[2][-1]["step"]
    restorable = [i for i, (_, _, e) in enumerate(chain) if e["restorable"]]
    tier.records = chain[: restorable[-1] + 1] if restorable else []
    if tier.records:
        tier.gen, tier.after = gen, durable
    tier.used = mine
    return tier


def merge_local_tier(store: RunStore, local_dir: str | None, fence: Storage | None = None) -> int | None:
    """Commit to ``store``'s run root what this node's journals add to it (see the module), then
    remove the journals that are of no more use; return the step it made durable, if any."""
    tier = read_local_tier(store, local_dir, fence)
    for journal in tier.live:
        if journal.pid == os.getpid():  # this process's own running session
            continue
        log.warning("diffckpt: the local journal %s is still being written (process %d): another session "
                    "writes %s; it is left alone", journal.path, journal.pid, store.storage.url)
    made = None
    if tier.records and tier.gen is not None and tier.after is not None:
        made = _commit(store, tier, fence)
    for journal in tier.stale + tier.used:
        journal.remove()
    place = place_for(local_dir, store.storage.url)
    if place is not None:
        sweep(place.folder)
        remove_folder(place.folder)
    return made


def _commit(store: RunStore, tier: LocalTier, fence: Storage | None) -> int | None:
    """Write the tier's records to the run root: a segment per run of one compression, in order,
    each fenced against a newer session; return the newest step committed."""
    assert tier.gen is not None and tier.after is not None
    gen, after = tier.gen, tier.after
    runs: list[list[tuple[JournalFile, dict[str, Any], dict[str, Any]]]] = []
    for record in tier.records:
        if runs and runs[-1][-1][1].get("compression") == record[1].get("compression"):
            runs[-1].append(record)
        else:
            runs.append([record])
    made = None
    for run in runs:
        name = _write_segment(store, gen, after, run, fence)
        if name is None:  # a job started since the journal was read: its records are stale
            break
        log.warning("diffckpt: the local tier on this host held steps %d..%d of session g%d that %s did not have "
                    "(a process crash); committed them as %s", after + 1, name.last, gen, store.storage.url,
                    name.path)
        after = made = name.last
    return made


def _write_segment(store: RunStore, gen: int, after: int, run: list[tuple[JournalFile, dict[str, Any], dict[str, Any]]],
                   fence: Storage | None) -> SegmentName | None:
    key = CHECKSUMS[FORMAT_VERSION].key
    compression = run[0][1]["compression"]
    encoder = SegmentEncoder({"gen": gen, "after": after}, compression, 1, decided=compression)
    name = SegmentName(after, run[-1][2]["step"], gen)
    entries = [{k: e[k] for k in ("step", "length", "raw_length", key)} for _, _, e in run]
    with open_spool(store.storage, name.path) as spool:
        spool.append([encoder.start()])
        for journal, _, entry in run:
            with open(journal.spool, "rb") as f:
                for pos in range(entry["offset"], entry["offset"] + entry["length"], _COPY):
                    f.seek(pos)
                    spool.append([f.read(min(_COPY, entry["offset"] + entry["length"] - pos))])
        spool.append([encoder.tail(entries, last=name.last)])
        if store.newer_session(gen, fence) is not None:
            spool.discard()
            return None
        store.storage.write(name.path, spool)
        spool.discard()
    return name


def merge_for_rank(storage: Storage, local_dir: str | None, rank: int) -> None:
    """What a process of rank ``rank`` merges before a restore locates its step: the run root's
    stream on rank 0 (the one a process records unless training is sharded), and the rank's own
    stream of sharded training. The local tier never stops a resume: a failure to merge is
    logged, and the restore goes on from what the run root holds."""
    if local_dir is None:
        return
    run = ShardedRun(storage)
    for store in ([run.root] if rank == 0 else []) + [run.stream(rank)]:
        try:
            merge_local_tier(store, local_dir, fence=storage)
        except (DiffCkptError, OSError) as exc:
            log.warning("diffckpt: could not take the local tier's records of %s into the run root (%s); "
                        "resuming from what the run root holds", store.storage.url, exc)

