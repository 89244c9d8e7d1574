"""The device-specific stage of the writer: a record's GPU tensors moved to host memory.

Capture never synchronises the training stream: gradients are leased or copied on the device
(asynchronous kernels), and the record carries an event recorded on the training stream after
them (:meth:`HostStage.mark`). The writer thread, not the training thread, then copies them to
the host on a side stream that waits for that event, into pinned buffers from a bounded pool
(reused from step to step: gradients have the same shapes every step), and waits for the side
stream itself. Past the pool's bound (:func:`pinned_bound`) it copies into ordinary memory, which
is slower but never blocks on the pool; so it does for bases (see :meth:`HostStage.to_host`).

A record's gradients are narrowed on the device first (``narrowing.py``): the side stream
computes, for each row of every float32 gradient, whether its low 16 bits are all zero; the
writer thread reads all those flags back with one small copy (one per GPU) and then copies each
gradient's bfloat16 halves (with the low halves of its float32-valued rows where it is stored
row-split), or the gradient itself. The host gets exactly what narrowing it there would have
given, with only the bytes stored over the bus and none of the host's time.

Device memory held by records is bounded by the writer queue: a record's device tensors count
in ``max_pending_bytes`` from the commit until the writer has staged them, which it does as soon
as the record's leases ended (``docs/architecture.md``, GPU path). The stage's own temporaries
(the bfloat16 halves of one gradient at a time) are allocated on the side stream and dropped once
their copy is queued, so the caching allocator gives their memory only to work queued after it.

On the CPU every tensor is on the host already and the stage returns the record as it is: one
code path, with this module the only device-specific part.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .narrowing import high_halves, low_rows, narrowable, plan, row_flags, shape_rows
from .recordprep import narrow_gradients

__all__ = ["PINNED_CAP", "PINNED_SHARE", "PINNED_UNKNOWN", "HostStage", "PinnedPool", "memory_limit",
           "on_device", "pinned_bound", "pinned_size"]

PINNED_SHARE = 4
"""The pool pins at most 1/PINNED_SHARE of the memory the process may use (:func:`memory_limit`):
page-locked memory cannot be paged out, so it is taken from everything else on the machine."""

PINNED_CAP = 16 << 30
"""... and never more than this (per process: under DDP one process records; under FSDP2 each rank
stages its piece of a record): a record of a model of several billion parameters with 16-bit
gradients, its buffers rounded as :func:`pinned_size` says."""

PINNED_UNKNOWN = 512 << 20
"""The bound where the memory the process may use cannot be read."""

# Where a container's memory limit is found (cgroup v2, then v1); on a host they are absent, or
# read "max".
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_limit(cgroup_files: Sequence[str] = CGROUP_LIMITS) -> int | None:
    """The memory this process may use, in bytes: the machine's physical memory, or its
    container's limit (``cgroup_files``) when lower; ``None`` when neither can be read."""
    found = []
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        if pages > 0 and page > 0:
            found.append(pages * page)
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or not these names
        pass
    for path in cgroup_files:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # else "max": no limit
            found.append(int(text))
    return min(found) if found else None


