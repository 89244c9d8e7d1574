"""Compaction: a base rolled forward from stored diffs equals the trained state at its step, is
marked and verified, serves restores, and is refused (writing nothing) when it cannot be right."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_runs import assert_state, base_dir, restore, train
from helpers import assert_bitwise_equal, subprocess_env
from s3env import need_s3_packages
from safetensors.torch import load_file
from test_compressed import CODECS, Run
from test_compressed import make as make_coded

from diffckpt import CheckpointEngine, CheckpointNotFoundError, ReplayMismatchError, compact
from diffckpt.cli import main
from diffckpt.codecs.compressor import GradientCompressor
from diffckpt.errors import UnsupportedConfigurationError
from diffckpt.lifecycle.compaction import recorded_device
from diffckpt.runstore import RunStore
from diffckpt.storage import open_storage

STEPS = 20  # one base (step 0), segments of 3 steps: ends at 3, 6, ..., 18, 20


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, dict[int, Any]]:
    root = tmp_path / "run"
    truth, durable = train(root, steps=STEPS, base_every_n_steps=None)
    assert durable == STEPS
    return root, truth


def _base(root: Path, step: int) -> tuple[dict[str, Any], Any]:
    store = RunStore(open_storage(root))
    return store.load_base(next(b for b in store.inventory().bases if b.step == step))


def test_compacted_base_equals_the_trained_state(run: tuple[Path, dict[int, Any]]) -> None:
    root, truth = run
    result = compact(root, 12)
    assert (result.step, result.from_base, result.replayed, result.written) == (12, 0, 12, True)
    assert result.verified_at_step  # fingerprint_every_n_steps=2: step 12 has one from training
    info, tree = _base(root, 12)
    assert_bitwise_equal(truth[12]["model"], tree["model"])
    assert_bitwise_equal(truth[12]["optimizers"], tree["optimizers"])
    assert tree["state"] == {"x": 12}
    assert info["compacted"]["from_base"] == 0 and info["compacted"]["verified_through"] == 12
    assert info["compacted"]["device"] == "cpu" and info["compacted"]["by"] == "diffckpt compact"
    # Restores now start from it: the newest step replays 8 steps instead of 20.
    newest, module, optimizers = restore(root)
    assert (newest.step, newest.base_step, newest.replayed) == (20, 12, 8)
    assert_state(truth, newest, module, optimizers)
    at, module, optimizers = restore(root, 12)
    assert at.replayed == 0
    assert_state(truth, at, module, optimizers)
    # Compacting again to the same step writes nothing.
    assert not compact(root, 12).written


def test_newest_by_default_and_a_training_engine_resumes_from_it(run: tuple[Path, dict[int, Any]]) -> None:
    root, truth = run
    assert compact(root).step == STEPS
    result, module, optimizers = restore(root)
    assert (result.step, result.base_step, result.replayed) == (STEPS, STEPS, 0)
    assert_state(truth, result, module, optimizers)


def test_cli_compacts_from_another_process(run: tuple[Path, dict[int, Any]]) -> None:
    root, truth = run
    out = subprocess.run([sys.executable, "-m", "diffckpt", "compact", str(root), "--to", "15", "--json"],
                         capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["step"] == 15 and report["replayed"] == 15 and report["written"]
    assert report["verified_through"] == 14  # step 15 has no fingerprint; 14 was the last checked
    _, tree = _base(root, 15)
    assert_bitwise_equal(truth[15]["model"], tree["model"])
    assert_bitwise_equal(truth[15]["optimizers"], tree["optimizers"])
    text = subprocess.run([sys.executable, "-m", "diffckpt", "compact", f"{root}/step=18"],
                          capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert text.returncode == 0, text.stderr
    assert "compacted step 18 of g1 from base 15: replayed 3 steps" in text.stdout
    assert "matches the fingerprint recorded in training at step 18" in text.stdout


@pytest.mark.parametrize("to, message", [(13, "no segment ends there"), (99, "not durable")])
def test_steps_that_cannot_take_a_base_are_refused(run: tuple[Path, dict[int, Any]], to: int,
                                                    message: str) -> None:
    root, _ = run
    with pytest.raises(CheckpointNotFoundError, match=message):
        compact(root, to)
    assert not base_dir(root, to).exists()


def _accelerator(monkeypatch: pytest.MonkeyPatch, device: str | None) -> None:
    """What ``torch.accelerator`` reports here, whatever this machine has."""
    here = None if device is None else torch.device(device)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *args, **kwargs: here)


def test_replay_defaults_to_the_device_type_the_session_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    assert recorded_device({"gen": 1, "device": "cpu"}) == "cpu"
    assert recorded_device({"gen": 1}) == "cpu"  # sessions of versions that did not record it
    _accelerator(monkeypatch, "cuda")
    assert recorded_device({"gen": 1, "device": "cuda:1"}) == "cuda"  # the type: any GPU here replays it
    _accelerator(monkeypatch, None)
    with pytest.raises(UnsupportedConfigurationError, match=r"trained on cuda:1.*no CUDA device here"):
        recorded_device({"gen": 1, "device": "cuda:1"})


def test_a_run_trained_on_cuda_is_compacted_on_cuda_or_refused(run: tuple[Path, dict[int, Any]],
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The session file records the device training ran on, and ``compact`` replays there unless
    told otherwise. A CUDA run (faked in its session file) on a machine without CUDA is refused,
    naming the way out: ``--device cpu``, checked against training's fingerprints."""
    root, truth = run
    session = root / "sessions" / "g000001.json"
    meta = json.loads(session.read_text())
    assert meta["device"] == "cpu"
    assert compact(root, 6).written
    assert json.loads((base_dir(root, 6) / "COMMIT").read_text())["compacted"]["device"] == "cpu"
    session.write_text(json.dumps({**meta, "device": "cuda:0"}))
    _accelerator(monkeypatch, None)
    with pytest.raises(UnsupportedConfigurationError, match="--device cpu"):
        compact(root, 9)
    assert main(["compact", str(root), "--to", "9"]) == 2
    err = capsys.readouterr().err
    assert "error: session g1 trained on cuda:0" in err and "no CUDA device here" in err and "--device cpu" in err
    assert not base_dir(root, 9).exists()
    assert main(["compact", str(root), "--to", "9", "--device", "cpu"]) == 0
    info, tree = _base(root, 9)
    assert info["compacted"]["device"] == "cpu"
    assert_bitwise_equal(truth[9]["model"], tree["model"])  # training ran on the CPU after all


