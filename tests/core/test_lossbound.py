"""What each failure loses, stated from measurements (``lossbound.py``): the bound for each
regime of the run root against the records, and its statement at a session's first record, in
the log and the metrics."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from engine_runs import FaultyStorage, make, optimizer_step

from diffckpt import CheckpointEngine, CheckpointOptions
from diffckpt.lossbound import Restating, loss_bound
from diffckpt.metrics import CheckpointMetrics
from diffckpt.options import segment_records

MB = 1 << 20


def _bound(durability: str = "paced", bps: float | None = 100 * MB, base_every: object = 10, journal: bool = True):
    return loss_bound(CheckpointOptions(durability=durability), journal, 4, bps, "file:///run",  # type: ignore[arg-type]
                      step_s=0.1, record_bytes=20 * MB, base_bytes=100 * MB, base_every=base_every)


def test_a_run_root_that_keeps_up_loses_about_a_segment() -> None:
    b = _bound(bps=400 * MB)  # 200 MB/s of records
    assert b.keeps_up and b.crash_steps == 1
    assert b.node_steps == 4 + 2  # the open segment, and the two steps its 80 MB take to write
    assert b.node_seconds == pytest.approx(0.6)
    assert "keeps up" in b.text and "at most 1 step" in b.text


def test_a_slow_run_root_loses_a_base_interval_and_two_base_writes() -> None:
    b = _bound(bps=100 * MB)  # half the record rate: bases instead
    assert not b.keeps_up
    assert b.node_steps == 10 + 2 * 10  # a base of 100 MB takes 1 s: 10 steps
    assert "takes bases" in b.text and "does not wait" in b.text


def test_a_segment_being_written_when_a_base_comes_counts_when_it_is_the_larger() -> None:
    # 8 records of 8 MB (64 MB, one segment) in flight, then the 50 MB base: 1.14 s at 100 MB/s, 23 steps
    b = loss_bound(CheckpointOptions(), True, 8, 100 * MB, "file:///run", step_s=0.05, record_bytes=8 * MB,
                   base_bytes=50 * MB, base_every=10)
    assert not b.keeps_up and b.node_steps == 10 + 23


def test_large_records_are_bounded_by_the_segments_the_writer_cuts_at_segment_bytes() -> None:
    # 8 records of 40 MiB would be 320 MiB a segment; the writer cuts at 64 MiB: 2 records (80 MiB)
    assert segment_records(8, 40 * MB) == 2 and segment_records(8, 240 * MB) == 1
    assert segment_records(8, 1 * MB) == 8 and segment_records(8, 0) == 8
    b = loss_bound(CheckpointOptions(), True, 8, 800 * MB, "file:///run", step_s=0.1, record_bytes=40 * MB,
                   base_bytes=500 * MB, base_every=10)
    assert b.keeps_up and b.node_steps == 2 + 1  # the open segment, and the 0.1 s its 80 MiB take


def test_bases_sized_by_bytes_are_sized_as_the_recorder_sizes_them() -> None:
    assert _bound(bps=100 * MB, base_every="bytes").node_steps == 20 + 2 * 10  # 4 x 100 MB / 20 MB


def test_without_bases_a_slow_run_root_has_no_bound_and_says_what_to_set() -> None:
    b = _bound(bps=100 * MB, base_every=None)
    assert b.node_steps is None and "base_every_n_steps" in b.text


def test_every_step_durable_states_what_training_waits() -> None:
    b = _bound("every_step", bps=100 * MB)
    assert b.floor_s == pytest.approx(0.1)  # 20 MB at 100 MB/s is 0.2 s, against a 0.1 s step
    assert b.node_steps == 4 * 3 + 8 and "waits about" in b.text  # three segments queued, one takes 0.8 s


def test_without_a_measured_bandwidth_or_a_journal() -> None:
    assert _bound(bps=None).node_steps is None and "not measured" in _bound(bps=None).text
    assert _bound(journal=False, bps=400 * MB).crash_steps == 6  # a crash loses what a node loss does


def test_the_first_record_states_the_bound_in_the_log_and_the_metrics(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    m, o = make()
    engine = CheckpointEngine(tmp_path / "run", CheckpointOptions(local_dir=str(tmp_path / "local")))
    engine.start(m, o, 0)
    engine.write_base(0, m.state_dict(), [x.state_dict() for x in o], {"x": 0})  # durable: it measures the root
    with caplog.at_level(logging.INFO, logger="diffckpt"):
        optimizer_step(m, o, 1)
        engine.record_step(1, {"x": 1})
        stated = [r.getMessage() for r in caplog.records if "a process crash loses at most 1 step" in r.getMessage()]
        assert len(stated) == 1 and "a node loss loses at most" in stated[0], caplog.text
        optimizer_step(m, o, 2)
        engine.record_step(2, {"x": 2})  # stated again only if its steps changed (the second step is faster)
    writer = engine.recorder.writer  # type: ignore[union-attr]
    metrics = CheckpointMetrics.of(writer, 2).as_dict()  # type: ignore[arg-type]
    assert metrics["diffckpt/crash_loss_bound_steps"] == 1 and metrics["diffckpt/node_loss_bound_steps"] == writer.loss.node_steps
    engine.close()


def test_a_slow_run_root_with_bases_sized_by_bytes_states_a_node_bound_at_the_first_record(tmp_path: Path) -> None:
    """``base_every_n_steps="bytes"`` (the default) is sized once the first record is in; the
    statement at that record sizes it as the recorder then will, not as a run without bases."""
    m, o = make()
    storage = FaultyStorage(str(tmp_path / "run"), latency=0.3)  # far slower than the records
    engine = CheckpointEngine(storage, CheckpointOptions(local_dir=str(tmp_path / "local")))  # type: ignore[arg-type]
    engine.start(m, o, 0)
    engine.write_base(0, m.state_dict(), [x.state_dict() for x in o], {"x": 0})
    optimizer_step(m, o, 1)
    engine.record_step(1, {"x": 1})
    bound = engine.recorder.writer.loss  # type: ignore[union-attr]
    assert bound is not None and not bound.keeps_up, bound
    assert bound.node_steps is not None and "takes bases" in bound.text, bound.text
    engine.close()


def test_the_bound_is_stated_again_as_the_measurements_settle() -> None:
    # The first record is timed from the session's first base (a slow first step); the next
    # statements at records 2, 4, 8, ... and every EVERY records, from what came since the last.
    r = Restating()
    due = {n: r.record(1, 10.0 * n, 100.0 + n, first_base_at=98.0) for n in range(1, 10)}
    assert [n for n, d in due.items() if d is not None] == [1, 2, 4, 8]
    assert due[1] == (10.0, 3.0) and due[2] == (20.0, 1.0)
    assert due[4] == pytest.approx((35.0, 1.0)) and due[8] == pytest.approx((65.0, 1.0))  # records 3-4, 5-8
    later = [n for n in range(10, 3 * Restating.EVERY + 1) if r.record(2, 1.0, 200.0 + n, 0.0) is not None]
    assert later == [16, 32, 64, 128, 256, 512, 1024, 2048, 3072]


def test_a_statement_that_says_the_same_steps_is_not_made_again(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    m, o = make()
    engine = CheckpointEngine(tmp_path / "run", CheckpointOptions(local_dir=str(tmp_path / "local")))
    engine.start(m, o, 0)
    writer = engine.recorder.writer  # type: ignore[union-attr]
    with caplog.at_level(logging.INFO, logger="diffckpt"):
        for bound in (_bound(bps=400 * MB), _bound(bps=410 * MB), _bound(bps=100 * MB)):
            writer.state_loss(bound)
    stated = [r.getMessage() for r in caplog.records if "a process crash loses" in r.getMessage()]
    assert len(stated) == 2 and "keeps up" in stated[0] and "takes bases" in stated[1]  # 410 MB/s: 6 steps as 400
    assert writer.loss.node_steps == 30
    assert CheckpointMetrics.of(writer, 1).as_dict()["diffckpt/node_loss_bound_steps"] == 30
    engine.close()