def pinned_bound(limit: int | None) -> int:
    """The pinned bytes the pool may hold, given the memory the process may use (``None``:
    unknown): a share of it, at most :data:`PINNED_CAP`."""
    return PINNED_UNKNOWN if limit is None else min(limit // PINNED_SHARE, PINNED_CAP)


def pinned_size(nbytes: int) -> int:
    """Page-locked bytes a pinned buffer of ``nbytes`` takes: torch's caching host allocator
    rounds each allocation up to a power of two (and keeps it when freed)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def on_device(tree: Any) -> bool:
    """Whether any tensor of ``tree`` is on an accelerator."""
    if isinstance(tree, torch.Tensor):
        return tree.device.type != "cpu"
    if isinstance(tree, dict):
        return any(on_device(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(on_device(v) for v in tree)
    return False


class PinnedPool:
    """Host buffers for device-to-host copies, reused by shape and dtype, at most ``capacity``
    bytes of them pinned (``pin``; counted by :func:`pinned_size`); past that, ordinary memory
    that is not kept. It grows to what the largest record staged needs, up to ``capacity``, and
    never gives back what it pinned: freed pinned memory stays with torch's allocator anyway. A
    lock, as buffers may come back from another thread than the one that took them."""

    def __init__(self, capacity: int, pin: bool) -> None:
        self.capacity = capacity
        self.pin = pin
        self.held = 0  # bytes of buffers the pool owns (lent or free)
        self._free: dict[tuple[torch.dtype, tuple[int, ...]], list[torch.Tensor]] = defaultdict(list)
        self._own: set[int] = set()  # ids of the pool's buffers while lent
        self._lock = threading.Lock()

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A host buffer of ``like``'s shape and dtype."""
        key = (like.dtype, tuple(like.shape))
        with self._lock:
            if self._free[key]:
                buf = self._free[key].pop()
            else:
                size = pinned_size(like.numel() * like.element_size())
                if self.held + size > self.capacity:
                    return torch.empty(like.shape, dtype=like.dtype)  # past the bound: not pooled
                buf = torch.empty(like.shape, dtype=like.dtype, pin_memory=self.pin)
                self.held += size
            self._own.add(id(buf))
        return buf

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        """Return buffers once what was copied into them is written."""
        with self._lock:
            for buf in buffers:
                if id(buf) in self._own:
                    self._own.discard(id(buf))
                    self._free[(buf.dtype, tuple(buf.shape))].append(buf)


class HostStage:
    """Moves records' device tensors to the host on the writer thread (see the module doc).

    ``pinned_bytes``: the pool's bound (default: :func:`pinned_bound` of :func:`memory_limit`)."""

    def __init__(self, pinned_bytes: int | None = None) -> None:
        bound = pinned_bound(memory_limit()) if pinned_bytes is None else pinned_bytes
        self.pool = PinnedPool(bound, pin=torch.cuda.is_available())
        self._narrowed: list[torch.Tensor] = []  # host copies narrow() took for the record being written
        self._streams: dict[int, Any] = {}

    @staticmethod
    def mark(tree: Any) -> Any:
        """On the training thread, after the record's device work was queued: an event on the
        current CUDA stream that the writer's copies wait for (``None`` for host-only records).
        Recording an event does not synchronise."""
        if not torch.cuda.is_available() or not on_device(tree):
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def to_host(self, tree: Any, ready: list[Any], narrow: Sequence[torch.Tensor] = (),
                pooled: bool = True) -> tuple[Any, list[torch.Tensor]]:
        """``tree`` with every CUDA tensor copied to a host buffer, once the events ``ready``
        completed; and the buffers to :meth:`release` after the record is written. Blocks the
        calling (writer) thread only.

        ``narrow``: tensors of ``tree`` (a record's gradients) copied in bfloat16 where that is
        exact. ``pooled``: into the pool's buffers; else into ordinary memory (a base's: staged
        once per base interval, its pinned buffers would hold page-locked memory the size of
        model and optimizer state between bases, taken from the records' bound)."""
        if not on_device(tree):
            return tree, []
        taken: list[torch.Tensor] = []
        used: dict[int, Any] = {}

        def stream(device: torch.device) -> Any:
            index = device.index if device.index is not None else torch.cuda.current_device()
            if index not in used:
                if index not in self._streams:
                    self._streams[index] = torch.cuda.Stream(device=index)
                used[index] = s = self._streams[index]
                for event in ready:
                    s.wait_event(event)  # on the device: the host does not wait here
            return used[index]

        plans = self._plans([g for g in narrow if g.device.type == "cuda" and narrowable(g)], stream, taken)

        def copied(src: torch.Tensor, whole: tuple[int, ...] | None = None) -> torch.Tensor:
            """A host copy of ``src`` queued on the current (side) stream; ``whole``: a buffer
            of that shape whose first rows take it, so that the pool reuses one buffer per
            gradient whatever the number of rows."""
            if whole is not None and pooled:
                buf = self.pool.take(torch.empty(whole, dtype=src.dtype, device="meta"))
                taken.append(buf)
                buf = buf[: src.shape[0]]
            else:
                buf = self.pool.take(src) if pooled else torch.empty(src.shape, dtype=src.dtype)
                taken.append(buf)
            buf.copy_(src, non_blocking=True)
            return buf

        def move(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                if obj.device.type != "cuda":
                    return obj
                rows = plans.get(id(obj))
                with torch.cuda.stream(stream(obj.device)):
                    # The halves are made on the side stream, the only one that uses them: once
                    # dropped, their memory goes to work queued after this copy.
                    if rows is None:
                        return copied(obj)
                    high = copied(high_halves(obj))
                    if not len(rows):
                        return high
                    return {"high": high, "rows": rows, "low": copied(low_rows(obj, rows), shape_rows(obj))}
            if isinstance(obj, dict):
                return {k: move(v) for k, v in obj.items()}
            if isinstance(obj, list):
                return [move(v) for v in obj]
            if isinstance(obj, tuple):
                return tuple(move(v) for v in obj)
            return obj

        out = move(tree)
        for s in used.values():
            s.synchronize()
        return out, taken

    def _plans(self, grads: list[torch.Tensor], stream: Callable[[torch.device], Any],
               taken: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """``id(g) -> narrowing.plan`` for those of ``grads`` (on GPUs) that are stored in 16
        bits, whole or split: the rows' flags of each device's gradients computed on its side
        stream and read back with one copy, which this (writer) thread waits for, and only for it."""
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for g in grads:
            by_device[g.device].append(g)
        reads = []
        for device, group in by_device.items():
            side = stream(device)
            with torch.cuda.stream(side):
                flags = row_flags(group)
                host = self.pool.take(flags)
                taken.append(host)
                host.copy_(flags, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
            reads.append((group, host, done))
        plans: dict[int, torch.Tensor] = {}
        for group, host, done in reads:
            done.synchronize()
            at = 0
            for g in group:
                n = shape_rows(g)[0]
                rows = plan(g, host[at:at + n])
                at += n
                if rows is not None:
                    plans[id(g)] = rows
        return plans

    def narrow(self, record: dict[str, Any]) -> list[torch.Tensor]:
        """:func:`~diffckpt.recordprep.narrow_gradients`, the host copies in this stage's pool (the
        same memory record after record), given back by the next :meth:`release`."""
        return narrow_gradients(record, self.pool, self._narrowed)

    def release(self, buffers: list[torch.Tensor]) -> None:
        """Give back a record's buffers (``to_host``'s, and :meth:`narrow`'s) once it is written."""
        self.pool.give_back(buffers + self._narrowed)
        self._narrowed.clear()
