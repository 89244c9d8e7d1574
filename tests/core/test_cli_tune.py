"""``diffckpt tune``: probe a storage location, recommend settings.

Runs the real command (in-process through ``main([...])``, once as ``python -m diffckpt``) against
a local directory, the moto S3 server, and S3 behind the fault proxy with injected latency.
Probes use small objects so each run takes well under a second (plus the latency injected).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from faultproxy import FaultProxy
from s3env import S3Target, need_s3_packages, s3_storage_options

from diffckpt.cli import main
from diffckpt.tuning.planner import STATE_S
from diffckpt.tuning.sizing import parse_codec
from diffckpt.units import parse_count, parse_duration, parse_size

Cap = pytest.CaptureFixture[str]
SMALL = ["--probe-sizes", "4KiB,64KiB", "--repeats", "2"]
MODEL = ["--params", "100k", "--step-time", "20ms", "--mtbf", "1m"]
# Short steps and very frequent failures: on fast storage the best segment is a few steps long, so
# 200 ms per request must show in the recommendation. The host-dependent figures are pinned (this
# machine may be busy) and the overhead budget is loose, so that only the probe decides.
LATENCY_MODEL = ["--params", "10k", "--step-time", "20ms", "--mtbf", "10s", "--max-overhead", "0.2",
                 "--copy-bandwidth", "1GB", "--replay-step-time", "2ms"]
WIDE = ["--probe-sizes", "4KiB,1MiB"]  # a spread that shows the bandwidth through a slow proxy too
LATENCY = 0.2


def cli(capsys: Cap, *argv: Any) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def tune_json(capsys: Cap, url: str, *extra: Any, model: list[str] = MODEL) -> dict[str, Any]:
    rc, out, err = cli(capsys, "tune", url, *model, *SMALL, "--json", *extra)
    assert rc == 0, err
    return json.loads(out)


def s3_options(target: S3Target) -> list[str]:
    return [a for k, v in s3_storage_options(target.endpoint).items() for a in ("-O", f"{k}={json.dumps(v)}")]


def tree(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under ``root`` with its size, mtime and content hash, and every directory."""
    out: dict[str, tuple[int, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        out.update((str(Path(dirpath, name).relative_to(root)), (0, 0, "dir")) for name in dirnames)
        for name in filenames:
            p = Path(dirpath, name)
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def s3_keys(target: S3Target) -> list[str]:
    return sorted(target.fs().find(target.bucket))


# --------------------------------------------------------------------------- local disk
def test_local_human_output_leaves_an_existing_run_untouched(tmp_path: Path, capsys: Cap) -> None:
    root = tmp_path / "run"
    for rel, data in {"run.json": b"{}", "bases/000000000000.g000001/COMMIT": b"c",
                      "diffs/000000000000-000000000003.g000001.seg": os.urandom(1000),
                      "_probe/someone-elses": b"x"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    before = tree(root)
    rc, out, err = cli(capsys, "tune", root, "--params", "125M", "--step-time", "0.5", "--mtbf", "24h", *SMALL)
    assert rc == 0, err
    assert tree(root) == before  # no file changed, no probe object or directory left
    lines = out.splitlines()
    assert lines[0] == f"diffckpt tune {root}"
    assert '"auto"' in out and "re-measures" in out
    table = lines[lines.index(next(ln for ln in lines if ln.startswith("storage probe"))) + 1:][:3]
    assert table[0].split() == ["size", "median", "MiB/s"]
    assert table[1].split()[:2] == ["4.0", "KiB"] and table[2].split()[:2] == ["64.0", "KiB"]
    assert any(ln.startswith("  fitted write cost: latency ") for ln in lines)
    assert "estimated on this machine (cpu), not probed" in out
    assert "125M parameters, adamw (2 state slots)" in out
    assert "base 1.4 GiB" in out  # 125M x 4 bytes x (1 + 2 slots)
    # Dense 125M gradients at 0.5 s a step are more than this machine copies and writes within
    # budget: the report says so, and still names the least bad settings.
    assert "no setting meets every constraint" in out and "  limit: " in out
    rec = next(ln.strip() for ln in lines if ln.startswith("  DiffCheckpoint("))
    assert rec.startswith(f'DiffCheckpoint("{root}", every_n_steps=')
    assert "write_batch=" in rec and "base_every_n_steps=" in rec
    assert "expected loss" in out and "per failure" in out and "writer busy" in out
    comparison = lines[lines.index(next(ln for ln in lines if ln.startswith("comparison"))) + 2:]
    fixed = [ln.split()[:3] for ln in comparison[1:7]]
    assert fixed == [[n, b, "500"] for n in ("1", "10", "100") for b in ("1", "16")]


def test_local_json_fields_and_directory_created_by_the_probe_is_removed(tmp_path: Path, capsys: Cap) -> None:
    url = tmp_path / "not" / "yet"
    d = tune_json(capsys, str(url), "--replay-step-time", "3ms", "--codec", "topk:0.01", "--rto", "10m")
    assert not (tmp_path / "not").exists()
    assert d["url"] == str(url)
    p = d["probe"]
    assert [r["bytes"] for r in p["table"]] == [4096, 65536] and len(p["samples"]) == 4
    assert p["latency_s"] >= 0 and p["bandwidth_bps"] > 0 and p["leftover"] == []
    assert d["model"]["params"] == 100_000 and d["model"]["record_bytes"] == 1000 * 8
    assert d["model"]["base_bytes"] == 100_000 * 4 * 3
    assert d["measurements"]["replay_step_s"] == pytest.approx(0.003)
    assert d["measurements"]["step_s"] == pytest.approx(0.02) and d["options"]["mtbf_s"] == 60
    assert d["options"]["rto_s"] == 600 and d["measurements"]["state_s"] == STATE_S
    for key in ("copy_bandwidth_bps", "hash_bandwidth_bps", "optimizer_step_s", "record_s", "base_load_s"):
        assert d["estimates"][key] > 0, key
    rec = d["recommended"]
    assert rec["snippet"] == (f'DiffCheckpoint("{url}", every_n_steps={rec["every_n_steps"]}, write_batch='
                              f'{rec["write_batch"]}, base_every_n_steps={rec["base_every_n_steps"]}, '
                              "codec=TopK(0.01))")
    e = rec["estimate"]
    for key in ("loss", "overhead", "lost_work_s", "recovery_s", "worst_recovery_s", "writer_utilization",
                "memory_bytes", "violations", "feasible"):
        assert key in e, key
    assert e["feasible"] and e["worst_recovery_s"] <= 600
    assert e["loss"] == pytest.approx(e["overhead"] + e["failures"])
    assert [(c["every_n_steps"], c["write_batch"], c["base_every_n_steps"]) for c in d["comparison"]] == [
        (1, 1, 500), (1, 16, 500), (10, 1, 500), (10, 16, 500), (100, 1, 500), (100, 16, 500)]
    assert all(e["loss"] <= c["loss"] for c in d["comparison"] if c["feasible"])
    assert "auto" in d["note"]


def test_fixed_knobs_are_kept(tmp_path: Path, capsys: Cap) -> None:
    d = tune_json(capsys, str(tmp_path), "--every-n-steps", "1", "--base-every-n-steps", "none")
    rec = d["recommended"]
    assert rec["every_n_steps"] == 1 and rec["base_every_n_steps"] is None
    assert d["options"]["fixed"] == {"every_n_steps": 1, "base_every_n_steps": None}


def test_bases_sized_by_bytes_as_training_sizes_them(tmp_path: Path, capsys: Cap) -> None:
    # 100k parameters, AdamW: a 1.2 MB base, 400 kB of dense gradients per step: 4 x 3 = 12 steps.
    d = tune_json(capsys, str(tmp_path), "--base-every-n-steps", "bytes")
    assert d["recommended"]["base_every_n_steps"] == 12
    assert d["options"]["fixed"] == {"base_every_n_steps": 12}
    rc, _, err = cli(capsys, "tune", tmp_path, *MODEL, "--base-every-n-steps", "weekly")
    assert rc == 2 and "not a positive integer, 'none', 'auto' or 'bytes'" in err


def test_module_entry_point(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "diffckpt", "tune", str(tmp_path), *MODEL, *SMALL, "--json"],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["recommended"]["every_n_steps"] >= 1
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------- S3
def test_s3_probe_removes_its_objects_and_latency_means_larger_segments(
        s3_bucket: S3Target, s3_via_proxy: S3Target, fault_proxy: FaultProxy, capsys: Cap) -> None:
    s3_bucket.fs().pipe(f"{s3_bucket.bucket}/run/run.json", b"{}")  # an existing run's file
    direct = tune_json(capsys, s3_bucket.url, *s3_options(s3_bucket), *WIDE, model=LATENCY_MODEL)
    assert s3_keys(s3_bucket) == [f"{s3_bucket.bucket}/run/run.json"]
    assert direct["probe"]["leftover"] == []

    fault_proxy.latency(LATENCY)
    slow = tune_json(capsys, s3_via_proxy.url, *s3_options(s3_via_proxy), *WIDE, "--repeats", "1",
                     model=LATENCY_MODEL)
    assert s3_keys(s3_bucket) == [f"{s3_bucket.bucket}/run/run.json"]
    puts = [e.path for e in fault_proxy.log if e.method == "PUT"]
    deletes = [e.path for e in fault_proxy.log if e.method == "DELETE"]
    assert len(puts) == 3 and sorted(puts) == sorted(deletes)  # warm-up + 2 sizes, each deleted
    assert all(p.startswith(f"/{s3_bucket.bucket}/run/_probe/tune-") for p in puts)

    assert slow["probe"]["latency_s"] >= LATENCY * 0.9 > direct["probe"]["latency_s"]
    fast_rec, slow_rec = direct["recommended"], slow["recommended"]
    # With the node-local tier (training's default, which tune models) a crash loses the steps
    # since the newest restorable step: latency lengthens segments, not every_n_steps.
    assert slow_rec["write_batch"] >= fast_rec["write_batch"]
    assert slow_rec["estimate"]["segment_steps"] > fast_rec["estimate"]["segment_steps"]
    # The writer keeps up: a segment spans enough step time to pay the request latency.
    e = slow_rec["estimate"]
    assert e["feasible"] and e["writer_utilization"] <= slow["limits"]["writer_headroom"]
    assert e["segment_steps"] * 0.02 * slow["limits"]["writer_headroom"] >= slow["probe"]["latency_s"]


def test_missing_bucket_exits_1(s3_bucket: S3Target, capsys: Cap) -> None:
    target = S3Target.create(s3_bucket.endpoint, "no-such-bucket-here")
    rc, out, err = cli(capsys, "tune", target.url, *MODEL, *SMALL, *s3_options(target))
    assert rc == 1 and out == ""
    assert err.startswith("error: cannot probe s3://no-such-bucket-here/run (tune writes and deletes ")
    assert "the bucket or container does not exist: create it or fix the URL" in err


def test_unreachable_endpoint_exits_1(capsys: Cap) -> None:
    need_s3_packages()
    with socket.socket() as s:  # a free port, closed again: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = S3Target.create(f"http://127.0.0.1:{port}", "bucket")
    rc, out, err = cli(capsys, "tune", target.url, *MODEL, *SMALL, *s3_options(target), "--retry-budget", "0.3")
    assert rc == 1 and out == ""
    assert err.startswith("error: cannot probe s3://bucket/run (")
    assert "reachable" in err and "--retry-budget" in err


def test_unwritable_directory_exits_1(tmp_path: Path, capsys: Cap) -> None:
    (tmp_path / "file").write_bytes(b"")
    rc, out, err = cli(capsys, "tune", tmp_path / "file" / "run", *MODEL, *SMALL)
    assert rc == 1 and out == ""
    assert err.startswith(f"error: cannot probe {tmp_path}/file/run (")
    assert "a part of the path is a file, not a directory" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("argv", [
    ["--params", "lots", "--step-time", "1"],
    ["--params", "0", "--step-time", "1"],
    ["--params", "1M"],  # no --step-time
    ["--params", "1M", "--step-time", "5 parsecs"],
    ["--params", "1M", "--step-time", "-1"],
    ["--params", "1M", "--step-time", "1", "--mtbf", "0"],
    ["--params", "1M", "--step-time", "1", "--codec", "topk:2"],
    ["--params", "1M", "--step-time", "1", "--codec", "zip"],
    ["--params", "1M", "--step-time", "1", "--optimizer", "lion"],
    ["--params", "1M", "--step-time", "1", "--max-overhead", "1.5"],
    ["--params", "1M", "--step-time", "1", "--memory", "lots"],
    ["--params", "1M", "--step-time", "1", "--probe-sizes", "4KiB,0"],
    ["--params", "1M", "--step-time", "1", "--write-batch", "none"],
    ["--params", "1M", "--step-time", "1", "-O", "no-equals-sign"],
])
def test_bad_input_exits_2(tmp_path: Path, capsys: Cap, argv: list[str]) -> None:
    rc, out, err = cli(capsys, "tune", tmp_path / "run", *argv)
    assert rc == 2 and out == "" and "error" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("text", "value"), [("350000", 350_000), ("125M", 125_000_000), ("1.3B", 1_300_000_000),
                                             ("7e9", 7_000_000_000), ("100k", 100_000)])
def test_parse_count(text: str, value: int) -> None:
    assert parse_count(text) == value


@pytest.mark.parametrize(("text", "value"), [("0.5", 0.5), ("500ms", 0.5), ("30m", 1800), ("24h", 86400),
                                             ("7d", 604800), ("1h30m", 5400), ("45s", 45)])
def test_parse_duration(text: str, value: float) -> None:
    assert parse_duration(text) == pytest.approx(value)


@pytest.mark.parametrize(("text", "value"), [("4096", 4096), ("4KiB", 4096), ("16M", 16 << 20), ("1GB", 10**9),
                                             ("256MiB", 256 << 20)])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


def test_codec_sizes() -> None:
    params = 125_000_000
    assert parse_codec("none").record_bytes(params) == 4 * params
    assert parse_codec("topk:0.01").record_bytes(params) == 0.01 * params * 8
    assert parse_codec("bf16").record_bytes(params) == 2 * params
    psgd = parse_codec("powersgd:4").record_bytes(params)
    assert 0.001 * params < psgd < 0.1 * params  # rank 4 of ~870-wide matrices: ~0.03 B/param
    with pytest.raises(argparse.ArgumentTypeError):
        parse_codec("powersgd:0")
