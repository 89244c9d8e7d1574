"""Small real training runs driven through the core engine, with the true state kept per step.

Every step's data comes from a generator seeded with the step number, so a run resumed from any
step continues exactly like the uninterrupted one and the kept truth applies to both.
"""

from __future__ import annotations

import errno
import json
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_bitwise_equal

from diffckpt import CheckpointEngine, CheckpointOptions, FsspecStorage, ReplayResult
from diffckpt.capture import clone_tree
from diffckpt.rng import get_rng_state


class LoopState:
    """What a plain loop adds to a restorable step (a ``FrameworkState``): the scheduler, and
    each rank's RNG in the rank's place of a per-rank list."""

    def __init__(self, sched: Any) -> None:
        self.sched = sched

    def rank_state(self) -> dict[str, Any]:
        return {"rng": get_rng_state()}

    def state(self, ranks: list[Any]) -> dict[str, Any]:
        return {"scheduler": self.sched.state_dict(), "ranks": ranks}


Maker = Callable[[], tuple[torch.nn.Module, list[torch.optim.Optimizer]]]
Truth = dict[int, dict[str, Any]]  # step -> {"model", "optimizers", "state"} as they truly were
# retention=None: these runs check that every step restores, which the default retention (the
# two newest bases' chains) would not keep; durability="every_step" for the same reason: paced, a
# run root that falls behind on a busy machine takes a base instead of the segments before it.
OPTIONS = {"write_batch": 3, "base_every_n_steps": 5, "fingerprint_every_n_steps": 2, "retention": None,
           "durability": "every_step"}


def make() -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
    return m, [torch.optim.AdamW(m.parameters(), lr=1e-2)]


def snapshot(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
             step: int) -> dict[str, Any]:
    return {**untouched(module, optimizers), "state": {"x": step}}


def optimizer_step(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer], step: int) -> None:
    """One training step of ``make``'s model on the batch of ``step`` (seeded by it)."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    for o in optimizers:
        o.zero_grad()
    module(x).pow(2).mean().backward()
    for o in optimizers:
        o.step()


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Replay in the test computes like training in the subprocesses (one thread), bit for bit:
    a test module that imports this fixture runs each of its tests so."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def plain_truth(last: int) -> Truth:
    """The uninterrupted run's state at steps ``0..last``, trained without diffckpt on one thread
    (as the training processes of the kill tests do, so that replay here matches bit for bit)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        module, optimizers = make()
        out = {0: snapshot(module, optimizers, 0)}
        for step in range(1, last + 1):
            optimizer_step(module, optimizers, step)
            out[step] = snapshot(module, optimizers, step)
        return out
    finally:
        torch.set_num_threads(threads)


def train_steps(engine: CheckpointEngine, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                first: int, last: int, truth: dict[int, dict[str, Any]], every: int | None = 1,
                before_record: Callable[[CheckpointEngine, int], None] | None = None) -> None:
    """Train steps ``first..last`` (inclusive), recording each one; steps not divisible by
    ``every`` are not restorable points (``None``: those the engine's settings say, as an
    adapter asks). ``before_record(engine, step)`` runs before each record."""
    for step in range(first, last + 1):
        optimizer_step(module, optimizers, step)
        truth[step] = snapshot(module, optimizers, step)
        if before_record is not None:
            before_record(engine, step)
        restorable = engine.wants_state(step) if every is None else step % every == 0
        engine.record_step(step, {"x": step} if restorable else None)
        if engine.wants_base(step):
            engine.write_base(step, module.state_dict(), [o.state_dict() for o in optimizers], {"x": step})


def train_in_thread(engine: CheckpointEngine, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                    first: int, last: int, truth: dict[int, dict[str, Any]]
                    ) -> tuple[threading.Thread, threading.Event, list[BaseException]]:
    """:func:`train_steps` on a thread of its own (storage held by a test may hold it up):
    the thread, an event set once it ended, and what it raised."""
    trained = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            train_steps(engine, module, optimizers, first, last, truth)
        except BaseException as exc:
            errors.append(exc)
        finally:
            trained.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, trained, errors


def train(dirpath: Any, steps: int = 13, maker: Maker = make, every: int = 1,
          truth: Truth | None = None, **options: Any) -> tuple[Truth, int | None]:
    """Train ``steps`` steps from scratch into ``dirpath``; return ``(truth per step, durable step)``."""
    module, optimizers = maker()
    truth = {} if truth is None else truth
    engine = CheckpointEngine(dirpath, CheckpointOptions(**{**OPTIONS, **options}))
    engine.start(module, optimizers, 0)
    truth[0] = snapshot(module, optimizers, 0)
    engine.write_base(0, module.state_dict(), [o.state_dict() for o in optimizers], {"x": 0})
    train_steps(engine, module, optimizers, 1, steps, truth, every)
    return truth, engine.close()


def restore(dirpath: Any, step: int | None = None, maker: Maker = make, options: CheckpointOptions | None = None,
            **kwargs: Any) -> tuple[ReplayResult, torch.nn.Module, list[torch.optim.Optimizer]]:
    module, optimizers = maker()
    result = CheckpointEngine(dirpath, options).restore(module, optimizers, step, **kwargs)
    return result, module, optimizers