def test_verify_and_export_replay_on_the_recorded_device_or_refuse(run: tuple[Path, dict[int, Any]], tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``verify`` and ``export`` replay where training ran, as ``compact`` does: on another
    device type the fingerprints recorded in training would report damage that is not there."""
    root, truth = run
    out = tmp_path / "out.safetensors"
    assert main(["verify", str(root)]) == 0  # trained on the CPU: replayed there
    session = root / "sessions" / "g000001.json"
    session.write_text(json.dumps({**json.loads(session.read_text()), "device": "cuda:0"}))
    _accelerator(monkeypatch, None)
    capsys.readouterr()
    for command in (["verify", str(root)], ["export", str(root), "-o", str(out)]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert "trained on cuda:0" in err and "no CUDA device here" in err and "--device cpu" in err
    assert not out.exists()
    assert main(["verify", str(root), "--device", "cpu"]) == 0
    assert main(["export", str(root), "--step", "9", "-o", str(out), "--device", "cpu"]) == 0
    assert_bitwise_equal(truth[9]["model"], load_file(str(out)))  # training ran on the CPU after all


def test_replay_that_diverges_from_training_writes_nothing(run: tuple[Path, dict[int, Any]]) -> None:
    root, _ = run
    commit = base_dir(root, 0) / "COMMIT"
    info = json.loads(commit.read_text())
    info["fingerprint"] = "0" * 64  # the base no longer matches what training recorded
    commit.write_text(json.dumps(info))
    with pytest.raises(ReplayMismatchError):
        compact(root, 12)
    assert not base_dir(root, 12).exists()


def test_compressed_run_resumes_its_codec_from_a_compacted_base(tmp_path: Path) -> None:
    # PowerSGD without error feedback keeps warm-start factors, which the payloads carry: after a
    # restore at (or replay past) a compacted base, the codec state is exact too.
    codec = "powersgd-warm"
    trained = Run(tmp_path, codec, base_every_n_steps=None)
    trained.train(12)
    assert compact(tmp_path, 9).written
    for step in (9, 12):
        module, optimizers = make_coded()
        compressor = GradientCompressor(CODECS[codec](), module)
        result = CheckpointEngine(tmp_path).restore(module, optimizers, step, compressor=compressor)
        assert result.base_step == 9
        assert_state(trained.truth, result, module, optimizers)
        assert_bitwise_equal(compressor.state_dict(), trained.codec_truth[step])
    payloads = _base(tmp_path, 9)[1]["codec_payloads"]
    assert payloads and all(torch.is_tensor(t) for p in payloads.values() for t in p.values())


def _cli(*argv: Any) -> tuple[int, str]:
    import contextlib
    import io

    from diffckpt.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main([str(a) for a in argv])
    return rc, err.getvalue()


def test_bad_input_is_named_and_writes_nothing(run: tuple[Path, dict[int, Any]], tmp_path: Path) -> None:
    import socket

    from engine_runs import flip, seg

    root, _ = run
    # Not a run: exit 2, for gc and compact alike.
    (tmp_path / "empty").mkdir()
    for command in ("gc", "compact"):
        rc, err = _cli(command, tmp_path / "empty")
        assert rc == 2 and "no diffckpt run under" in err, err
    # A damaged segment on the way: exit 1, the segment named, no base written.
    flip(seg(root, 6, 9), 40)
    rc, err = _cli("compact", root, "--to", "12")
    assert rc == 1 and "000000000006-000000000009" in err, err
    assert not base_dir(root, 12).exists()
    # Unreachable object storage: exit 1 after the retry budget, with what to check.
    need_s3_packages()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    options = ["-O", f"endpoint_url=http://127.0.0.1:{port}", "-O", "key=k", "-O", "secret=s",
               "-O", 'config_kwargs={"retries": {"total_max_attempts": 1}, "connect_timeout": 1}',
               "--retry-budget", "0.3"]
    for command in ("gc", "compact"):
        rc, err = _cli(command, "s3://bucket/run", *options)
        assert rc == 1 and "endpoint is reachable" in err and "--retry-budget sets" in err, err


def test_background_compaction_replays_on_the_parameters_device_by_default(tmp_path: Path) -> None:
    """``compact_device=None`` (the default) is the device the parameters are on when the session
    starts (a CUDA run compacts on CUDA, where replay matches training's fingerprints); a device
    given is kept. A module on the ``meta`` device stands in for an accelerator here."""
    from engine_runs import make

    from diffckpt import CheckpointOptions

    def device(root: str, module: torch.nn.Module, **options: Any) -> str:
        engine = CheckpointEngine(str(tmp_path / root), CheckpointOptions(compact_every_n_steps=4, **options))
        engine.start(module, [torch.optim.SGD(module.parameters(), lr=0.1)], 0)
        try:
            assert engine.recorder.maintenance is not None
            return engine.recorder.maintenance.device
        finally:
            engine.close()

    assert CheckpointOptions().compact_device is None
    assert device("cpu", make()[0]) == "cpu"
    meta = torch.nn.Linear(4, 4, device="meta")
    assert device("meta", meta) == "meta"
    assert device("given", meta, compact_device="cpu") == "cpu"
