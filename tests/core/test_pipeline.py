"""The writer's path of one record: ``compression="auto"`` decided by what zstd saves against the
time it costs (the target's rate and the compressor's, both measured; injected here), records
compressed by zstd's workers decoding as any other, and large records hashed beside their write.
Correctness only: the speed is measured in ``bench/pipeline.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard
from helpers import assert_bitwise_equal

from diffckpt import CheckpointOptions, segment, writer
from diffckpt.format import SegmentName
from diffckpt.openseg import OpenSegment
from diffckpt.runstore import RunStore
from diffckpt.segment import SegmentEncoder, decode_segment, zstd_shortens
from diffckpt.storage import FsspecStorage, Spool

SAMPLE = 1 << 18


def record(step: int, values: torch.Tensor) -> dict[str, Any]:
    return {"step": step, "prev": step - 1, "events": [{"optimizer": 0, "grads": [[values]]}], "state": {"n": step}}


def compressible(numel: int = 1 << 20) -> torch.Tensor:
    """bfloat16 values of a narrow range: zstd halves them or better."""
    return (torch.arange(numel) % 251).to(torch.bfloat16)


def incompressible(numel: int = 1 << 20) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, (numel,), dtype=torch.int32, generator=torch.Generator().manual_seed(0))


def ticking(seconds: float) -> Any:
    """A clock on which every interval lasts ``seconds``."""
    now = [0.0]

    def clock() -> float:
        now[0] += seconds
        return now[0]

    return clock


def decided(values: torch.Tensor, write_rate: float | None, compress_s: float) -> str | None:
    encoder = SegmentEncoder({"gen": 1, "after": 0}, "auto", 1, write_rate=lambda: write_rate,
                             clock=ticking(compress_s))
    encoder.encode(record(1, values))
    return encoder.compression


def test_zstd_is_chosen_only_where_it_pays_and_saves_time() -> None:
    # The sample must shrink by 10% or more, whatever the target.
    assert not zstd_shortens(1000, 950, 0.0, None) and not zstd_shortens(1000, 950, 0.0, 1.0)
    assert zstd_shortens(1000, 900, 1.0, None)  # a target the writer does not see: the ratio decides
    # 500 bytes saved on a target of 1000 B/s are 0.5 s: compressing must take less.
    assert zstd_shortens(1000, 500, 0.49, 1000.0) and not zstd_shortens(1000, 500, 0.5, 1000.0)


def test_auto_weighs_the_measured_compressor_against_the_measured_target() -> None:
    values = compressible()
    # 256 KiB compressed in 1 ms: 262 MB/s, against a disk at 50 MB/s, then against memory at 10 GB/s.
    assert decided(values, 50e6, 1e-3) == "zstd"
    assert decided(values, 10e9, 1e-3) == "none"
    # The same target, a compressor ten times slower: no longer worth it.
    assert decided(values, 50e6, 1e-2) == "none"
    assert decided(incompressible(), 1.0, 0.0) == "none"  # a slow target does not make noise shrink
    assert decided(values, None, 1.0) == "zstd"  # no rate: the ratio alone, as before


def test_an_open_segment_weighs_zstd_against_its_spool_whatever_comes_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The record's path ends at its spool, with training waiting for the record before it: a
    local root's spool (committed by a rename) and a temporary one (an upload or a copy follows,
    paced by ``durability``) are each weighed against their own file system's rate."""
    asked: list[str] = []

    def rate(self: Spool) -> float:
        asked.append(self.path)
        return 1.0  # a byte a second: any real compression of a compressible sample is faster

    monkeypatch.setattr(Spool, "write_rate", rate)
    local = OpenSegment(FsspecStorage(str(tmp_path / "run")), 1, 0, "auto", 1)
    local.add(record(1, compressible()))
    assert asked == [local.spool.path] and local.encoder.compression == "zstd"
    monkeypatch.setattr(Spool, "write_rate", lambda self: 1e30)  # faster than any compressor
    fast = OpenSegment(FsspecStorage(str(tmp_path / "run")), 1, 1, "auto", 1)
    fast.add(record(2, compressible()))
    assert fast.encoder.compression == "none"
    upload = OpenSegment(FsspecStorage("memory://pipeline-auto"), 1, 0, "auto", 1)  # a spool in the temp folder
    upload.add(record(1, compressible()))
    assert upload.spool.temporary and upload.encoder.compression == "none"  # its spool is faster than zstd
    monkeypatch.setattr(Spool, "write_rate", rate)
    asked.clear()
    slow = OpenSegment(FsspecStorage("memory://pipeline-auto"), 1, 1, "auto", 1)
    slow.add(record(2, compressible()))
    assert asked == [slow.spool.path] and slow.encoder.compression == "zstd"
    for seg in (local, fast, upload, slow):
        seg.discard()


