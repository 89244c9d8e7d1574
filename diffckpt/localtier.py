"""Resuming from the node-local tier: what a crashed session journaled on this node and the run
root did not get, checked and committed to the run root before the restore locates its step.

A journal counts only when it continues the run root's newest durable chain of its session, and
no later session made a step durable since (a job that started later and wrote its base
superseded it: the journal is stale; one that died before its first base did not). A journal
whose lock is held is another process's (a running writer, or another rank taking it back), left
alone; a resume takes the lock of every journal it merges or removes. Every record is checked
against the checksum its journal recorded; a damaged or torn one ends what is taken. What is
taken is written as one segment of the crashed session, up to its newest restorable step, straight
from the spools (no copy: no extra disk), so a restore (here or on another node) sees an ordinary
run root. Then the journals of that session go. A commit that fails leaves every journal as it
was and stops the resume with an error: a resume that went on would supersede them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .errors import CheckpointNotFoundError, DiffCkptError, StorageError
from .format import CHECKSUMS, FORMAT_VERSION, SegmentName
from .inventory import Inventory
from .journal import place_for, remove_folder
from .journalfile import JournalFile, journals, sweep, verified_records
from .planning import continued_end
from .runstore import RunStore, session_path
from .segment import SegmentEncoder
from .shardedrun import ShardedRun
from .storage import Storage
from .storage.nodelocal import open_private, private_folder

__all__ = ["LocalTier", "merge_for_rank", "merge_local_tier", "read_local_tier"]

log = logging.getLogger("diffckpt")


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

    def release(self) -> None:
        """Let go of every journal claimed (``read_local_tier(claim=True)``)."""
        for journal in self.stale + self.used:
            journal.release()


def read_local_tier(store: RunStore, local_dir: str | None, fence: Storage | None = None,
                    claim: bool = False) -> LocalTier:
    """What this node's journals add to ``store``'s run root (``diffckpt ls``, ``gc``).
    ``fence``: where the sessions are (the run root, for a rank's stream). ``claim``: take the
    lock of each journal not in use, to merge or remove it (:meth:`LocalTier.release`)."""
    tier = LocalTier()
    place = place_for(local_dir, store.storage.url)
    if place is None:
        return tier
    try:  # nothing in a folder that is not this user's own is read
        if not private_folder(os.path.dirname(place.folder), create=False):
            return tier
    except StorageError as exc:
        log.warning("diffckpt: not reading the local tier: %s", exc)
        return tier
    found = journals(place.folder, place.url, claim)
    if not found:
        return tier
    invs = _inventories(store, fence)  # listed once: every session's durable steps
    superseded: dict[int, bool] = {}
    mine: list[JournalFile] = []
    for journal in found:
        if not journal.local:  # a shared local_dir: another host's, for a resume there
            journal.release()
            continue
        if journal.in_use:
            tier.live.append(journal)
            continue
        if journal.gen not in superseded:
            superseded[journal.gen] = _superseded(invs, journal.gen)
        (tier.stale if superseded[journal.gen] else mine).append(journal)
    ours = {g: _same_run(store, g) for g in {j.gen for j in mine}}  # before the newest is chosen
    tier.stale += [j for j in mine if not ours[j.gen](j)]
    mine = [j for j in mine if ours[j.gen](j)]
    if not mine:
        return tier
    gen = max(j.gen for j in mine)
    tier.stale += [j for j in mine if j.gen != gen]
    mine = [j for j in mine if j.gen == gen]
    # A session that continues a restored step journals on from it before its own base is durable
    durable = invs[0].newest_step(gen)
    durable = continued_end(store, invs[0], gen) if durable is None else durable
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


def _same_run(store: RunStore, gen: int) -> Callable[[JournalFile], bool]:
    """Which journals of session ``gen`` belong to the run root's session ``gen``: none where the
    run root has no such session (a run made anew at the URL, not that far yet), and where its
    session file has an id, those that name it (a journal of an older run that had the same URL
    and session number is another run's: its records would poison the replay)."""
    try:
        meta = json.loads(store.storage.read(session_path(gen)))
    except CheckpointNotFoundError:
        return lambda journal: False
    except (ValueError, RecursionError, DiffCkptError, OSError):  # unreadable: it cannot tell
        return lambda journal: True
    sid = meta.get("id") if isinstance(meta, dict) else None
    return lambda journal: sid is None or journal.session is None or journal.session == sid


def moved_on(store: RunStore, gen: int, fence: Storage | None = None) -> bool:
    """Whether a session after ``gen`` made a step durable (a base) in ``store``'s stream or at
    the run root ``fence``: the run went on without what ``gen`` journaled, and a restore follows
    the newest session with a base. A later session that died before its first base changed
    nothing, and does not make ``gen``'s journals stale."""
    return _superseded(_inventories(store, fence), gen)


def _inventories(store: RunStore, fence: Storage | None) -> list[Inventory]:
    """The stream's inventory, then the run root's where the stream is a rank's."""
    stores = [store] + ([RunStore(fence)] if fence is not None and fence.url != store.storage.url else [])
    return [s.inventory() for s in stores]


def _superseded(invs: list[Inventory], gen: int) -> bool:
    return any(g > gen and inv.newest_step(g) is not None for inv in invs for g in inv.gens())


def merge_local_tier(store: RunStore, local_dir: str | None, fence: Storage | None = None) -> int | None:
    """Commit to ``store``'s run root what this node's journals add to it (see the module), then
    remove the journals that are of no more use; return the step it made durable, if any.

    Raises:
        DiffCkptError: the records could not be committed; every journal is left as it was.
    """
    tier = read_local_tier(store, local_dir, fence, claim=True)
    try:
        for journal in tier.live:
            if journal.pid == os.getpid():  # this process's own running session
                continue
            log.warning("diffckpt: the local journal %s is in use (written by process %d, or being taken back by "
                        "another process of this host): it is left alone", journal.path, journal.pid)
        made = None
        if tier.records and tier.gen is not None and tier.after is not None:
            try:
                made = _commit(store, tier, fence)
            except (DiffCkptError, OSError) as exc:
                first, last = tier.after + 1, tier.records[-1][2]["step"]
                raise DiffCkptError(
                    f"the local tier on this host holds steps {first}..{last} of session g{tier.gen} that "
                    f"{store.storage.url} does not have, and committing them failed: {exc}. They are kept in "
                    f"{os.path.dirname(tier.records[0][0].path)}: fix the cause and resume again (a resume that "
                    "went on now would supersede them), or resume with CheckpointOptions(local_dir=None) to go "
                    "on without them") from exc
        for journal in tier.stale + tier.used:
            journal.remove()
    finally:
        tier.release()
    place = place_for(local_dir, store.storage.url)
    if place is not None:
        sweep(place.folder)
        remove_folder(place.folder)
    return made


def _commit(store: RunStore, tier: LocalTier, fence: Storage | None) -> int | None:
    """Write the tier's records to the run root: a segment per run of one compression, in order,
    each checked against a session that superseded them; return the newest step committed."""
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
        if name is None:  # a job made a step durable since the journal was read: its records are stale
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
    if moved_on(store, gen, fence):
        return None
    with _mapped({j.spool for j, _, _ in run}) as maps:
        # the records' bytes straight from the spools (the page cache), checked when read: no copy
        parts: list[bytes | memoryview] = [encoder.start()]
        parts += [maps[j.spool][e["offset"]: e["offset"] + e["length"]] for j, _, e in run]
        parts.append(encoder.tail(entries, last=name.last))
        try:
            store.storage.write(name.path, parts)
        finally:
            parts.clear()  # the views go before the maps close
    return name


@contextlib.contextmanager
def _mapped(paths: set[str]) -> Iterator[dict[str, memoryview]]:
    """Each spool of ``paths`` mapped read-only, as a memoryview (regular files, no link followed)."""
    maps: list[mmap.mmap] = []
    try:
        views: dict[str, memoryview] = {}
        for path in sorted(paths):
            fd = open_private(path, owner=False)  # named by a journal of this user's own
            try:
                maps.append(mmap.mmap(fd, 0, access=mmap.ACCESS_READ))
            finally:
                os.close(fd)  # the map holds the file
            views[path] = memoryview(maps[-1])
        yield views
    finally:
        for mapped in maps:
            # a view still held (by an error's traceback) keeps its map until it goes
            with contextlib.suppress(BufferError):
                mapped.close()


def merge_for_rank(storage: Storage, local_dir: str | None, rank: int) -> None:
    """What a process of rank ``rank`` merges before a restore locates its step: the run root's
    stream (on every rank: after a restart the node that journaled it may host any rank, and the
    journal's lock lets only one process take it) and the rank's own stream of sharded training.

    Raises:
        DiffCkptError: journaled steps could not be committed (:func:`merge_local_tier`).
    """
    if local_dir is None:
        return
    run = ShardedRun(storage)
    for store in [run.root, run.stream(rank)]:
        merge_local_tier(store, local_dir, fence=storage)
