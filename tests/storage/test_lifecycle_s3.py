"""Retention and compaction on a real S3-compatible server (moto): ``diffckpt gc --apply`` killed
with SIGKILL while it deletes leaves a restorable run every time, and a later run finishes the
job; incomplete multipart uploads are aborted once old enough; compaction writes a base there
that equals the trained state."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from engine_runs import train
from helpers import assert_bitwise_equal, script_env

import diffckpt
from diffckpt import RetentionPolicy, collect_garbage
from diffckpt.cli import main as cli_main

pytest.importorskip("s3fs")
pytest.importorskip("moto")

STEPS = 30  # bases at 0, 10, 20, 30; segments of 2 steps
KEEP = ["--keep-last-bases", "2"]  # deletes bases 0 and 10 and the 10 segments before step 20
DELETIONS = 10 + 2 * 2
LATENCY = 0.1


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    root = tmp_path_factory.mktemp("gc") / "run"
    truth, durable = train(root, steps=STEPS, base_every_n_steps=10, write_batch=2)
    assert durable == STEPS
    return root, truth


def _objects(fs: Any, prefix: str) -> list[str]:
    fs.invalidate_cache()
    return sorted(p.split("/", 2)[2] for p in fs.find(prefix))


def _assert_restorable(url: str, storage_options: dict[str, Any], truth: dict[int, Any],
                       steps: list[int | None]) -> None:
    for step in steps:
        state = diffckpt.load_state(url, step, storage_options=storage_options)
        assert state["step"] == (STEPS if step is None else step)
        assert_bitwise_equal(truth[state["step"]]["model"], state["model"])
        assert_bitwise_equal(truth[state["step"]]["optimizers"], state["optimizers"])


def test_gc_killed_mid_deletion_leaves_a_restorable_run(local_run, s3_bucket, s3_via_proxy, fault_proxy) -> None:
    root, truth = local_run
    fs = s3_bucket.fs()
    rng = random.Random(7)
    deleted_per_trial = []
    for trial in range(4):
        prefix = f"{s3_bucket.bucket}/trial{trial}"
        fs.put(str(root), prefix, recursive=True)
        before = _objects(fs, prefix)
        url = f"s3://{prefix}"
        fault_proxy.latency(LATENCY)  # a distant store: each DELETE takes a while
        proc = subprocess.Popen([sys.executable, "-m", "diffckpt", "gc", url, *KEEP, "--apply"],
                                env=script_env(s3_via_proxy.env), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while not any(e.method == "DELETE" and f"/trial{trial}/" in e.path for e in fault_proxy.log):
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "gc never started deleting"
            time.sleep(0.01)
        time.sleep(rng.uniform(0, DELETIONS * LATENCY))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        fault_proxy.latency(0)
        deleted_per_trial.append(len(before) - len(_objects(fs, prefix)))
        # Restorable right after the kill: the newest step, and the window of the last 2 bases.
        _assert_restorable(url, s3_bucket.storage_options, truth, [None, 20, 25 + 1, 30])
        # A later run (here in-process, straight to moto) finishes the job.
        assert cli_main(["gc", url, *KEEP, "--apply", *_opts(s3_bucket)]) == 0
        remaining = _objects(fs, prefix)
        assert len(before) - len(remaining) == DELETIONS
        assert not [p for p in remaining if "000000000000.g" in p or "000000000010.g" in p]
        _assert_restorable(url, s3_bucket.storage_options, truth, [None, 20, 30])
    print("deleted per trial", deleted_per_trial)
    # The kills landed while deleting, not before or after it.
    assert any(0 < n < DELETIONS for n in deleted_per_trial), deleted_per_trial


def _opts(target: Any) -> list[str]:
    import json

    out = []
    for key, value in target.storage_options.items():
        out += ["-O", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
    return out


def test_incomplete_multipart_uploads_are_aborted_once_old(local_run, s3_bucket) -> None:
    root, truth = local_run
    fs = s3_bucket.fs()
    prefix = f"{s3_bucket.bucket}/run"
    fs.put(str(root), prefix, recursive=True)
    key = "run/diffs/000000000030-000000000032.g000001.seg"  # what a killed writer leaves
    upload = fs.call_s3("create_multipart_upload", Bucket=s3_bucket.bucket, Key=key)
    fs.call_s3("upload_part", Bucket=s3_bucket.bucket, Key=key, UploadId=upload["UploadId"],
               PartNumber=1, Body=b"x" * (5 << 20))
    other = fs.call_s3("create_multipart_upload", Bucket=s3_bucket.bucket, Key="elsewhere/obj")

    def uploads() -> list[str]:
        return [u["Key"] for u in fs.call_s3("list_multipart_uploads", Bucket=s3_bucket.bucket).get("Uploads", [])]

    # moto reports every upload as initiated in 2010, so this one is older than min_age_s (the
    # age check itself is tested with local temporary files in tests/core/test_retention.py).
    dry = collect_garbage(s3_bucket.url, RetentionPolicy(), storage_options=s3_bucket.storage_options)
    assert [(x.path, x.kind) for x in dry.leftovers] == [(key.removeprefix("run/"), "incomplete multipart upload")]
    assert sorted(uploads()) == ["elsewhere/obj", key]  # a dry run aborts nothing
    collect_garbage(s3_bucket.url, RetentionPolicy(), storage_options=s3_bucket.storage_options, dry_run=False)
    assert uploads() == ["elsewhere/obj"]  # outside the run root: not ours
    fs.call_s3("abort_multipart_upload", Bucket=s3_bucket.bucket, Key="elsewhere/obj", UploadId=other["UploadId"])
    _assert_restorable(s3_bucket.url, s3_bucket.storage_options, truth, [None, 0])


def test_compaction_on_s3_equals_the_trained_state(local_run, s3_bucket) -> None:
    root, truth = local_run
    s3_bucket.fs().put(str(root), f"{s3_bucket.bucket}/run", recursive=True)
    result = diffckpt.compact(s3_bucket.url, 26, storage_options=s3_bucket.storage_options)
    assert (result.written, result.from_base, result.replayed) == (True, 20, 6)
    state = diffckpt.load_state(s3_bucket.url, 26, storage_options=s3_bucket.storage_options)
    assert (state["base_step"], state["replayed"]) == (26, 0)  # restores start from it now
    assert_bitwise_equal(truth[26]["model"], state["model"])
    assert_bitwise_equal(truth[26]["optimizers"], state["optimizers"])
