"""DiffCheckpoint next to the user's own ModelCheckpoint: ckpt_path="best"/"last" in either callback
order, ModelCheckpoint's reference files under load_from_checkpoint, and ModelCheckpoint keywords."""

from __future__ import annotations

import os
import re
import shlex

import lightning as L
import pytest
import torch
from helpers import assert_bitwise_equal
from lightning.pytorch.callbacks import ModelCheckpoint

from diffckpt.cli import main as cli
from lightning_ckpt import DiffCheckpoint, DiffCheckpointIO


class _Lit(L.LightningModule):
    def __init__(self, width: int = 4):
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(width, 1)

    def _data(self, seed: int) -> torch.utils.data.DataLoader:
        inputs = torch.randn(32, self.hparams.width, generator=torch.Generator().manual_seed(seed))
        return torch.utils.data.DataLoader(inputs, batch_size=4)

    def train_dataloader(self):
        return self._data(0)

    def val_dataloader(self):
        return self._data(1)

    def training_step(self, batch, batch_idx):
        return (self.layer(batch) - 1).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", (self.layer(batch) - 1).pow(2).mean())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _fit(tmp_path, order: str) -> dict:
    """Fit 3 epochs (8 steps each) next to a ModelCheckpoint keeping the *worst* epoch by val_loss
    (mode="max": the loss falls, so "best" is an early step and differs from "last"); then
    validate with ckpt_path="best" (and "last" with diffckpt) and return what was loaded. ``order``: "plain" is
    the run without diffckpt."""
    L.seed_everything(0)
    mc = ModelCheckpoint(dirpath=tmp_path / f"mc-{order}", monitor="val_loss", mode="max", save_top_k=1,
                         save_last=True)
    callbacks: list = [mc]
    plugins: list = []
    if order != "plain":
        diff = DiffCheckpoint(str(tmp_path / f"run-{order}"), write_batch=4)
        callbacks = [diff, mc] if order == "diff-first" else [mc, diff]
        plugins = [DiffCheckpointIO()]
    trainer = L.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True, callbacks=callbacks, plugins=plugins)
    model = _Lit()
    trainer.fit(model)
    out = {"mc": mc, "trainer": trainer, "final": _weights(model),
           "checkpoint_callback_is_mc": trainer.checkpoint_callback is mc,
           "best": os.path.basename(trainer.checkpoint_callback.best_model_path),
           "best_score": trainer.checkpoint_callback.best_model_score}
    with pytest.warns(UserWarning, match="multiple `ModelCheckpoint`") if order != "plain" else _nothing():
        trainer.validate(ckpt_path="best", verbose=False)
    out["loaded_best"] = _weights(trainer.lightning_module)
    if order != "plain":
        trainer.validate(ckpt_path="last", verbose=False)
        out["loaded_last"] = _weights(trainer.lightning_module)
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _fit(tmp_path_factory.mktemp("plain"), "plain")


@pytest.mark.parametrize("order", ["diff-first", "mc-first"])
def test_best_and_last_resolve_through_the_users_model_checkpoint_in_either_order(order, tmp_path, plain):
    got = _fit(tmp_path, order)
    assert got["checkpoint_callback_is_mc"]
    assert got["best"] == plain["best"] and got["best"] != "last.ckpt"
    assert torch.equal(got["best_score"], plain["best_score"])
    assert_bitwise_equal(plain["final"], got["final"])  # training itself is untouched
    assert_bitwise_equal(plain["loaded_best"], got["loaded_best"])
    # "last" is the run's newest durable step, here the end of training (plain Lightning's
    # last.ckpt is only a copy of the newest top-k save, step 8 here).
    assert_bitwise_equal(plain["final"], got["loaded_last"])
    # "best" is an early step, not the end: the comparison above is not the final weights again.
    assert not all(torch.equal(plain["loaded_best"][k], plain["final"][k]) for k in plain["final"])


def test_reference_under_load_from_checkpoint_names_the_export_command_that_fixes_it(tmp_path, plain, monkeypatch):
    got = _fit(tmp_path, "diff-first")
    ref = got["mc"].best_model_path
    with pytest.raises(RuntimeError, match="diffckpt reference") as err:
        _Lit.load_from_checkpoint(ref)
    message = str(err.value)
    assert "weights_only" not in message
    command = re.search(r"`(diffckpt export [^`]+)`", message)
    assert command, message
    argv = shlex.split(command[1])[1:]
    assert argv[argv.index("--step") + 1] == "8" and argv[argv.index("-o") + 1] == "exported-epoch=0-step=8.ckpt"
    monkeypatch.chdir(tmp_path)
    assert cli(argv) == 0
    loaded = _Lit.load_from_checkpoint(argv[argv.index("-o") + 1])
    assert_bitwise_equal(plain["loaded_best"], _weights(loaded))
    # Plain torch.load refuses it the same way, without unpickling anything but the preamble.
    with pytest.raises(RuntimeError, match="diffckpt reference"):
        torch.load(ref, weights_only=True)


@pytest.mark.parametrize(("keyword", "hint"), [
    ("every_n_train_steps", "every_n_steps"),
    ("monitor", "ModelCheckpoint"),
    ("save_top_k", "ModelCheckpoint"),
    ("every_n_epochs", "ModelCheckpoint"),
    ("filename", "ModelCheckpoint"),
])
def test_model_checkpoint_keywords_name_the_diffcheckpoint_spelling(tmp_path, keyword, hint):
    with pytest.raises(TypeError, match=rf"DiffCheckpoint\(\) got ModelCheckpoint's keyword '{keyword}'") as err:
        DiffCheckpoint(str(tmp_path / "run"), **{keyword: 10})
    assert hint in str(err.value) and "CheckpointOptions" not in str(err.value)


def test_unknown_keywords_still_name_the_options_class(tmp_path):
    with pytest.raises(TypeError, match="CheckpointOptions"):
        DiffCheckpoint(str(tmp_path / "run"), no_such_option=1)


def test_references_of_version_1_are_still_read_and_a_preamble_never_imports(tmp_path):
    import json
    import pickle

    from lightning_ckpt.references import _PREAMBLE, read_reference, resolve_target

    old = tmp_path / "epoch=0-step=8.ckpt"
    old.write_text(json.dumps({"format": "diffckpt-ref", "version": 1, "run": "runs/exp1", "step": 8}))
    assert resolve_target(str(old)) == ("runs/exp1", 8)
    body = json.dumps({"format": "diffckpt-ref", "version": 2, "run": "runs/exp1", "step": 8}).encode()
    hostile = tmp_path / "hostile.ckpt"  # the right magic, then a pickle that would import os.system
    hostile.write_bytes(_PREAMBLE + pickle.dumps(os.system, protocol=2) + body)
    assert read_reference(str(hostile)) is None
