"""``diffckpt.export_checkpoint``: each format holds bitwise the true state of the step it names,
loads without diffckpt (``torch.load(weights_only=True)``, ``safetensors``), and goes to a local
file or an fsspec URL; what cannot be exported raises before anything is written."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import fsspec
import pytest
import safetensors.torch
import torch
from engine_runs import Truth, train
from helpers import assert_bitwise_equal

from diffckpt import (
    CheckpointNotFoundError,
    StorageError,
    UnsupportedConfigurationError,
    export_checkpoint,
)

Run = tuple[Path, Truth]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """13 AdamW steps, bases at 0, 5 and 10; read-only for the tests that share it."""
    root = tmp_path_factory.mktemp("export") / "run"
    truth, durable = train(root)
    assert durable == 13
    return root, truth


def two_optimizers() -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return m, [torch.optim.AdamW(m[0].parameters(), lr=1e-2),
               torch.optim.SGD(m[2].parameters(), lr=1e-2, momentum=0.9)]


def test_torch_format(run: Run, tmp_path: Path) -> None:
    root, truth = run
    out = tmp_path / "step7.pt"
    done = export_checkpoint(root, out, 7)
    assert done.pop("replay_s") > 0
    assert done == {"step": 7, "format": "torch", "bytes": out.stat().st_size, "base_step": 5,
                    "replayed": 2, "path": str(out)}
    obj = torch.load(out, weights_only=True)
    assert set(obj) == {"model", "optimizer", "step"} and obj["step"] == 7
    assert_bitwise_equal(truth[7]["model"], obj["model"])
    assert_bitwise_equal(truth[7]["optimizers"][0], obj["optimizer"])  # one optimizer: not a list


def test_torch_format_several_optimizers(tmp_path: Path) -> None:
    truth, _ = train(tmp_path / "run", maker=two_optimizers)
    out = tmp_path / "state.pth"
    export_checkpoint(tmp_path / "run", out, 8)
    obj = torch.load(out, weights_only=True)
    assert isinstance(obj["optimizer"], list) and len(obj["optimizer"]) == 2
    assert_bitwise_equal(truth[8]["model"], obj["model"])
    assert_bitwise_equal(truth[8]["optimizers"], obj["optimizer"])


def test_lightning_format(run: Run, tmp_path: Path) -> None:
    root, truth = run
    out = tmp_path / "step12.ckpt"
    assert export_checkpoint(root, out, 12)["format"] == "lightning"
    ckpt = torch.load(out, weights_only=True)  # what LightningModule.load_from_checkpoint does
    assert ckpt["x"] == 12 and ckpt["global_step"] == 12 and "pytorch-lightning_version" in ckpt
    assert_bitwise_equal(truth[12]["model"], ckpt["state_dict"])
    assert_bitwise_equal(truth[12]["optimizers"], ckpt["optimizer_states"])


def test_safetensors_format_newest_step(run: Run, tmp_path: Path) -> None:
    root, truth = run
    out = tmp_path / "model.safetensors"
    done = export_checkpoint(str(root), str(out))
    assert (done["step"], done["format"], done["base_step"]) == (13, "safetensors", 10)
    assert_bitwise_equal(truth[13]["model"], safetensors.torch.load_file(str(out)))


def test_format_argument_wins_over_the_extension(run: Run, tmp_path: Path) -> None:
    root, truth = run
    out = tmp_path / "weights.bin"
    assert export_checkpoint(root, out, 4, format="safetensors")["format"] == "safetensors"
    assert_bitwise_equal(truth[4]["model"], safetensors.torch.load_file(str(out)))


def test_output_to_an_fsspec_url(run: Run, tmp_path: Path) -> None:
    root, truth = run
    url = f"memory://diffckpt-tests/export-{tmp_path.name}/step3.pt"
    fs = fsspec.filesystem("memory")
    try:
        done = export_checkpoint(root, url, 3)
        with fsspec.open(url, "rb") as fh:
            data: Any = fh.read()
        assert done["path"] == url and done["bytes"] == len(data)
        obj = torch.load(io.BytesIO(data), weights_only=True)
        assert_bitwise_equal(truth[3]["model"], obj["model"])
        assert_bitwise_equal(truth[3]["optimizers"][0], obj["optimizer"])
    finally:
        fs.rm(f"diffckpt-tests/export-{tmp_path.name}", recursive=True)


def test_non_durable_step_raises_and_writes_nothing(run: Run, tmp_path: Path) -> None:
    root, _ = run
    out = tmp_path / "x.pt"
    with pytest.raises(CheckpointNotFoundError, match="step 99 is not durable"):
        export_checkpoint(root, out, 99)
    assert not out.exists()


def test_unwritable_output_is_a_clear_error(run: Run, tmp_path: Path) -> None:
    root, _ = run
    (tmp_path / "a-file").write_text("")
    with pytest.raises(StorageError, match="cannot write .*a-file.*a part of the path is a file"):
        export_checkpoint(root, tmp_path / "a-file" / "out.pt", 3)
    assert list(tmp_path.iterdir()) == [tmp_path / "a-file"]


def test_usage_errors_come_before_replay(tmp_path: Path) -> None:
    no_run = tmp_path / "no-run"  # not even read: the output and format are checked first
    with pytest.raises(UnsupportedConfigurationError, match="names a directory"):
        export_checkpoint(no_run, f"{tmp_path}/", 3)
    with pytest.raises(UnsupportedConfigurationError, match="'zip' is not one of lightning, torch, safetensors"):
        export_checkpoint(no_run, tmp_path / "x.zip", 3, format="zip")
    assert list(tmp_path.iterdir()) == []
