"""The background writer: one thread that encodes, batches and commits records and bases.

The training thread hands over already-copied records through a queue bounded in bytes
(``handoff.py``: when it is full training waits and a warning says so; nothing is dropped). The
first background error is kept and re-raised on the training thread (next put, flush or close).

Storage outages: a write that keeps failing transiently past the retry budget is retried at the
policy's longest backoff until it succeeds, while training goes on and the queue fills. Once the
queue is full, training waits (``on_storage_error="block"``) or gets a
:class:`~diffckpt.StorageUnavailableError` (``"raise"``). Before each commit the writer checks
that no newer session started on the run root, and stops with a
:class:`~diffckpt.ConcurrentWriterError` if one did (fencing an old job that still runs).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .committer import Committer, PendingBase
from .errors import DiffCkptError, StorageUnavailableError
from .format import BaseName
from .handoff import HandOff
from .journal import place_for, remove_folder, resolve_local_dir, tier_budget
from .journalfile import sweep_dead_once
from .leases import Lease, reading
from .lossbound import LossBound
from .openseg import OpenSegment
from .options import SEGMENT_BYTES, CheckpointOptions
from .outage import Outage
from .recordprep import prepare_record
from .runstore import RunStore, loss_path
from .snapshot import DeferredCopy
from .staging import HostStage
from .storage import Storage
from .storage.retry import RetryingStorage
from .storage.spool import release_free_spools
from .tuning.meter import Meter
from .writerstats import WriterStats

__all__ = ["BackgroundWriter", "WriterStats"]

log = logging.getLogger("diffckpt")


class BackgroundWriter:
    """Owns the writer thread of one session (``gen``) of a run."""

    def __init__(self, store: RunStore, gen: int, options: CheckpointOptions, after: int,
                 meter: Meter | None = None, write_batch: int | None = None, fence: Storage | None = None,
                 narrow_grads: bool = True, session: str | None = None) -> None:
        self.store = store
        self.gen = gen
        self.options = options
        # Records per segment; the auto-tuner changes it through retarget() while training runs.
        self.write_batch = write_batch if write_batch is not None else int(options.write_batch)
        self._cut_next = False
        self.stats = WriterStats()
        self.last_step = after  # newest step handed to the writer
        self._after = after  # step the next segment continues from
        self._open: OpenSegment | None = None  # records written to a spool, not committed yet
        self.stage = HostStage()
        # Called on the training side before it waits for this thread (a full queue, a flush) to
        # end the leases this thread may wait for (StepCapture.end_leases), sparing the new item's.
        self.before_wait: Callable[[list[Lease]], None] | None = None
        self._abandon = threading.Event()
        storage = store.storage
        self.storage = storage.with_cancel(self._abandon) if isinstance(storage, RetryingStorage) else storage
        # Newer sessions are announced where this session was: a rank stream of sharded training
        # is fenced by the run root's session files, whatever layout the newer job has.
        fence = storage if fence is None else fence
        fence = fence.with_cancel(self._abandon) if isinstance(fence, RetryingStorage) else fence
        self.narrow_grads = narrow_grads  # gradients stored in 16 bits where exact (narrowing.py)
        # The node-local tier: each open segment's records journaled beside its spool, and at most
        # one record handed over and not journaled, so a process crash loses at most that step.
        self.journal = place_for(options.local_dir, store.storage.url, session)
        if options.local_dir is not None:  # what dead processes left on this node, once a process
            sweep_dead_once(resolve_local_dir(options.local_dir))
        self.loss: LossBound | None = None  # what each failure loses, as stated last
        self.journaled_step: int | None = None  # the newest step in the local tier
        self.journaled_restorable: int | None = None  # ... and the newest a resume there takes back
        self.outage = Outage(store.storage.url, options, self.stats)
        self._error: BaseException | None = None
        self._handoff = HandOff(options, self.outage, self.stats, lambda: self._error is not None,
                                lambda: self.durable_step)
        self._committer = Committer(store, gen, self.storage, fence, self._abandon, self.outage, self.stats,
                                    meter, options.retry.max_backoff_s, lambda: self._handoff.queued_bytes, self._fail,
                                    options.durability == "paced", tier_budget(options.local_dir, options.local_max_bytes))
        self._last_buffers: dict[str, torch.Tensor] | None = None
        self._thread = threading.Thread(target=self._run, name=f"diffckpt-writer-g{gen}", daemon=True)
        self._thread.start()

    @property
    def meter(self) -> Meter | None:
        """What times the writes for the auto-tuner (set once tuning starts)."""
        return self._committer.meter

    @meter.setter
    def meter(self, meter: Meter | None) -> None:
        self._committer.meter = meter

    @property
    def durable_step(self) -> int | None:
        """The newest step committed to the run root (``None`` before the first)."""
        return self._committer.durable_step

    @durable_step.setter
    def durable_step(self, step: int | None) -> None:
        self._committer.durable_step = step

    @property
    def queued_bytes(self) -> int:
        """Bytes the writer holds: records and bases handed over and not yet written (queued,
        or being encoded). What counts against ``max_pending_bytes``; a record written to the
        open segment's spool no longer does, and its memory is let go."""
        return self._handoff.queued_bytes

    # ------------------------------------------------------------ training side
    def put_record(self, record: dict[str, Any], nbytes: int, leases: list[Lease] | None = None,
                   ready: Any = None) -> None:
        """Queue one step record: its tensors copied, or leased from training (``leases``, journaled
        once they ended cleanly); ``ready``: the event after its device work (HostStage.mark)."""
        self._put("record", (record, leases or [], ready), nbytes)
        self.last_step = record["step"]

    def put_base(self, step: int, tree: dict[str, Any], params: list[torch.Tensor], nbytes: int,
                 ready: Any = None, copying: DeferredCopy | None = None) -> None:
        """Queue a full base; ``params``: its parameters to fingerprint (``ready``, ``copying``: PendingBase's)."""
        self._put("base", (step, tree, params, ready, copying), nbytes)

    def retarget(self, write_batch: int) -> None:
        """Take a new ``write_batch`` (the auto-tuner's) from the next record queued on.

        The first restorable record after it cuts a segment whatever is pending, so segments line
        up with the new restorable steps at once: records left pending from the old settings
        would otherwise stretch the first segment to nearly twice its size."""
        self._put("retarget", write_batch, 0)  # in order: records queued before keep the old rule

    def state_loss(self, bound: LossBound) -> None:
        """Take what each failure loses (stated at the first record, then as measurements settle:
        ``lossbound.Restating``) unless it says what was stated: logged, in the metrics, and
        written for ``diffckpt ls`` (``sessions/g<gen>.loss.json``) by the writer thread, which cuts no
        segment for it (as :meth:`call` would)."""
        if self.loss is not None and self.loss.same_steps(bound):
            return
        self.loss = bound
        log.info("diffckpt: %s", bound.text)
        self._put("note", (loss_path(self.gen), json.dumps(dataclasses.asdict(bound)).encode()), 0)

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the writer thread after everything queued before it is durable."""
        self._put("call", fn, 0)

    def flush(self, timeout: float | None = None) -> int | None:
        """Block until everything queued so far is committed; return the durable step.

        Raises:
            TimeoutError: not done within ``timeout`` seconds (the writer goes on).
            StorageUnavailableError: storage is in an outage and ``on_storage_error="raise"``.
        """
        if self.before_wait is not None:
            self.before_wait([])
        done = threading.Event()
        self._put("flush", done, 0)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done.wait(0.1):
            self._raise_if_failed()
            self.outage.raise_if("a flush cannot complete", self.durable_step)
            if not self._thread.is_alive():
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"diffckpt: flush not done within {timeout}s")
        self._raise_if_failed()
        return self.durable_step

    def close(self, timeout: float | None = None) -> int | None:
        """Flush, stop the thread, and return the durable step.

        With ``timeout``, give up flushing after that many seconds (preemption leaves little
        time): what is not committed by then is lost, and an error is logged that says which
        steps are durable and which are not. Without it, wait as ``on_storage_error`` says.
        Whatever ends the flush (an error, an interrupt), :meth:`_settle_local` runs before it returns.
        """
        if self._handoff.closed:
            return self.durable_step
        abandoned, reason = False, ""
        try:
            self.flush(timeout)
        except (TimeoutError, StorageUnavailableError) as exc:
            abandoned = True
            self._abandon.set()  # ends the writer's retries; no write is attempted after this
            reason = str(exc) if isinstance(exc, StorageUnavailableError) else f"not done within {timeout}s"
            if timeout is None:  # on_storage_error="raise" during an outage
                raise
        except BaseException:  # a writer error, or e.g. KeyboardInterrupt while waiting: do not wait on the thread
            abandoned = True
            self._abandon.set()
            raise
        finally:
            self._handoff.close()
            # An abandoned writer may sit in a network call: its daemon threads are let be after a few
            # seconds, which makes the durable step reported below final in all but a hung request.
            deadline = time.monotonic() + 5.0
            self._thread.join(timeout=5.0 if abandoned else None)
            if abandoned and self._committer.thread is not None:
                self._committer.thread.join(max(0.0, deadline - time.monotonic()))
            if abandoned and reason:
                self._log_abandoned(reason)
            self._settle_local(abandoned)
        return self.durable_step

    def _settle_local(self, abandoned: bool) -> None:
        """After the writer stopped: the spools and journals of the segments the run root did not get stay
        for the node-local tier, closed (their locks go: a resume, in this process too, takes them)."""
        kept = abandoned or self._error is not None
        if kept:
            self._committer.keep_waiting()
        if self._open is not None and not self._thread.is_alive():
            if len(self._open) and not kept:
                log.info("diffckpt: %d trailing step(s) after the last restorable step were not kept",
                         len(self._open))
            self._open.keep() if kept else self._open.discard()
            self._open = None
        release_free_spools()  # their memory goes back once a writer ends (spool.KEEP_FREE)
        if self.journal is not None and not self._committer.in_flight:
            remove_folder(self.journal.folder)

    def _tier_lost(self, exc: BaseException) -> None:
        """The node-local tier failed (its folder unwritable or full): train on without it."""
        if self.journal is None:
            return
        self.journal = None  # records are no longer held back for the journal
        log.warning("diffckpt: the node-local tier is off for the rest of this session: %s. Training goes on; a "
                    "process crash now loses the steps not yet durable in %s (up to write_batch=%d records and "
                    "the segments waiting for their upload) instead of at most one. Free space there, or set "
                    "CheckpointOptions(local_dir=...) to a writable folder on a local disk (None: go without)",
                    exc, self.store.storage.url, self.write_batch)

    def _log_abandoned(self, reason: str) -> None:
        durable, url = self.durable_step, self.store.storage.url
        lost = f"steps {(durable or 0) + 1}..{self.last_step}" if self.last_step > (durable or 0) else "no step"
        landing = " (an upload still in flight may yet make some of them durable)" if self._committer.in_flight else ""
        log.error("diffckpt: gave up the final flush (%s): durable up to step %s in %s; %s were not written "
                  "and are lost%s", reason, durable, url, lost, landing)
        kept = self.journaled_restorable  # a resume takes back records up to a restorable step only
        if self.journal is not None and kept is not None and kept > (durable or 0):
            log.warning("diffckpt: of those, steps %d..%d are kept in the local tier on this host (%s): a resume on this "
                        "node takes them back into %s", (durable or 0) + 1, kept, self.journal.folder, url)

    def check(self) -> None:
        """Re-raise the first background error, if any."""
        self._raise_if_failed()

    def _fail(self, exc: BaseException) -> None:
        self._error = self._error or exc  # the first error is the one re-raised

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise DiffCkptError(f"diffckpt background writer failed: {self._error}") from self._error

    def _put(self, kind: str, item: Any, nbytes: int) -> None:
        self._raise_if_failed()
        if self._handoff.closed:
            raise DiffCkptError("the checkpoint writer is closed; create a new one to write more")
        behind = kind == "record" and self.journal is not None  # waits for the record before it
        if self.before_wait is not None and self._handoff.must_wait(nbytes, behind):
            began = time.monotonic()  # ending leases may wait for the writer's read: a stall too
            self.before_wait(item[1] if kind == "record" else [])
            self.stats.stall_seconds += time.monotonic() - began
        self._handoff.put(kind, item, nbytes, behind)
        self._raise_if_failed()

    # -------------------------------------------------------------- writer side
    def _run(self) -> None:
        while (taken := self._handoff.take()) is not None:
            kind, item, nbytes = taken
            try:
                if self._error is None:
                    self._handle(kind, item)
            except BaseException as exc:  # kept and re-raised on the training thread
                if exc is not self._error:  # a commit's error is logged where it happened
                    log.error("diffckpt: background write failed: %s", exc)
                    self._error = exc
            finally:
                if kind == "flush":
                    item.set()
                item = taken = None  # a record's memory goes now that its bytes are written
                self._handoff.done(nbytes)

    def _handle(self, kind: str, item: Any) -> None:
        if kind == "record":
            self._add_record(*item)
        elif kind == "base":
            self._queue_base(*item)
        elif kind == "call":
            self._write_segment()
            item()
        elif kind == "flush":
            self._write_segment()
        elif kind == "note":  # a small informational object: its loss stops nothing
            try:
                self.storage.write(*item)
            except Exception as exc:
                log.warning("diffckpt: could not write %s (informational: diffckpt ls will not show it): %s", item[0], exc)
        elif kind == "retarget":
            self.write_batch, self._cut_next = item, True

    def _add_record(self, record: dict[str, Any], leases: list[Lease], ready: Any) -> None:
        step, restorable = record["step"], record.get("state") is not None
        try:
            if self._open is None:
                self._open = OpenSegment(self.storage, self.gen, self._after, self.options.compression,
                                         self.options.compression_level, journal=self.journal, lost=self._tier_lost)
            # Read at once, though training may still hold the gradients, and journaled once it let
            # go of them unchanged (leases.py): a loop lets go only when its next step begins.
            with reading(leases, judge=True):
                self._encode(record, ([ready] if ready is not None else []) + [e for x in leases for e in x.ready])
                for event in record["events"]:  # written: no reference of this thread's to count
                    event.pop("grads", None)
            began = time.monotonic()
            self._open.journal_last(leases, self._abandon)
            self.stats.lease_wait_seconds += time.monotonic() - began
            if self.meter is not None:  # what a state adds
                self.meter.add_encoded(self._open.encoder.entries[-1]["raw_length"], restorable)
            self.journaled_step = step if self.journal is not None else None
            if self.journaled_step is not None and restorable:
                self.journaled_restorable = self.journaled_step
        finally:
            self._handoff.journaled()
        if restorable and (self._cut_next or len(self._open) >= self.write_batch
                           or self._open.spool.size >= SEGMENT_BYTES):
            self._cut_next = False
            self._write_segment(wait=False)

    def _encode(self, record: dict[str, Any], events: list[Any]) -> None:
        """Narrow, stage and add ``record`` to the open segment, not journaled yet."""
        assert self._open is not None
        began = time.monotonic()
        narrow = self.stage.narrow(record) if self.narrow_grads else ()
        record, staged = self.stage.to_host(record, events, narrow)
        self._last_buffers = prepare_record(record, self._last_buffers, bool(staged))
        staged_at = time.monotonic()
        self.stats.stage_seconds += staged_at - began
        try:
            self._open.add(record, journal=False)  # a full disk: a StorageError naming the folder
            self.stats.appended += 1
        finally:
            self.stage.release(staged)
            self.stats.append_seconds += time.monotonic() - staged_at

    def _write_segment(self, wait: bool = True) -> None:
        """Commit the open segment's records up to the newest restorable one; the rest stay open.

        The commit (a rename on local disk, an upload on object stores) runs in a thread of its
        own, so that the writer encodes the next records meanwhile and training does not wait for
        an upload while storage keeps up. One commit at a time: segments (and bases) become durable
        in order. ``wait``: return only once everything handed over is committed (a flush, a call);
        a segment cut at ``write_batch`` or before a base does not wait."""
        segment = self._open
        cut = segment.cut() if segment is not None else 0
        if segment is not None and cut:
            entries = segment.encoder.entries[:cut]
            raw = sum(e["raw_length"] for e in entries)
            name, self._open = segment.finish(cut)
            if self.meter is not None:
                self.meter.add_segment(raw, segment.spool.size, segment.encode_s)
            self._after = name.last
            self._committer.start(segment, name, cut, raw)
        if wait:
            self._committer.settle()

    def _queue_base(self, step: int, tree: dict[str, Any], params: list[torch.Tensor], ready: Any,
                    copying: DeferredCopy | None) -> None:
        """Cut the open segment and hand it and the base, in order, to the commit thread, which copies
        the base to the host when its turn comes (PendingBase): training waits neither for that
        nor for the upload, only for the records after it to be journaled."""
        self._write_segment(wait=False)
        if self._open is not None:  # records to the base's step: none restorable, the base has them
            self._open = self._open.drop_through(step)
        base = PendingBase(BaseName(step, self.gen), (tree, params), [ready] if ready else [], self._committer.stage, copying)
        self._committer.start(base, base.name, 0, 0)
        self._after = step
        self._last_buffers = None
