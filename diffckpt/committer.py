"""How the background writer puts objects in the run root (the durable tier): each write fenced
against newer sessions and retried through outages, and segments and bases committed in order, one
at a time, in a thread of their own, so the writer encodes the next records while an upload runs.

Finished segments wait their turn as spools in the node-local tier (journaled, so a crash loses
none of them on this node). How long the writer lets them wait is ``durability``'s:

- ``"paced"`` (the default): training never waits for the durable tier. The durable tier takes
  every segment while it keeps up (at most ``WAITING`` segments or bases wait behind the one being
  committed); when it falls behind, a base handed over supersedes what waits before it (segments
  and older bases not started yet), so it takes bases at the pace of its bandwidth instead. A skipped segment is *parked*: its spool and journal stay in the node-local
  tier (a process crash loses nothing of it) until the base after it is durable. The writer waits
  only once the segments waiting and parked hold more than ``local_max_bytes``.
- ``"every_step"``: every segment is committed; at most ``WAITING`` segments or bases wait, then the
  writer, and so training, waits for storage.

A base is a snapshot of the state on the device (or host) that the commit thread copies to the
host only when its turn comes (:class:`PendingBase`); one superseded before that is never copied.
The segments after a base, which continue from its step, commit only once it is durable.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .checksums import Buffer, fingerprint
from .errors import ConcurrentWriterError, StorageUnavailableError
from .format import BaseName, SegmentName, base_commit
from .openseg import OpenSegment
from .outage import Outage
from .runstore import RunStore
from .snapshot import DeferredCopy
from .staging import HostStage
from .storage import Storage
from .storage.protocol import data_size
from .tree import pack_parts
from .tuning.meter import Meter
from .units import format_bytes

__all__ = ["Committer", "PendingBase"]

log = logging.getLogger("diffckpt")
WAITING = 2  # durability="every_step": segments or bases waiting behind the one committed, before the writer waits


@dataclass
class PendingBase:
    """A base handed to the commit thread: ``snapshot`` is ``(tree, params)``, the copies taken at
    its step (on the device under CUDA), staged to the host by ``stage`` after the events ``ready``
    and packed only when its commit starts (:meth:`pack`). ``let_go`` drops every copy (once:
    written, failed, superseded or given up); ``pack_s``, the time staging and packing took, counts
    in ``write_seconds`` with the commit's, as a segment's encoding does."""

    name: BaseName
    snapshot: tuple[dict[str, Any], list[torch.Tensor]] | None
    ready: list[Any]
    stage: HostStage
    copying: DeferredCopy | None = None  # host copies still being made (snapshot.py)
    size: int = 0
    pack_s: float = 0.0
    _staged: list[torch.Tensor] = field(default_factory=list, repr=False)

    def pack(self, meter: Meter | None) -> tuple[list[Buffer], list[torch.Tensor]]:
        """The base's parts (views of its host copy, no copy) and its parameters to fingerprint."""
        assert self.snapshot is not None, "a base is packed once"
        start = time.monotonic()
        if self.copying is not None:
            self.copying.result()  # raises if what it copied changed outside the optimizer first
        # Into ordinary memory: pinned buffers of a base's shapes would hold the pinned bound for
        # a copy made once an interval, off the training path (staging.py).
        (tree, params), self._staged = self.stage.to_host(self.snapshot, self.ready, pooled=False)
        self.snapshot = None  # the device copy goes now that the host has one
        parts = pack_parts(tree)
        self.size, self.pack_s = sum(len(p) for p in parts), time.monotonic() - start
        if meter is not None:
            meter.add_base(self.size, self.pack_s)
        return parts, params

    def keep(self) -> None:
        """Given up (the writer was abandoned): nothing of a base stays; its memory goes."""
        self.let_go()

    def let_go(self) -> None:
        self.snapshot = None
        self.stage.release(self._staged)
        self._staged = []


