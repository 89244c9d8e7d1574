"""The background writer: one thread that encodes, batches and commits records and bases.

The training thread hands over already-copied records through a queue bounded in bytes. When
the queue is full the training thread waits and a warning says so; nothing is dropped. The first
background error is kept and re-raised on the training thread (next put, flush or close).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .capture import fingerprint
from .errors import DiffCkptError
from .format import BaseName, SegmentName, digest_parts, encode_commit, encode_segment_parts
from .options import CheckpointOptions
from .store import RunStore
from .tree import pack_parts

__all__ = ["BackgroundWriter", "WriterStats"]

log = logging.getLogger("diffckpt")


@dataclass
class WriterStats:
    """Counters for reports and benchmarks."""

    records: int = 0
    segments: int = 0
    bases: int = 0
    segment_bytes: int = 0
    base_bytes: int = 0
    raw_record_bytes: int = 0
    stall_seconds: float = 0.0
    write_seconds: float = 0.0


class BackgroundWriter:
    """Owns the writer thread of one session (``gen``) of a run."""

    def __init__(self, store: RunStore, gen: int, options: CheckpointOptions, after: int) -> None:
        self.store = store
        self.gen = gen
        self.options = options
        self.stats = WriterStats()
        self.durable_step: int | None = None
        self._after = after  # step the next segment continues from
        self._pending: list[dict[str, Any]] = []
        self._last_buffers: dict[str, torch.Tensor] | None = None
        self._queue: collections.deque[tuple[str, Any, int]] = collections.deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"diffckpt-writer-g{gen}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ training side
    def put_record(self, record: dict[str, Any], nbytes: int) -> None:
        """Queue one step record (tensors already copied)."""
        self._put("record", record, nbytes)

    def put_base(self, step: int, tree: dict[str, Any], params: list[torch.Tensor], nbytes: int) -> None:
        """Queue a full base; ``params`` are the copied parameters to fingerprint."""
        self._put("base", (step, tree, params), nbytes)

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the writer thread after everything queued before it is durable."""
        self._put("call", fn, 0)

    def flush(self) -> int | None:
        """Block until everything queued so far is committed; return the durable step."""
        done = threading.Event()
        self._put("flush", done, 0)
        while not done.wait(0.1):
            self._raise_if_failed()
            if not self._thread.is_alive():
                break
        self._raise_if_failed()
        return self.durable_step

    def close(self) -> int | None:
        """Flush, stop the thread, and return the durable step."""
        if self._closed:
            return self.durable_step
        try:
            self.flush()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._thread.join()
        if self._pending:
            log.info("diffckpt: %d trailing step(s) after the last restorable step were not kept",
                     len(self._pending))
        return self.durable_step

    def check(self) -> None:
        """Re-raise the first background error, if any."""
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise DiffCkptError(f"diffckpt background writer failed: {self._error}") from self._error

    def _put(self, kind: str, item: Any, nbytes: int) -> None:
        self._raise_if_failed()
        if self._closed:
            raise DiffCkptError("the checkpoint writer is closed; create a new one to write more")
        with self._cond:
            start = None
            while self._queue and self._queued_bytes + nbytes > self.options.max_pending_bytes:
                if self._error is not None:
                    break
                if start is None:
                    start = time.monotonic()
                    log.warning(
                        "diffckpt: writer is behind (%d MiB queued, limit %d MiB); training waits "
                        "for storage. Raise max_pending_bytes, write_batch or every_n_steps, or use "
                        "faster storage.", self._queued_bytes >> 20, self.options.max_pending_bytes >> 20)
                self._cond.wait(0.5)
            if start is not None:
                self.stats.stall_seconds += time.monotonic() - start
            self._queue.append((kind, item, nbytes))
            self._queued_bytes += nbytes
            self._cond.notify_all()
        self._raise_if_failed()

    # -------------------------------------------------------------- writer side
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                kind, item, nbytes = self._queue.popleft()
            try:
                if self._error is None:
                    self._handle(kind, item)
            except BaseException as exc:  # kept and re-raised on the training thread
                log.error("diffckpt: background write failed: %s", exc)
                self._error = exc
            finally:
                if kind == "flush":
                    item.set()
                with self._cond:
                    self._queued_bytes -= nbytes
                    self._cond.notify_all()

    def _handle(self, kind: str, item: Any) -> None:
        if kind == "record":
            self._add_record(item)
        elif kind == "base":
            self._write_segment()
            self._write_base(*item)
        elif kind == "call":
            self._write_segment()
            item()
        elif kind == "flush":
            self._write_segment()

    def _add_record(self, record: dict[str, Any]) -> None:
        buffers = record.get("buffers") or {}
        last = self._last_buffers
        if last is not None:
            record["buffers"] = {k: v for k, v in buffers.items()
                                 if k not in last or not torch.equal(last[k], v)}
        self._last_buffers = {**(last or {}), **buffers}
        params = record.pop("fingerprint_params", None)
        if params is not None:
            record["fingerprint"] = fingerprint(params)
        self._pending.append(record)
        if len(self._pending) >= self.options.write_batch and record.get("state") is not None:
            self._write_segment()

    def _write_segment(self) -> None:
        """Commit pending records up to the newest restorable one; keep the rest pending."""
        cut = max((i + 1 for i, r in enumerate(self._pending) if r.get("state") is not None), default=0)
        if not cut:
            return
        records, self._pending = self._pending[:cut], self._pending[cut:]
        name = SegmentName(self._after, records[-1]["step"], self.gen)
        header = {"gen": self.gen, "after": self._after, "last": name.last}
        start = time.monotonic()
        info: dict[str, Any] = {}
        parts = encode_segment_parts(header, records, self.options.compression, self.options.compression_level, info)
        self.store.storage.write(name.path, parts)
        self.stats.write_seconds += time.monotonic() - start
        self.stats.segments += 1
        self.stats.records += len(records)
        self.stats.segment_bytes += sum(len(p) for p in parts)
        self.stats.raw_record_bytes += info["raw_bytes"]
        self._after = name.last
        self.durable_step = name.last

    def _write_base(self, step: int, tree: dict[str, Any], params: list[torch.Tensor]) -> None:
        start = time.monotonic()
        name = BaseName(step, self.gen)
        parts = pack_parts(tree)
        self.store.storage.write(name.state_path, parts)
        digest = digest_parts(parts)
        size = sum(len(p) for p in parts)
        commit = {"step": step, "gen": self.gen, "fingerprint": fingerprint(params),
                  "files": {"state.safetensors": {"size": size, "sha256": digest.hexdigest()}}}
        self.store.storage.write(name.commit_path, encode_commit(commit))
        self.stats.write_seconds += time.monotonic() - start
        self.stats.bases += 1
        self.stats.base_bytes += size
        self._after = step
        self._last_buffers = None
        self.durable_step = step if self.durable_step is None else max(self.durable_step, step)
