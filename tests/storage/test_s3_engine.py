"""The core engine on a real S3-compatible server (moto, over HTTP through s3fs), with faults
injected by an HTTP proxy: batching, multipart uploads, retries, outages, damage, two writers."""

from __future__ import annotations

import logging
import re
import warnings
from typing import Any

import pytest
import torch
from engine_runs import (
    OPTIONS,
    Truth,
    assert_state,
    make,
    record_span,
    restore,
    snapshot,
    train,
    train_steps,
)
from faultproxy import FaultProxy
from s3env import S3Target

from diffckpt import (
    CheckpointEngine,
    CheckpointNotFoundError,
    CheckpointOptions,
    ConcurrentWriterError,
    DiffCkptError,
    FsspecStorage,
    RetryPolicy,
    StorageError,
    StorageUnavailableError,
    cli,
)
from diffckpt.runstore import RunStore

MiB = 1 << 20
FAST = RetryPolicy(budget_s=0.5, initial_backoff_s=0.02, max_backoff_s=0.1)  # outages start soon
PATIENT = RetryPolicy(budget_s=30, initial_backoff_s=0.02, max_backoff_s=0.1)  # rides out any fault here


def storage(target: S3Target, **kwargs: Any) -> FsspecStorage:
    return FsspecStorage(target.url, **kwargs, **target.storage_options)


def every_step_restores(target: S3Target, truth: Truth, steps: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in [None, *range(steps + 1)]:
            result, m, o = restore(storage(target), step)
            assert result.step == (steps if step is None else step)
            assert_state(truth, result, m, o)


def messages(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "diffckpt")


# ----------------------------------------------------------------------------- batching
def test_one_put_per_write_batch_and_every_step_restores(s3_via_proxy: S3Target, s3_bucket: S3Target,
                                                         fault_proxy: FaultProxy) -> None:
    truth, durable = train(storage(s3_via_proxy), steps=32, write_batch=8, base_every_n_steps=None)
    assert durable == 32
    inv = RunStore(storage(s3_bucket)).inventory()
    assert [(s.after, s.last) for s in inv.segments] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    # one PUT per 8 steps for diffs, two for the starting base (state, then COMMIT), nothing else
    assert fault_proxy.count("PUT", r"/diffs/") == 4
    assert fault_proxy.count("PUT", r"/bases/") == 2
    assert [e.path.rsplit("/", 1)[-1] for e in fault_proxy.log if e.method == "PUT" and "/bases/" in e.path] == [
        "state.safetensors", "COMMIT"]  # the marker goes last
    every_step_restores(s3_via_proxy, truth, 32)


def wide() -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 1024), torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1))
    return m, [torch.optim.AdamW(m.parameters(), lr=1e-3)]


def test_large_objects_are_uploaded_in_parts_and_a_reset_part_is_retried(
        s3_via_proxy: S3Target, s3_bucket: S3Target, fault_proxy: FaultProxy) -> None:
    # 8.5 MB segments and a 12.7 MB base at step 4, in 5 MiB parts; a second part is cut mid-body
    fault_proxy.reset(2, after_body_bytes=MiB, method="PUT", path_regex=r"partNumber=2")
    big = storage(s3_via_proxy, part_size=5 * MiB, multipart_threshold=5 * MiB)
    m, o = wide()
    engine = CheckpointEngine(big, CheckpointOptions(write_batch=2, base_every_n_steps=4, retry=PATIENT))
    engine.start(m, o, 0)
    truth: Truth = {0: snapshot(m, o, 0)}
    engine.write_base(0, m.state_dict(), [x.state_dict() for x in o], {"x": 0})
    train_steps(engine, m, o, 1, 4, truth)
    assert engine.close() == 4
    assert fault_proxy.count("POST", r"\?uploads") >= 3  # both segments and the base at 4
    assert fault_proxy.count("PUT", r"partNumber=2", outcome=200) == 3
    assert fault_proxy.count(outcome="reset") == 2
    # the cut upload was aborted, not left behind, and nothing partial is visible
    fs = s3_bucket.fs()
    assert fs.call_s3("list_multipart_uploads", Bucket=s3_bucket.bucket).get("Uploads", []) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in (None, 0, 3):
            result, m2, o2 = restore(storage(s3_bucket), step, maker=wide)
            assert_state(truth, result, m2, o2)