@pytest.mark.parametrize("content_size", [True, False])
def test_segments_compressed_by_zstd_workers_decode(monkeypatch: pytest.MonkeyPatch, content_size: bool) -> None:
    """zstd's workers cut a large record into jobs; the blob is still one frame, and a frame
    without its content size (which a streaming compressor may leave out) decodes as well."""
    monkeypatch.setattr(segment, "ZSTD_THREADS", 2)
    records = [record(1, compressible(6 << 20)), record(2, incompressible(1 << 20))]
    encoder = SegmentEncoder({"gen": 1, "after": 0}, "zstd", 1)
    if not content_size:
        encoder.compressor = zstandard.ZstdCompressor(level=1, threads=2, write_content_size=False)
    parts = [p for r in records for p in encoder.add(r)]
    data = b"".join([*parts, encoder.tail(last=2)])
    first = encoder.entries[0]
    blob = data[len(encoder.lead or b"") :][: first["length"]]
    params = zstandard.get_frame_parameters(blob)
    assert (params.content_size == first["raw_length"]) is content_size
    header, decoded, problem = decode_segment(data)
    assert problem is None and header["compression"] == "zstd"
    assert first["length"] < first["raw_length"] / 2
    assert_bitwise_equal(decoded, records)


def test_a_large_record_hashed_beside_its_write_reads_back(tmp_path: Path) -> None:
    seg = OpenSegment(FsspecStorage(str(tmp_path / "run")), 1, 0, "none", 1)
    records = [record(1, incompressible(1 << 20)), record(2, incompressible(1 << 8))]  # 4 MiB: beside; 1 KiB: inline
    for r in records:
        seg.add(r)
    _, rest = seg.finish(2)
    assert rest is None
    header, decoded, problem = decode_segment(seg.spool.read_at(0, seg.spool.size))
    assert problem is None and [e["step"] for e in header["records"]] == [1, 2]
    assert_bitwise_equal(decoded, records)
    seg.discard()


def test_a_segment_is_cut_once_its_records_reach_segment_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Records of 4 MiB against a cut at 6 MiB: two a segment, though write_batch allows 8; small
    # records after them batch by write_batch again (8 from step 5). Every record reads back.
    monkeypatch.setattr(writer, "SEGMENT_BYTES", 6 << 20)
    storage = FsspecStorage(str(tmp_path / "run"))
    def records() -> list[dict[str, Any]]:  # anew: the writer lets go of the gradients it wrote
        return [record(s, incompressible(1 << 20)) for s in range(1, 6)] + [record(s, incompressible(4)) for s in range(6, 16)]

    w = writer.BackgroundWriter(RunStore(storage), 1, CheckpointOptions(write_batch=8, local_dir=None), after=0)
    try:
        for r in records():
            w.put_record(r, 4 << 20)
        w.flush()
    finally:
        w.close()
    names = sorted(n for n in (SegmentName.parse(p) for p in storage.list("diffs/")) if n is not None)
    assert [(n.after, n.last) for n in names] == [(0, 2), (2, 4), (4, 12), (12, 15)]
    decoded = []
    for n in names:
        _, part, problem = decode_segment(storage.read(n.path))
        assert problem is None
        decoded += part
    assert_bitwise_equal([r["events"] for r in decoded], [r["events"] for r in records()])
