"""Records leave memory as they are written, and restore reads records, not segments.

The writer encodes each record when it arrives and appends it to the open segment's spool: what
it holds (``WriterStats.peak_held_bytes``, accounted where records are handed over and let go) never
exceeds ``max_pending_bytes`` plus one record, whatever ``write_batch``. A restore of large
segments reads each segment's index and then its records by range, at most ``PREFETCH_BYTES``
ahead (one record always). A ``kill -9`` while a segment is open leaves a hidden spool that no
reader takes for committed, and ``gc`` removes it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_runs import assert_state, restore, seg, train
from helpers import subprocess_env

from diffckpt import CheckpointEngine, CheckpointOptions, RetentionPolicy, recordreads
from diffckpt.lifecycle.retention import collect_garbage
from diffckpt.prefetch import Prefetcher
from diffckpt.runstore import RunStore
from diffckpt.storage import FsspecStorage
from diffckpt.writer import BackgroundWriter


def wide() -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    """A model whose one-step record (~130 KB of gradients) dwarfs the bounds set below."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 4096), torch.nn.BatchNorm1d(4096), torch.nn.Linear(4096, 1))
    return m, [torch.optim.AdamW(m.parameters(), lr=1e-2)]


@pytest.fixture
def record_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes of every record handed to a writer."""
    sizes: list[int] = []
    put = BackgroundWriter.put_record

    def counting(self: BackgroundWriter, record: dict[str, Any], nbytes: int, *args: Any, **kwargs: Any) -> None:
        sizes.append(nbytes)
        put(self, record, nbytes, *args, **kwargs)

    monkeypatch.setattr(BackgroundWriter, "put_record", counting)
    return sizes


@pytest.fixture
def writers(monkeypatch: pytest.MonkeyPatch) -> list[BackgroundWriter]:
    made: list[BackgroundWriter] = []
    init = BackgroundWriter.__init__

    def keep(self: BackgroundWriter, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(BackgroundWriter, "__init__", keep)
    return made


@pytest.mark.parametrize("write_batch", [1, 8, 64])
def test_held_bytes_stay_within_the_bound_whatever_the_batch(
        write_batch: int, tmp_path: Path, record_sizes: list[int], writers: list[BackgroundWriter]) -> None:
    bound = 50_000  # below one record: each record goes through alone
    truth, durable = train(tmp_path, steps=20, maker=wide, write_batch=write_batch, base_every_n_steps=1000,
                           max_pending_bytes=bound, retention=None)
    assert durable == 20
    largest = max(record_sizes)
    assert largest > bound
    (writer,) = writers
    assert 0 < writer.stats.peak_held_bytes <= bound + largest
    # What the old writer held until a segment was written: write_batch records at once.
    if write_batch > 1:
        assert writer.stats.peak_held_bytes < min(write_batch, 20) * largest
    assert writer.stats.segments == -(-20 // write_batch) if write_batch < 64 else writer.stats.segments == 1
    result, module, optimizers = restore(tmp_path, maker=wide)
    assert result.step == 20
    assert_state(truth, result, module, optimizers)


def test_an_open_segment_is_a_hidden_spool_beside_its_final_name(tmp_path: Path, writers: list[BackgroundWriter],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """With the node-local tier on disk (a tier held in memory keeps the spools itself)."""
    monkeypatch.setattr("diffckpt.journal.memory_backed", lambda folder: False)
    module, optimizers = wide()
    engine = CheckpointEngine(tmp_path, CheckpointOptions(write_batch=100, base_every_n_steps=1000, retention=None))
    engine.start(module, optimizers, 0)
    engine.write_base(0, module.state_dict(), [o.state_dict() for o in optimizers], {"x": 0})
    for step in range(1, 4):
        module(torch.randn(4, 8)).pow(2).mean().backward()
        optimizers[0].step()
        optimizers[0].zero_grad()
        engine.record_step(step, {"x": step})
    deadline = time.monotonic() + 30
    while writers[0].queued_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    spools = [p for p in (tmp_path / "diffs").iterdir() if p.name.startswith(".")]
    assert len(spools) == 1 and spools[0].name.endswith(".tmp") and spools[0].stat().st_size > 0
    assert RunStore(FsspecStorage(str(tmp_path))).inventory().segments == []
    assert engine.close() == 3
    assert not any(p.name.startswith(".") for p in (tmp_path / "diffs").iterdir())


@pytest.mark.parametrize("prefetch_bytes", [1, 300_000])
def test_restore_reads_records_by_range_within_its_window(
        prefetch_bytes: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record_sizes: list[int]) -> None:
    truth, _ = train(tmp_path, steps=24, maker=wide, write_batch=12, base_every_n_steps=1000, retention=None)
    windows: list[Prefetcher[Any, Any]] = []

    class Watched(Prefetcher[Any, Any]):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            windows.append(self)

    reads: list[tuple[str, int, int]] = []
    read_range = FsspecStorage.read_range

    def ranges(self: FsspecStorage, path: str, start: int, end: int) -> bytes:
        reads.append((path, start, end))
        return read_range(self, path, start, end)

    monkeypatch.setattr(recordreads, "Prefetcher", Watched)
    monkeypatch.setattr(recordreads, "RANGED_ABOVE", 0)
    monkeypatch.setattr(recordreads, "PREFETCH_BYTES", prefetch_bytes)
    monkeypatch.setattr(FsspecStorage, "read_range", ranges)
    for step in (24, 17):
        result, module, optimizers = restore(tmp_path, step, maker=wide)
        assert result.step == step
        assert_state(truth, result, module, optimizers)
    largest = max(record_sizes)
    assert windows and all(w.peak <= max(prefetch_bytes, largest) for w in windows)
    reads = [r for r in reads if r[0].startswith("diffs/")]  # the base's header is read by range too
    assert {path for path, _, _ in reads} == {seg(tmp_path, 0, 12).relative_to(tmp_path).as_posix(),
                                               seg(tmp_path, 12, 24).relative_to(tmp_path).as_posix()}
    assert max(end - start for _, start, end in reads) < largest * 2  # records, never a whole segment


def test_a_damaged_record_read_by_range_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_runs import flip, record_span

    truth, _ = train(tmp_path, steps=12, maker=wide, write_batch=12, base_every_n_steps=1000, retention=None)
    path = seg(tmp_path, 0, 12)
    offset, length = record_span(path.read_bytes(), 7)
    flip(path, offset + length // 2)
    monkeypatch.setattr(recordreads, "RANGED_ABOVE", 0)
    result, module, optimizers = restore(tmp_path, maker=wide)
    assert result.step == 6 and result.problems
    assert_state(truth, result, module, optimizers)


SPOOLING = """
import sys, time, torch
sys.path[:0] = [{tests!r}]
from test_streaming import wide
from diffckpt import CheckpointEngine, CheckpointOptions
module, optimizers = wide()
engine = CheckpointEngine({root!r}, CheckpointOptions(write_batch=100, base_every_n_steps=1000,
                                                      local_dir={local!r}))