# ------------------------------------------------------------------------------- faults
def test_training_goes_through_5xx_resets_and_latency(s3_via_proxy: S3Target, fault_proxy: FaultProxy,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    fault_proxy.latency(0.01)
    fault_proxy.fail(3, status=500, method="PUT")  # s3fs does not retry 500s: diffckpt does
    fault_proxy.reset(2, after_body_bytes=500, method="PUT", path_regex="/diffs/")  # mid-upload
    with caplog.at_level(logging.INFO, logger="diffckpt"):
        truth, durable = train(storage(s3_via_proxy), retry=PATIENT)
    assert durable == 13
    assert fault_proxy.count(outcome="failed") == 3 and fault_proxy.count(outcome="reset") == 2
    log = messages(caplog)
    assert "transient, retry 1" in log and "storage outage" not in log
    every_step_restores(s3_via_proxy, truth, 13)


def test_outage_is_ridden_out_and_the_backlog_drains(s3_via_proxy: S3Target, fault_proxy: FaultProxy,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    m, o = make()
    engine = CheckpointEngine(storage(s3_via_proxy), CheckpointOptions(**OPTIONS, retry=FAST))
    engine.start(m, o, 0)
    truth: Truth = {0: snapshot(m, o, 0)}
    engine.write_base(0, m.state_dict(), [x.state_dict() for x in o], {"x": 0})
    train_steps(engine, m, o, 1, 4, truth)
    assert engine.flush() == 4
    with caplog.at_level(logging.WARNING, logger="diffckpt"):
        fault_proxy.outage(1.5)  # three times the retry budget
        train_steps(engine, m, o, 5, 13, truth)  # buffered: training does not wait
        assert engine.close() == 13
    log = messages(caplog)
    assert re.search(r"storage outage while committing diffs/.*storage kept failing.*Durable up to step 4", log), log
    assert "is back after" in log
    assert fault_proxy.count(outcome="reset") > 0
    every_step_restores(s3_via_proxy, truth, 13)


def test_outage_with_raise_stops_training_and_keeps_what_was_durable(
        s3_via_proxy: S3Target, s3_bucket: S3Target, fault_proxy: FaultProxy) -> None:
    m, o = make()
    engine = CheckpointEngine(storage(s3_via_proxy), CheckpointOptions(
        **OPTIONS, retry=FAST, max_pending_bytes=1, on_storage_error="raise"))
    engine.start(m, o, 0)
    truth: Truth = {0: snapshot(m, o, 0)}
    engine.write_base(0, m.state_dict(), [x.state_dict() for x in o], {"x": 0})
    train_steps(engine, m, o, 1, 3, truth)
    assert engine.flush() == 3
    fault_proxy.outage_until_cleared()
    with pytest.raises(StorageUnavailableError, match="durable up to step 3"):
        train_steps(engine, m, o, 4, 1000, truth)
    assert engine.close(timeout=1.0) == 3
    fault_proxy.clear()
    # another node (no journal) finds what was durable; this node also what its journal kept
    result, m2, o2 = restore(storage(s3_bucket), options=CheckpointOptions(local_dir=None))
    assert result.step == 3
    assert_state(truth, result, m2, o2)
    result, m2, o2 = restore(storage(s3_bucket))
    assert 4 <= result.step <= max(truth)  # step 4 came after the flush: the writer journaled it
    assert_state(truth, result, m2, o2)


def test_missing_bucket_is_a_clear_error(s3_bucket: S3Target) -> None:
    m, o = make()
    target = S3Target.create(s3_bucket.endpoint, "no-such-bucket-here")
    with pytest.raises(StorageError, match="the bucket or container does not exist: create it or fix dirpath"):
        CheckpointEngine(storage(target)).start(m, o, 0)
    with pytest.raises(CheckpointNotFoundError, match="nothing under s3://no-such-bucket-here/run"):
        restore(storage(target))


# ------------------------------------------------------------------------------- damage
def _chain(target: S3Target) -> Truth:
    truth, durable = train(storage(target), base_every_n_steps=None)  # base 0; 0-3, 3-6, 6-9, 9-12, 12-13
    assert durable == 13
    return truth


SEG69 = "diffs/000000000006-000000000009.g000001.seg"


@pytest.mark.parametrize(("damage", "expected"), [("flip", 7), ("truncate", 6), ("delete", 6)])
def test_damaged_object_falls_back_to_the_newest_good_step(s3_bucket: S3Target, damage: str, expected: int,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    truth = _chain(s3_bucket)
    fs, key = s3_bucket.fs(), f"{s3_bucket.url}/{SEG69}"
    data = bytearray(fs.cat_file(key))
    if damage == "flip":
        offset, length = record_span(bytes(data), 8)
        data[offset + length // 2] ^= 0xFF
        fs.pipe_file(key, bytes(data))
    elif damage == "truncate":
        fs.pipe_file(key, bytes(data[: record_span(bytes(data), 7)[0] + 10]))
    else:
        fs.rm_file(key)
    named = SEG69 if damage != "delete" else "a segment is missing before diffs/000000000009-000000000012"
    with pytest.warns(UserWarning, match=re.escape(named)):
        result, m, o = restore(storage(s3_bucket))
    assert result.step == expected
    assert_state(truth, result, m, o)
    with pytest.raises(DiffCkptError):
        restore(storage(s3_bucket), 13)
    # `diffckpt verify` reaches the bucket through the environment and names the bad object
    rc = cli.main(["verify", s3_bucket.url])
    out = capsys.readouterr()
    assert rc != 0
    assert (SEG69 if damage != "delete" else "gap") in out.out + out.err


# ---------------------------------------------------------------------------- two writers
def test_two_writers_on_one_bucket_prefix_are_fenced(s3_bucket: S3Target) -> None:
    m, o = make()
    old = CheckpointEngine(storage(s3_bucket), CheckpointOptions(**OPTIONS))
    assert old.start(m, o, 0) == 1
    truth: Truth = {0: snapshot(m, o, 0)}
    old.write_base(0, m.state_dict(), [x.state_dict() for x in o], {"x": 0})
    train_steps(old, m, o, 1, 6, truth)
    assert old.flush() == 6
    store = RunStore(storage(s3_bucket))
    # a session file that exists is never overwritten: the conditional PUT (If-None-Match) fails
    assert storage(s3_bucket).create("sessions/g000001.json", b"{}") is False
    result, m2, o2 = restore(storage(s3_bucket))
    new = CheckpointEngine(storage(s3_bucket), CheckpointOptions(**OPTIONS))
    assert new.start(m2, o2, result.step) == 2
    new.write_base(6, m2.state_dict(), [x.state_dict() for x in o2], {"x": 6})
    with pytest.raises(DiffCkptError, match=r"another job started writing to s3://.*session g2.*session g1\) stopped"
                       ) as info:
        train_steps(old, m, o, 7, 13, truth)
        old.flush()
    assert isinstance(info.value.__cause__, ConcurrentWriterError)
    with pytest.raises(DiffCkptError):
        old.close()
    train_steps(new, m2, o2, 7, 13, {})
    assert new.close() == 13
    assert store.inventory().newest_step(1) == 6
