"""Compaction and retention while training runs, in one background thread of the writing process.

The training thread only wakes the thread (an ``Event``); the work reads and writes storage like
another process would, so training never waits for it. Compaction comes first: once the durable
step is ``compact_every_n_steps`` past the newest base, a base is rolled forward to it. Retention
follows whenever a new base has become durable (written by training or compacted), so deletion
always follows newer durable state. A failure is logged and retried at the next occasion: it
never stops training, and nothing it leaves half done affects a restore.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..runstore import RunStore
from ..storage import Storage
from .compaction import compact
from .retention import RetentionPolicy, apply_gc, plan_gc

__all__ = ["Maintenance"]

log = logging.getLogger("diffckpt")
NICE = 10  # the maintenance thread's nice value, relative to the default 0 of training
SETTLE_S = 60.0  # the longest the last pass waits for the other ranks when close() has no timeout
SETTLE_POLL_S = 0.25  # each poll lists every rank's stream: on object stores, LIST requests


class Maintenance:
    """The background compaction and retention of one writer session.

    Args:
        storage: the run's storage.
        progress: returns ``(durable step, newest base step queued by training, bases committed)``.
        compact_every_n_steps: roll a base forward once the durable step is this far past the
            newest base (``None``: never).
        retention: what to keep (``None``: delete nothing).
        device: where compaction replays.
        settled: for the process that collects a sharded run's garbage: whether every rank's
            stream has committed this session's newest base. The last retention pass at
            :meth:`close` waits for it (up to close's timeout), so that a finished job leaves every
            stream trimmed alike and not only those whose writers happened to finish first.
        kept: ``(gen, step, why)`` of further steps retention keeps, asked at each pass: the steps
            this process's framework saves name, whose kept markers (which every pass reads from
            the run root, :func:`~diffckpt.lifecycle.retention.plan_gc`) may not be written yet.
    """

    def __init__(self, storage: Storage, progress: Callable[[], tuple[int | None, int, int]], *,
                 compact_every_n_steps: int | None, retention: RetentionPolicy | None,
                 device: str = "cpu", collect_from: Storage | None = None,
                 settled: Callable[[], bool] | None = None,
                 kept: Callable[[], Sequence[tuple[int, int, str]]] | None = None) -> None:
        self.store = RunStore(storage)
        # Retention runs over the run root (all rank streams of sharded training), compaction
        # over the stream this process writes.
        self.collect_store = RunStore(collect_from) if collect_from is not None else self.store
        self.progress = progress
        self.compact_every_n_steps = compact_every_n_steps
        self.retention = retention
        self.device = device
        self.compactions: list[dict[str, Any]] = []
        self.collections: list[dict[str, int]] = []
        self.errors: list[str] = []
        self._compacted = -1
        self._bases_seen = 0
        self._final = True
        self.settled = settled
        self.kept = kept
        self._settle_by = 0.0  # time.monotonic() until which the last pass waits for ``settled``
        self._busy = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="diffckpt-maintenance", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Tell the thread that the durable step may have moved (cheap; call after each step)."""
        self._wake.set()

    def close(self, timeout: float | None = None, final: bool = True) -> None:
        """Finish the job under way, run a last retention pass (unless not ``final``: training
        was interrupted and must exit soon) and stop, waiting at most ``timeout`` seconds."""
        self._final = final
        self._settle_by = time.monotonic() + (SETTLE_S if timeout is None else timeout)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive() and self._busy:
            log.warning("diffckpt: background compaction/retention still running after %.0fs; left to "
                        "finish on its own (an unfinished one leaves nothing a restore would use)", timeout)

    def _run(self) -> None:
        _lower_priority()
        while True:
            self._wake.wait()
            self._wake.clear()
            final = self._stop.is_set()  # closing: only retention over what is now durable
            if final and not self._final:
                return
            self._busy = True
            try:
                if final and self.settled is not None:
                    self._await_settled()
                self.run_once(compaction=not final, collect=final and self.settled is not None)
            except Exception as exc:  # never stops training; retried next time
                self.errors.append(str(exc))
                log.warning("diffckpt: background compaction/retention failed (training goes on; retried "
                            "at the next base): %s", exc)
            self._busy = False
            if final:
                return

    def _await_settled(self) -> None:
        """Wait until ``settled`` holds or close's timeout passes; either way the pass runs (it
        keeps whatever a stream still needs, so a rank that never catches up loses nothing)."""
        settled = self.settled
        while settled is not None and time.monotonic() < self._settle_by:
            try:
                if settled():
                    return
            except Exception as exc:  # a listing failed: collect what is known now
                log.debug("diffckpt: could not tell whether every rank has its last base: %s", exc)
                return
            time.sleep(SETTLE_POLL_S)

    def run_once(self, compaction: bool = True, collect: bool = False) -> None:
        """One pass: compact if due, then collect garbage if a new base became durable (or
        ``collect``)."""
        durable, newest_base, committed = self.progress()
        if durable is None:
            return
        collect = collect or committed != self._bases_seen
        self._bases_seen = committed
        n = self.compact_every_n_steps
        if compaction and n is not None and durable - max(newest_base, self._compacted) >= n:
            self._compacted = durable  # a failure is retried n steps later, not at every step
            result = compact(self.store.storage, durable, device=self.device, by="background compaction")
            self.compactions.append(result.to_json())
            collect = True
        if self.retention is not None and collect:
            plan = plan_gc(self.collect_store, self.retention, also=self.kept() if self.kept is not None else ())
            if plan.objects:
                done = apply_gc(self.collect_store, plan)
                self.collections.append(done)
                log.info("diffckpt: retention removed %d objects (%.1f MiB) of %s", done["objects"],
                         done["bytes"] / 2**20, self.collect_store.storage.url)


def _lower_priority() -> None:
    """Run this thread at a lower CPU priority (Linux: threads have their own nice value), so that
    on a machine with few cores the training thread gets the CPU first when both want it."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
        pass