class Committer:
    """The writes of one writer (session ``gen``): ``storage`` and ``fence`` already stop
    retrying once ``abandon`` is set; ``stats`` is the writer's ``WriterStats``; ``held`` says
    how many bytes the writer holds (for the outage's messages); ``fail`` keeps a commit thread's
    error for the training thread. ``paced``: ``durability="paced"`` (the module doc), with
    ``local_max_bytes`` the bytes of segments that may wait or be parked before the writer waits."""

    BEHIND_S = 1.0  # how long the oldest waiting item has waited when the durable tier is behind

    def __init__(self, store: RunStore, gen: int, storage: Storage, fence: Storage, abandon: threading.Event,
                 outage: Outage, stats: Any, meter: Meter | None, max_backoff_s: float,
                 held: Callable[[], int], fail: Callable[[BaseException], None], paced: bool = False,
                 local_max_bytes: int = 0) -> None:
        self.store, self.gen, self.storage, self.fence = store, gen, storage, fence
        self.abandon, self.outage, self.stats, self.meter = abandon, outage, stats, meter
        self.max_backoff_s, self.held, self.fail = max_backoff_s, held, fail
        self.paced, self.local_max_bytes = paced, local_max_bytes
        self.durable_step: int | None = None
        self.thread: threading.Thread | None = None  # the commit thread, while it has segments
        self.error: BaseException | None = None  # the commit thread's, once it failed
        # (segment or base, its name, records, raw bytes, when it was handed over), in order
        self._queue: collections.deque[tuple[OpenSegment | PendingBase, SegmentName | BaseName, int, int, float]] = \
            collections.deque()
        self.parked: list[tuple[OpenSegment, SegmentName]] = []  # skipped, kept until a base after them is durable
        self.skipped_segments = self.superseded_bases = 0
        self._lock = threading.Lock()
        # Whether the commit thread takes the queue on: set and cleared under the lock, so a
        # segment handed over just as the thread ends is never left without one.
        self._running = False
        self._warned = False
        self.stage = HostStage()  # the bases' own: the writer's records never wait behind a base's copy

    def write(self, path: str, data: Any) -> None:
        """Write one object: fenced against newer sessions, retried through outages until it is
        written or the writer is abandoned."""
        start, failed = time.monotonic(), False
        while True:
            if self.abandon.is_set():  # close() gave up: start no write it has reported lost
                raise StorageUnavailableError(f"the writer was abandoned before {path} was written")
            try:
                self.check_fence()
                self.storage.write(path, data)
                break
            except StorageUnavailableError as exc:
                if self.abandon.is_set():
                    raise
                failed = True
                self.outage.note(path, exc, self.durable_step, self.held())
                if self.abandon.wait(self.max_backoff_s):
                    raise
        if self.meter is not None and not failed:  # what a request costs here, fence check included
            self.meter.add_write(data_size(data), time.monotonic() - start)
        self.outage.over(self.held())

    def check_fence(self) -> None:
        newer = self.store.newer_session(self.gen, self.fence)
        if newer is not None:
            raise ConcurrentWriterError(
                f"another job started writing to {self.store.storage.url} (session g{newer.get('gen')}, host "
                f"{newer.get('host', '?')}, pid {newer.get('pid', '?')}, resumed from step "
                f"{newer.get('resumed_from', '?')}); this job (session g{self.gen}) stopped writing so the two do "
                f"not interleave. Its steps up to {self.durable_step} stay restorable. Stop this job, or give "
                "each job its own dirpath")

    def start(self, segment: OpenSegment | PendingBase, name: SegmentName | BaseName, records: int, raw: int) -> None:
        """Commit a finished segment (or a base) after those handed over before it, in the commit
        thread. First wait while too much waits (``WAITING`` items, or paced: ``local_max_bytes``);
        a paced base supersedes what waits before it. A wait that ends in an error (the writer
        abandoned, a commit failed) keeps the segment's spool and journal for the local tier."""
        try:
            if not self.paced:
                self.settle(WAITING)
            elif isinstance(segment, OpenSegment):
                self._wait_for_room()
        except BaseException:
            segment.keep()
            raise
        with self._lock:
            if self.paced and isinstance(segment, PendingBase):
                self._supersede()
            self._queue.append((segment, name, records, raw, time.monotonic()))
            if self._running:
                return
            self._running = True
            thread = threading.Thread(target=self._commit_segments, name=f"diffckpt-commit-g{self.gen}", daemon=True)
            try:
                thread.start()
                self.thread = thread
                return
            except RuntimeError:  # Python 3.12+ starts no thread at interpreter shutdown (a flush at exit)
                pass
        self._commit_segments()  # so the writer thread commits, in order, before it goes on

    def _supersede(self) -> None:
        """A base is handed over (paced, under the lock). While at most ``WAITING`` items wait, or
        the oldest has waited less than ``BEHIND_S``, the durable tier keeps up (a burst of small
        commits on a busy machine is not a backlog): the base commits after them. Past that it is
        behind, and what waits and has not started goes: segments are parked (the base carries
        their effect; a crash before it is durable takes them back from the local tier), older
        bases let go."""
        started = 1 if self._running and self._queue else 0
        waiting = list(self._queue)[started:]
        if len(waiting) <= WAITING or time.monotonic() - waiting[0][4] < self.BEHIND_S:
            return
        while len(self._queue) > started:
            item, name, _, _, _ = self._queue.pop()
            if isinstance(item, PendingBase):
                item.let_go()
                self.superseded_bases += 1
            else:
                assert isinstance(item, OpenSegment) and isinstance(name, SegmentName)
                self.skipped_segments += 1
                if item.journal is None:  # no local tier: nothing could take it back
                    item.discard()
                else:
                    self.parked.insert(0, (item, name))

    def waiting_bytes(self) -> int:
        """Bytes of finished segments in the local tier, not durable: waiting or parked."""
        with self._lock:
            waiting = [q[0] for q in self._queue if isinstance(q[0], OpenSegment)] + [s for s, _ in self.parked]
            return sum(s.spool.size for s in waiting)

    def _wait_for_room(self) -> None:
        """Paced: wait while the segments waiting and parked hold more than ``local_max_bytes``
        (each is freed by its commit, or by the commit of the base after it)."""
        while self.error is None and self.waiting_bytes() > self.local_max_bytes:
            if not self._warned:
                self._warned = True
                log.warning("diffckpt: the durable tier (%s) is behind and the segments waiting for it hold more "
                            "than local_max_bytes (%s): the writer, and so training, waits for it. A smaller "
                            "base_every_n_steps lets bases supersede what waits; or raise local_max_bytes",
                            self.store.storage.url, format_bytes(self.local_max_bytes))
            self.thread.join(0.05) if self.thread is not None else time.sleep(0.05)
            if self.abandon.is_set():
                raise StorageUnavailableError("the writer was abandoned while it waited for the durable tier")
        if self.error is not None:
            raise self.error

    def settle(self, waiting: int = 0) -> None:
        """Wait until at most ``waiting`` segments are handed over and not committed (``0``: all
        are; an abandoned writer stops waiting), and raise the commit thread's error."""
        while self.error is None and len(self._queue) > waiting:
            assert self.thread is not None  # a segment is queued: the commit thread runs
            self.thread.join(0.05)
            if self.abandon.is_set():
                raise StorageUnavailableError("the writer was abandoned while a segment was being committed")
        if self.error is not None:
            raise self.error

    @property
    def in_flight(self) -> bool:
        """Whether a segment is handed over and not committed (or given up) yet."""
        return self._running

    def _commit_segments(self) -> None:
        while True:
            with self._lock:
                if not self._queue or self.error is not None:
                    self._running = False
                    return
                item = self._queue[0]
            segment, name, records, raw, _ = item
            if isinstance(segment, PendingBase):
                self._commit_base(segment)
            else:
                assert isinstance(name, SegmentName)
                self._commit_segment(segment, name, records, raw)
            with self._lock:
                if self._queue and self._queue[0] is item:  # keep_waiting may have taken it
                    self._queue.popleft()

    def keep_waiting(self) -> None:
        """Keep the spools of the segments not committed, parked ones included (the writer gave
        up): their journals let a resume on this node take their records back."""
        with self._lock:
            busy = self.in_flight  # the one being committed is the commit thread's to keep or discard
            while len(self._queue) > busy:
                self._queue.pop()[0].keep()
            while self.parked:
                self.parked.pop()[0].keep()

    def _commit_segment(self, segment: OpenSegment, name: SegmentName, records: int, raw: int) -> None:
        start = time.monotonic()
        size = segment.spool.size
        try:
            self.write(name.path, segment.spool)
        except BaseException as exc:  # re-raised on the training thread, as the writer's are
            self.error = exc
            if not self.abandon.is_set():  # close() logs what an abandoned writer lost
                log.error("diffckpt: background write failed: %s", exc)
            self.fail(exc)
            segment.keep()
            return
        segment.discard()
        self.stats.write_seconds += time.monotonic() - start + segment.encode_s
        self.stats.segments += 1
        self.stats.records += records
        self.stats.segment_bytes += size
        self.stats.raw_record_bytes += raw
        self.durable_step = name.last

    def _commit_base(self, base: PendingBase) -> None:
        """``state.safetensors`` first and ``COMMIT`` last (readers ignore a base without it);
        the host copy, the fingerprint and the file's hash are made here, off the writer thread.
        Once it is durable, the segments parked before it go."""
        name, start = base.name, time.monotonic()
        try:
            parts, params = base.pack(self.meter)
            self.write(name.state_path, parts)
            self.write(name.commit_path, base_commit(name.step, self.gen, fingerprint(params), parts))
        except BaseException as exc:  # as a segment's: no later segment commits (it would continue nothing)
            self.error = exc
            if not self.abandon.is_set():
                log.error("diffckpt: background write failed: %s", exc)
            self.fail(exc)
            return
        finally:
            base.let_go()
        self.stats.write_seconds += time.monotonic() - start
        self.stats.bases += 1
        self.stats.base_bytes += base.size
        self.durable_step = name.step if self.durable_step is None else max(self.durable_step, name.step)
        with self._lock:
            gone = [s for s, n in self.parked if n.last <= name.step]
            self.parked = [(s, n) for s, n in self.parked if n.last > name.step]
        for segment in gone:
            segment.discard()
