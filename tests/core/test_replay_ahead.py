"""Replay at optimizer speed: a record's tensors are views of the segment read where 64-byte
aligned (else copies into one recycled aligned block), replay installs them as ``.grad`` as they
are, records are prepared (codec payloads decoded and clipped) ahead of the optimizer in a
window bounded in bytes, and what replay restores, reports and raises does not depend on it.
"""

from __future__ import annotations

import gc
import json
import shutil
import struct
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from engine_runs import Truth, assert_state, flip, make, record_span, restore, seg, train

from diffckpt import CheckpointEngine, CorruptRecordError, recordreads
from diffckpt.borrowing import BlockPool, aligned, borrowing
from diffckpt.codecs.compressor import clip_gradients, clip_tensors
from diffckpt.prefetch import THREAD_PREFIX, ReadyAhead
from diffckpt.recordreads import RecordReader
from diffckpt.tree import header_length, pack_tree, unpack_tree

STEPS = 12


@pytest.fixture(scope="module")
def _run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Truth]:
    root = tmp_path_factory.mktemp("ahead") / "run"
    truth, durable = train(str(root), steps=STEPS, write_batch=2, base_every_n_steps=None)
    assert durable == STEPS
    return root, truth


# ------------------------------------------------------------------------------ views, copies
def test_borrowed_tensors_view_the_buffer_where_64_byte_aligned_else_aligned_copies() -> None:
    tree = {"n": torch.arange(8, dtype=torch.int64), "odd": torch.randn(3), "w": torch.randn(4, 4),
            "m": torch.tensor([True, False])}
    blob = pack_tree(tree)
    (size,) = struct.unpack_from("<Q", blob)
    header = json.loads(blob[8 : 8 + size])
    meta = json.loads(header["__metadata__"]["diffckpt.tree"])
    names = {_decode_name(meta, k): v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    seen: set[bool] = set()
    for shift in range(64):  # the tensors' data start at every address modulo 64
        raw = np.zeros(len(blob) + 128, dtype=np.uint8)
        at = -(raw.ctypes.data + 8 + size) % 64 + shift
        raw[at : at + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
        buf = memoryview(raw)[at : at + len(blob)].toreadonly()  # read-only, as ``bytes`` are
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no warning about read-only memory
            with borrowing():
                got = unpack_tree(buf)
        lo, hi = raw.ctypes.data, raw.ctypes.data + raw.nbytes
        for key, t in got.items():
            view = (raw.ctypes.data + at + 8 + size + names[key]) % 64 == 0
            seen.add(view)
            assert (lo <= t.data_ptr() < hi) == view
            assert t.data_ptr() % 64 == 0
        copies = {t.untyped_storage().data_ptr() for t in got.values() if not lo <= t.data_ptr() < hi}
        assert len(copies) <= 1  # one block for the record's copies
        del buf, raw
        if shift % 16 == 0:  # a full collection per shift would cost seconds; every 16th proves it
            gc.collect()
        for key, t in tree.items():  # the views keep the buffer alive
            assert got[key].dtype == t.dtype and torch.equal(got[key], t)
    assert seen == {True, False}
    with borrowing():  # ``bytes`` themselves
        got = unpack_tree(bytes(blob))
    assert all(torch.equal(got[k], t) for k, t in tree.items())
    # outside ``borrowing``: copies of their own, as before
    copied = unpack_tree(blob)
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in copied.values())


def _decode_name(meta: Any, tensor: str) -> str:
    """The key of the tree ``{key: tensor}`` whose tensor is stored under ``tensor``."""
    return next(k for k, v in meta["dict"] if v == {"tensor": tensor})


def test_a_block_pool_recycles_memory_once_no_tensor_views_it() -> None:
    pool = BlockPool()
    block = pool.take(1000)
    view = block[8:16].view(torch.float64)
    address = block.data_ptr()
    assert address % 64 == 0
    del block
    other = pool.take(1000)  # ``view`` still uses the first block
    assert other.data_ptr() != address
    del view
    again = pool.take(900)
    assert again.data_ptr() == address
    del other, again


def test_replay_installs_the_decoded_tensors_without_copying_them(
        _run: tuple[Path, Truth], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ``.grad`` that ``step()`` reads is the tensor decoded from the segment itself."""
    root, truth = _run
    decoded: dict[int, list[torch.Tensor]] = {}
    fetch = RecordReader._fetch

    def keep(self: RecordReader, *args: Any) -> Any:
        header, records, problem, nbytes = fetch(self, *args)
        for record in records:
            decoded[record["step"]] = [g for e in record["events"] for row in e["grads"] for g in row]
        return header, records, problem, nbytes

    monkeypatch.setattr(RecordReader, "_fetch", keep)
    installed: list[list[int]] = []

    def spy(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        installed.append([id(p.grad) for group in optimizer.param_groups for p in group["params"]])

    module, optimizers = make()
    for opt in optimizers:
        opt.register_step_pre_hook(spy)
    result = CheckpointEngine(str(root)).restore(module, optimizers, STEPS)
    assert_state(truth, result, module, optimizers)
    assert len(installed) == STEPS * len(optimizers)
    # A gradient stored in 16 bits (bfloat16-valued, e.g. all zeros) is cast back to float32 on
    # install, necessarily a new tensor; every one stored as float32 is installed as decoded.
    mine = {id(t) for ts in decoded.values() for t in ts if t.dtype == torch.float32}
    assert mine and mine <= {i for ids in installed for i in ids}


def test_a_record_keeps_whole_lines_first_after_a_padded_header_so_an_aligned_read_views_them() -> None:
    tree = {"step": torch.tensor(3), "odd": torch.randn(3), "w": torch.randn(16, 16),
            "h": torch.randn(32).bfloat16(), "rng": torch.zeros(5, dtype=torch.uint8)}
    blob = pack_tree(tree)
    assert header_length(blob) % 64 == 0
    assert len(safetensors.torch.load(blob)) == len(tree)  # still a buffer safetensors reads
    raw = aligned(np.empty(len(blob) + 64, dtype=np.uint8), len(blob))
    raw[:] = np.frombuffer(blob, dtype=np.uint8)
    with borrowing():
        got = unpack_tree(raw.data)
    lo, hi = raw.ctypes.data, raw.ctypes.data + raw.nbytes
    viewed = {k for k, t in got.items() if lo <= t.data_ptr() < hi}
    assert {"w", "h"} <= viewed and "odd" not in viewed  # whole 64-byte lines first, all aligned
    assert all(torch.equal(got[k], t) for k, t in tree.items())


def test_a_record_read_by_range_is_decoded_in_place(_run: tuple[Path, Truth],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A large segment's records are read one by one into aligned memory: their gradients of whole
    64-byte lines are views of it, only the others (a bias of one float) are copied."""
    root, truth = _run
    monkeypatch.setattr(recordreads, "RANGED_ABOVE", 0)  # every segment read by ranges
    fetch, seen = RecordReader._fetch_piece, []

    def keep(self: RecordReader, piece: Any, blocks: BlockPool) -> Any:
        out = fetch(self, piece, blocks)
        if piece.span is not None:
            seen.append((piece.span[0]["length"], [g for e in out["events"] for row in e["grads"] for g in row]))
        return out

    monkeypatch.setattr(RecordReader, "_fetch_piece", keep)
    result, m, o = restore(str(root), STEPS)
    assert_state(truth, result, m, o)
    assert len(seen) == STEPS
    for length, grads in seen:
        whole = [g for g in grads if g.nbytes % 64 == 0]
        rest = [g for g in grads if g.nbytes % 64]
        assert whole and rest
        # the tensor data read (all of the record but its header) hold every whole-line gradient
        (storage,) = {(g.untyped_storage().data_ptr(), g.untyped_storage().nbytes()) for g in whole}
        assert 0 < length - storage[1] <= 4096 and storage[0] % 64 == 0
        assert all(g.untyped_storage().data_ptr() != storage[0] for g in rest)  # copied


# ---------------------------------------------------------------------------- ready ahead
class _Spy:
    """A preparer that notes where and when it ran; ``fail`` raises on that item."""

    ahead = True

    def __init__(self, size: int = 10, fail: int | None = None) -> None:
        self.item_size = size
        self.fail = fail
        self.threads: dict[int, str] = {}
        self.prepared = 0
        self.lock = threading.Lock()

    def size(self, item: int) -> int:
        return self.item_size

    def prepare(self, item: int) -> int:
        if item == self.fail:
            raise ValueError(f"item {item}")
        with self.lock:
            self.threads[item] = threading.current_thread().name
            self.prepared += 1
        return item * 100


def test_items_come_prepared_in_order_within_the_byte_bound() -> None:
    spy = _Spy(size=10)
    ahead = ReadyAhead(iter(range(20)), spy, max_bytes=35)
    got, most = [], 0
    for item in ahead:
        got.append(item)
        time.sleep(0.005)  # a slow consumer: the thread fills the window
        with spy.lock:
            most = max(most, spy.prepared - len(got))
    assert got == [i * 100 for i in range(20)]
    assert 1 <= most <= 3  # 35 bytes: three items of 10 ahead, never more
    assert all(name.startswith(THREAD_PREFIX) for name in spy.threads.values())
    ahead.close()


def test_an_item_larger_than_the_bound_is_prepared_by_the_caller() -> None:
    spy = _Spy(size=100)
    ahead = ReadyAhead(iter(range(4)), spy, max_bytes=35)
    assert list(ahead) == [0, 100, 200, 300]
    assert set(spy.threads.values()) == {threading.current_thread().name}
    ahead.close()


def test_errors_reach_the_caller_after_the_items_before_them() -> None:
    ahead = ReadyAhead(iter(range(6)), _Spy(fail=3), max_bytes=1000)
    got = [next(ahead) for _ in range(3)]
    with pytest.raises(ValueError, match="item 3"):  # prepared again by the caller, which raises
        next(ahead)
    assert got == [0, 100, 200]
    ahead.close()

    def source() -> Iterator[int]:
        yield from range(5)
        raise OSError("storage failed")

    ahead = ReadyAhead(source(), _Spy(), max_bytes=1000)
    assert [next(ahead) for _ in range(5)] == [0, 100, 200, 300, 400]
    with pytest.raises(OSError, match="storage failed"):
        next(ahead)
    ahead.close()


def test_closing_early_stops_the_thread_and_closes_the_source() -> None:
    closed = threading.Event()

    def source() -> Iterator[int]:
        try:
            yield from range(1000)
        finally:
            closed.set()

    ahead = ReadyAhead(source(), _Spy(size=10), max_bytes=30)
    assert next(ahead) == 0
    ahead.close()
    assert closed.wait(5.0)
    assert ahead.thread is not None and not ahead.thread.is_alive()
    unstarted = ReadyAhead(source(), _Spy(), max_bytes=30)
    unstarted.close()  # never iterated: no thread, the source closed here
    assert unstarted.thread is None


# ------------------------------------------------------------------------ same results
@pytest.mark.parametrize("ready_bytes", [1, recordreads.PREFETCH_READY_BYTES])
def test_damage_after_records_prepared_ahead_stops_replay_at_the_same_step(
        _run: tuple[Path, Truth], tmp_path: Path, ready_bytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """1 byte: every record is prepared by replay itself; the default: all of them ahead."""
    root = tmp_path / "run"
    shutil.copytree(_run[0], root)
    truth = _run[1]
    path = seg(root, 6, 8)
    offset, length = record_span(path.read_bytes(), 8)
    flip(path, offset + length // 2)
    monkeypatch.setattr(recordreads, "PREFETCH_READY_BYTES", ready_bytes)
    with pytest.warns(UserWarning, match="restoring step 7"):
        result, module, optimizers = restore(str(root))
    assert result.step == 7 and result.replayed == 7
    assert_state(truth, result, module, optimizers)
    with pytest.raises(CorruptRecordError, match="newest intact: 7"):
        restore(str(root), STEPS)


def test_clipping_tensors_gives_the_bits_of_clipping_parameters() -> None:
    gen = torch.Generator().manual_seed(0)
    for clip in ({"kind": "norm", "max_norm": 0.5, "norm_type": 2.0},
                 {"kind": "norm", "max_norm": 0.1, "norm_type": float("inf")},
                 {"kind": "value", "clip_value": 0.01}):
        grads = [torch.randn(shape, generator=gen) for shape in ((7, 3), (11,), (2, 2, 5))]
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        clip_gradients(params, clip)
        clip_tensors(grads, clip)
        for p, g in zip(params, grads):
            assert p.grad is not None
            assert torch.equal(p.grad.view(torch.int32), g.view(torch.int32))