def assert_state(truth: dict[int, dict[str, Any]], result: ReplayResult, module: torch.nn.Module,
                 optimizers: list[torch.optim.Optimizer]) -> None:
    """What was restored is bitwise the true state at the step it claims."""
    assert result.state == truth[result.step]["state"]
    assert_bitwise_equal(truth[result.step]["model"], module.state_dict())
    assert_bitwise_equal(truth[result.step]["optimizers"], [o.state_dict() for o in optimizers])


def untouched(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """Copies of the model's and optimizers' states as they are now."""
    return {"model": clone_tree(module.state_dict()),
            "optimizers": [clone_tree(o.state_dict()) for o in optimizers]}


# ------------------------------------------------------------------------------ damage
def seg(root: Path, after: int, last: int, gen: int = 1) -> Path:
    return root / "diffs" / f"{after:012d}-{last:012d}.g{gen:06d}.seg"


def base_dir(root: Path, step: int, gen: int = 1) -> Path:
    return root / "bases" / f"{step:012d}.g{gen:06d}"


def segment_entries(data: bytes) -> list[tuple[dict[str, Any], int]]:
    """``(index entry, offset of its blob)`` of each record of an intact segment, any format,
    read by docs/format.md with struct/json only (not diffckpt's parser, which the tests check):
    formats 1 and 2 list the records in the header; format 3 in the index at the end, behind
    the index's u32 length and the 16-byte digest."""
    (hlen,) = struct.unpack_from("<I", data, 8)
    lead = json.loads(data[12 : 12 + hlen])
    if lead["format"] >= 3:
        (ilen,) = struct.unpack_from("<I", data, len(data) - 20)
        entries = json.loads(data[len(data) - 20 - ilen : len(data) - 20])["records"]
    else:
        entries = lead["records"]
    out, offset = [], 12 + hlen
    for entry in entries:
        out.append((entry, offset))
        offset += entry["length"]
    return out


def build_segment(lead: dict[str, Any], blobs: list[bytes], index: dict[str, Any]) -> bytes:
    """A format-3 segment written by docs/format.md section 4 with struct/json/xxhash only, from
    its lead and index JSON objects as given (which may be wrong on purpose: tests of damage)."""
    import xxhash

    def dump(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()

    head, body = dump(lead), dump(index)
    start = b"DCKSEG\x00\x01" + struct.pack("<I", len(head)) + head
    end = body + struct.pack("<I", len(body))
    return start + b"".join(blobs) + end + xxhash.xxh3_128(start + end).digest()


def record_span(data: bytes, step: int) -> tuple[int, int]:
    """``(offset, length)`` of the record blob of ``step`` inside an intact segment (any format)."""
    for entry, offset in segment_entries(data):
        if entry["step"] == step:
            return offset, entry["length"]
    raise KeyError(step)


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------- storage wrappers
class FaultyStorage:
    """A :class:`diffckpt.Storage` over a real :class:`FsspecStorage` that fails its ``fail_at``-th
    write with ``OSError(code)`` (what a full or read-only disk raises) and may add latency.

    After the failure it keeps refusing writes, as a full disk would. The loss bound's notes
    (``sessions/g<gen>.loss.json``) are written without being counted: a run states it again as
    its measurements settle, as often as timing has it. While ``down`` is set, every
    call fails with ``ConnectionResetError``, as a store in an outage does."""

    def __init__(self, root: str, fail_at: int | None = None, code: int = errno.ENOSPC,
                 latency: float = 0.0, down: threading.Event | None = None) -> None:
        self.inner = FsspecStorage(root)
        self.url = self.inner.url
        self.fail_at = fail_at
        self.code = code
        self.latency = latency
        self.writes = 0
        self.written: list[str] = []
        self.failed: list[str] = []
        self.failed_on: list[str] = []  # thread names
        self.down = down or threading.Event()
        self.refused = 0  # calls refused while down

    def _reachable(self, path: str) -> None:
        if self.down.is_set():
            self.refused += 1
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer", path)

    def write(self, path: str, data: bytes) -> None:
        self._reachable(path)
        if self.latency:
            time.sleep(self.latency)
        if path.endswith(".loss.json"):  # restated as measurements settle: how often is timing's
            self.inner.write(path, data)
            self.written.append(path)
            return
        self.writes += 1
        if self.fail_at is not None and self.writes >= self.fail_at:
            self.failed.append(path)
            self.failed_on.append(threading.current_thread().name)
            raise OSError(self.code, os.strerror(self.code), path)
        self.inner.write(path, data)
        self.written.append(path)

    def create(self, path: str, data: bytes) -> bool:
        self._reachable(path)
        self.written.append(path)
        return self.inner.create(path, data)

    def read(self, path: str) -> bytes:
        self._reachable(path)
        return self.inner.read(path)

    def list(self, prefix: str) -> dict[str, int]:
        self._reachable(prefix)
        return self.inner.list(prefix)

    def delete(self, path: str) -> None:
        self._reachable(path)
        self.inner.delete(path)

    def exists(self, path: str) -> bool:
        self._reachable(path)
        return self.inner.exists(path)
