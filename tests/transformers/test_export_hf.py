"""``diffckpt export --format hf-trainer``: a step of a recorded Trainer run as a ``checkpoint-N``
folder that a stock ``Trainer`` (diffckpt not imported) resumes from, bitwise as the uninterrupted
run goes on; and the same files the Trainer's own save at that step writes.

Two real runs of ``trainer_script.py`` are shared by the module (2 epochs of 6 steps): one recorded
by ``DiffCheckpointCallback``, and the stock reference, which also saves its own ``checkpoint-N``
every 2 steps (saving draws no randomness, so its final state is the uninterrupted run's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
from engine_runs import train
from helpers import ROOT, assert_bitwise_equal, run_script, subprocess_env
from transformers.trainer_pt_utils import safe_globals

from diffckpt import UnsupportedConfigurationError, export_checkpoint
from diffckpt.cli import main

SCRIPT = "tests/transformers/trainer_script.py"
# Epoch 2 is steps 7..12: the resume skips 1 batch and restores the RNG after it. The recorded
# run has bases at 0, 5 and 10: both steps are replayed (3 and 1 steps).
MID_EPOCH = 8
EPOCH_END = 6
Runs = dict[str, Path]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """The recorded run's root and the reference's final state and output_dir; read-only."""
    tmp = tmp_path_factory.mktemp("hf")
    recorded = ["--dirpath", str(tmp / "run"), "--output-dir", str(tmp / "out-rec"), "--base-every", "5"]
    reference = ["--output-dir", str(tmp / "out-ref"), "--save-steps", "2"]
    with ThreadPoolExecutor(2) as pool:  # two ~5 s subprocesses at once
        done = list(pool.map(lambda a: run_script(SCRIPT, [str(tmp / f"{a[1]}.pt"), "--epochs", "2", *a[0]]),
                             [(recorded, "rec"), (reference, "ref")]))
    for rc, out in done:
        assert rc == 0, out
    return {"tmp": tmp, "run": tmp / "run", "ref": tmp / "ref.pt", "own": tmp / "out-ref"}


def load_folder(path: Path) -> dict[str, Any]:
    """Every file of a checkpoint folder, loaded as the Trainer loads it."""
    with safe_globals():  # the Trainer's allowlist for numpy in rng_state*.pth
        rng = torch.load(path / "rng_state.pth", weights_only=True)
    return {"model": safetensors.torch.load_file(str(path / "model.safetensors")),
            "optimizer": torch.load(path / "optimizer.pt", weights_only=True),
            "scheduler": torch.load(path / "scheduler.pt", weights_only=True), "rng": rng,
            "trainer_state": json.loads((path / "trainer_state.json").read_text())}


def test_stock_trainer_resumes_export_bitwise(runs: Runs, tmp_path: Path) -> None:
    out = tmp_path / "exported" / f"checkpoint-{MID_EPOCH}"
    done = export_checkpoint(runs["run"], out, MID_EPOCH, format="hf-trainer")
    files = ["model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt", "trainer_state.json"]
    assert done["format"] == "hf-trainer" and done["step"] == MID_EPOCH and done["path"] == str(out)
    assert (done["base_step"], done["replayed"]) == (5, 3)
    assert done["files"] == files  # no scaler.pt: the run has no GradScaler
    assert sorted(os.listdir(out)) == files and os.listdir(out.parent) == [out.name]  # no temp left
    assert done["bytes"] == sum((out / f).stat().st_size for f in files)

    rc, log = run_script(SCRIPT, [str(tmp_path / "resumed.pt"), "--epochs", "2", "--resume", str(out),
                                  "--output-dir", str(tmp_path / "out")])
    assert rc == 0, log
    assert f"RESUMED {MID_EPOCH}" in log
    resumed, ref = torch.load(tmp_path / "resumed.pt", weights_only=False), torch.load(runs["ref"], weights_only=False)
    # The log differs as after the Trainer's own resume: the first loss window restarts at the step.
    for key in ("model", "optimizer", "scheduler", "global_step", "torch_rng", "numpy_rng", "python_rng"):
        assert_bitwise_equal(ref[key], resumed[key], key)


@pytest.mark.parametrize("step", [EPOCH_END, MID_EPOCH])
def test_export_is_the_trainers_own_checkpoint(runs: Runs, tmp_path: Path, step: int) -> None:
    """Each file holds what the Trainer's own save at that step holds (its RNG included: the
    callback takes it where the Trainer's resume restores it, at an epoch's end and mid-epoch)."""
    ours = tmp_path / f"checkpoint-{step}"
    export_checkpoint(runs["run"], ours, step, format="hf-trainer")
    mine, own = load_folder(ours), load_folder(runs["own"] / f"checkpoint-{step}")
    rng = mine["rng"]
    assert type(rng["python"]) is tuple and type(rng["python"][1]) is tuple and type(rng["numpy"]) is tuple
    # The Trainer omits the tied lm_head.weight; ours holds a copy of the embedding (safetensors
    # refuses shared storage), which the Trainer's strict=False load writes into the same weight.
    assert set(own["model"]) == set(mine["model"]) - {"lm_head.weight"}
    assert_bitwise_equal(mine["model"]["transformer.wte.weight"], mine["model"].pop("lm_head.weight"))
    with safetensors.safe_open(str(ours / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    # Only the reference's own settings and the flag its save raised differ.
    for state in (mine["trainer_state"], own["trainer_state"]):
        state.pop("save_steps")
        state["stateful_callbacks"]["TrainerControl"]["args"].pop("should_save")
    assert mine["trainer_state"]["global_step"] == step
    assert_bitwise_equal(own, mine)


def test_cli_writes_the_same_folder(runs: Runs, tmp_path: Path) -> None:
    api, cli = tmp_path / "api" / "checkpoint-8", tmp_path / "cli" / "checkpoint-8"
    export_checkpoint(runs["run"], api, MID_EPOCH, format="hf-trainer")
    proc = subprocess.run([sys.executable, "-m", "diffckpt", "export", str(runs["run"]), "--step", str(MID_EPOCH),
                           "-o", str(cli), "--format", "hf-trainer"], capture_output=True, text=True,
                          env=subprocess_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {cli}: step {MID_EPOCH} (hf-trainer, 5 files, ")
    assert sorted(os.listdir(cli)) == sorted(os.listdir(api))
    for name in os.listdir(api):  # one replay's bytes: torch.save and safetensors are deterministic
        assert (cli / name).read_bytes() == (api / name).read_bytes(), name


def test_cli_json(runs: Runs, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "checkpoint-8"
    out.mkdir()  # an empty folder is taken
    rc = main(["export", str(runs["run"]), "--step", "8", "-o", f"{out}/", "--format", "hf-trainer", "--json"])
    done = json.loads(capsys.readouterr().out)
    assert rc == 0 and done["path"] == str(out) and done["format"] == "hf-trainer"
    assert done["files"] == sorted(os.listdir(out)) and "rng_state.pth" in done["files"]


def test_ls_says_how_a_trainer_run_resumes(runs: Runs, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", str(runs["run"])]) == 0
    out = capsys.readouterr().out
    assert "newest durable step 12 (g1): trainer.train(resume_from_checkpoint=True)" in out
    assert out.rstrip().endswith("resume any durable step N with "
                                 "trainer.train(resume_from_checkpoint=callback.checkpoint(N))")


# ------------------------------------------------------------------------------ refusals
def test_run_not_recorded_by_transformers_ckpt(tmp_path: Path) -> None:
    train(tmp_path / "run", steps=4)  # the core engine, as a plain loop records
    out = tmp_path / "exp" / "checkpoint-4"
    with pytest.raises(UnsupportedConfigurationError, match="not recorded by transformers_ckpt.*--format torch"):
        export_checkpoint(tmp_path / "run", out, 4, format="hf-trainer")
    assert not (tmp_path / "exp").exists()  # refused after the replay, before any folder is made


@pytest.mark.parametrize("target", ["memory://exp/checkpoint-8", "s3://bucket/checkpoint-8", "existing", "file"])
def test_output_refused_before_replay(tmp_path: Path, target: str) -> None:
    """Usage errors come before the replay: the run root here does not even exist."""
    if target == "existing":
        (tmp_path / "existing").mkdir()
        (tmp_path / "existing" / "keep.txt").write_text("x")
    elif target == "file":
        (tmp_path / "file").write_text("x")
    output = target if "://" in target else str(tmp_path / target)
    with pytest.raises(UnsupportedConfigurationError, match="local folder" if "://" in target else "already exists"):
        export_checkpoint(tmp_path / "no-run", output, 8, format="hf-trainer")
    if target == "existing":
        assert os.listdir(tmp_path / "existing") == ["keep.txt"]


def test_cli_refuses_existing_folder(runs: Runs, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "checkpoint-8").mkdir()
    (tmp_path / "checkpoint-8" / "trainer_state.json").write_text("{}")
    rc = main(["export", str(runs["run"]), "--step", "8", "-o", str(tmp_path / "checkpoint-8"),
               "--format", "hf-trainer"])
    assert rc == 2 and "already exists" in capsys.readouterr().err