engine.start(module, optimizers, 0)
engine.write_base(0, module.state_dict(), [o.state_dict() for o in optimizers], {{"x": 0}})
engine.flush()
for step in range(1, 6):
    module(torch.randn(4, 8)).pow(2).mean().backward()
    optimizers[0].step()
    optimizers[0].zero_grad()
    engine.record_step(step, {{"x": step}})
print("RECORDED", flush=True)
time.sleep(600)
"""


def killed_during_an_open_segment(root: Path, local: str | None) -> None:
    """Record steps 1-5 into an open segment (``write_batch`` 100) of a run at ``root`` in a
    subprocess, journaled in ``local`` unless ``None``, and ``kill -9`` it once the writer has
    appended them (step 5 waits for its lease, which only the next step would end)."""
    tests = str(Path(__file__).resolve().parent)
    script = SPOOLING.format(tests=tests, root=str(root), local=local)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env=subprocess_env(), start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "RECORDED"
        deadline = time.monotonic() + 60
        spool: list[Path] = []
        while time.monotonic() < deadline:  # the writer appends the records to the spool
            spool = [p for p in (root / "diffs").glob(".*.tmp") if p.stat().st_size > 4 * 100_000]
            if spool and (local is None or _journaled(root, local) >= 4):
                break
            time.sleep(0.05)
        assert spool
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _journaled(root: Path, local: str) -> int:
    from diffckpt.journal import place_for
    from diffckpt.journalfile import journals

    place = place_for(local, FsspecStorage(str(root)).url)
    assert place is not None
    return max((e["step"] for j in journals(place.folder, place.url) for e in j.entries), default=0)


@pytest.mark.parametrize("journal", [False, True])
def test_a_kill_during_an_open_segment_leaves_nothing_taken_for_committed(tmp_path: Path, journal: bool) -> None:
    """Nothing of an open segment is committed by the killed process; without a journal its records
    are lost, with one (the node-local tier) a resume here takes back all but at most the last."""
    root = tmp_path / "run"
    local = str(tmp_path / "local") if journal else None
    killed_during_an_open_segment(root, local)
    store = RunStore(FsspecStorage(str(root)))
    assert store.inventory().segments == []
    module, optimizers = wide()
    result = CheckpointEngine(root, CheckpointOptions(local_dir=local)).restore(module, optimizers)
    assert result.step == 0 if not journal else result.step >= 4
    # the journal's records are committed to the run root as a segment of the crashed session
    assert [(s.after, s.last, s.gen) for s in store.inventory().segments] == ([(0, result.step, 1)] if journal else [])
    collect_garbage(store.storage, RetentionPolicy(min_age_s=0), dry_run=False)
    assert not list((root / "diffs").glob(".*"))


def test_records_after_the_newest_restorable_one_move_on_to_the_next_segment(tmp_path: Path) -> None:
    from diffckpt.openseg import OpenSegment
    from diffckpt.segment import decode_segment

    storage = FsspecStorage(str(tmp_path))
    records = [{"step": s, "prev": s - 1, "state": {"x": s} if s in (3, 6) else None,
                "g": torch.full((1000,), float(s))} for s in range(1, 7)]
    for compression in ("none", "zstd"):
        first = OpenSegment(storage, 1, 0, compression, 3)
        for record in records[:5]:
            first.add(record)
        assert first.cut() == 3
        name, rest = first.finish(3)
        assert rest is not None and (name.after, name.last) == (0, 3) and len(rest) == 2
        rest.add(records[5])
        second, none = rest.finish(rest.cut())
        assert none is None and (second.after, second.last) == (3, 6)
        for segment, cut, steps in ((first, name, [1, 2, 3]), (rest, second, [4, 5, 6])):
            header, decoded, problem = decode_segment(b"".join(segment.spool.chunks()), cut.path)
            assert problem is None and header["compression"] == compression
            assert (header["after"], header["last"]) == (cut.after, cut.last)
            assert [r["step"] for r in decoded] == steps
            assert all(torch.equal(r["g"], records[r["step"] - 1]["g"]) for r in decoded)
            segment.discard()
    dropped = OpenSegment(storage, 1, 0, "none", 3)
    for record in records[:2]:
        dropped.add(record)
    assert dropped.drop_through(2) is None and not list(tmp_path.rglob("*.tmp"))


def test_bfloat16_valued_gradients_narrow_chunk_by_chunk() -> None:
    from diffckpt.narrowing import _NARROW_CHUNK, narrowed

    g = torch.randn(2 * _NARROW_CHUNK + 5, 3).to(torch.bfloat16).to(torch.float32)
    h = narrowed(g)
    assert h.dtype == torch.bfloat16 and h.shape == g.shape and torch.equal(h.float(), g)
    g.view(-1)[-1] += 1e-6  # one value past bfloat16, in the last chunk: nothing is lost
    split = narrowed(g)
    assert isinstance(split, dict) and split["rows"].tolist() == [g.shape[0] - 1]
    flat = g.view(-1)
    assert narrowed(flat) is flat  # one row: float32 whole
