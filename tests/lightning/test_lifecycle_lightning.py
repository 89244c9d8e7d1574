"""Real Lightning runs whose training process never writes a full base after the first: bases come
from compaction (in a background thread of the trainer, or from another process while training
runs), retention keeps storage bounded, and a kill -9 and resume stays bitwise exact."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_bitwise_equal, run_script, subprocess_env
from test_exactness import SCRIPT

import diffckpt
from diffckpt.planning import plan
from diffckpt.runstore import RunStore

STEPS = 60


@pytest.fixture(scope="module")
def reference60(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """The uninterrupted run without diffckpt, and its state at every step."""
    work = tmp_path_factory.mktemp("ref60")
    (work / "steps").mkdir()
    rc, log = run_script(SCRIPT, ["adamw", str(work / "ref.pt"), "--no-lib", "--steps", str(STEPS),
                                  "--dump-steps", str(work / "steps")])
    assert rc == 0, log[-3000:]
    return torch.load(work / "ref.pt", weights_only=False), work / "steps"


def _bases(run: str) -> list[tuple[int, int, dict[str, Any], Any]]:
    store = RunStore(diffckpt.open_storage(run))
    return [(b.gen, b.step, *store.load_base(b)) for b in store.inventory().bases]


def _assert_equals_trained(tree: Any, steps: Path, step: int) -> None:
    trained = torch.load(steps / f"step{step}.pt", weights_only=False)
    assert_bitwise_equal(trained["model"], tree["model"])
    assert_bitwise_equal(trained["optimizers"], tree["optimizers"])


def test_background_compaction_and_retention_kill9_resume(tmp_path: Path, reference60) -> None:
    reference, steps = reference60
    run = str(tmp_path / "run")
    options = json.dumps({"base_every_n_steps": None, "compact_every_n_steps": 10,
                          "retention": {"keep_last_bases": 2}})
    common = ["--dirpath", run, "--steps", str(STEPS), "--options", options]
    rc, log = run_script(SCRIPT, ["adamw", str(tmp_path / "killed.pt"), *common, "--step-sleep", "0.03"],
                         kill_at_step=45)
    assert rc == -9, log[-3000:]
    bases = _bases(run)
    compacted = [(gen, step, tree) for gen, step, info, tree in bases if info.get("compacted")]
    assert compacted, log[-3000:]
    assert len(bases) <= 3, [(g, s) for g, s, _, _ in bases]  # retention: the last 2 (+1 in flight)
    # The training process wrote only the starting base; every other base is compacted and holds
    # exactly the state training had at its step.
    assert all(info.get("compacted") for _, step, info, _ in bases if step > 0)
    for _, step, tree in compacted:
        _assert_equals_trained(tree, steps, step)
    rc, log = run_script(SCRIPT, ["adamw", str(tmp_path / "resumed.pt"), *common, "--resume"])
    assert rc == 0, log[-3000:]
    assert_bitwise_equal(reference, torch.load(tmp_path / "resumed.pt", weights_only=False))


@pytest.mark.slow  # make soak: tests/core/test_compaction.py compacts from another process beside training
def test_compaction_from_another_process_while_training(tmp_path: Path, reference60) -> None:
    reference, steps = reference60
    run = str(tmp_path / "run")
    result: dict[str, Any] = {}

    def train() -> None:
        # 0.25 s a step: training outlasts two compactions from a new process (each imports torch);
        # at 0.05 s, a run that no longer waits for its writer finished before the second
        result["rc"], result["log"] = run_script(SCRIPT, [
            "adamw", str(tmp_path / "final.pt"), "--dirpath", run, "--steps", str(STEPS),
            "--options", json.dumps({"base_every_n_steps": None}), "--step-sleep", "0.25"])

    trainer = threading.Thread(target=train)
    trainer.start()
    reports = []
    deadline = time.monotonic() + 240
    while trainer.is_alive() and len(reports) < 2 and time.monotonic() < deadline:
        time.sleep(1.0)
        try:
            store = RunStore(diffckpt.open_storage(run))
            newest = plan(store, None).target
        except (diffckpt.CheckpointNotFoundError, FileNotFoundError):
            continue
        if newest < 8 or any(r["step"] == newest for r in reports):
            continue
        out = subprocess.run([sys.executable, "-m", "diffckpt", "compact", run, "--json"], capture_output=True,
                             text=True, env=subprocess_env(), timeout=120)
        assert out.returncode == 0, out.stderr
        reports.append(json.loads(out.stdout))
    trainer.join(300)
    assert result["rc"] == 0, result["log"][-3000:]
    assert len(reports) == 2 and all(r["written"] for r in reports), reports
    # The run the training process finished is the uninterrupted one: compaction beside it
    # changed nothing it did.
    assert_bitwise_equal(reference, torch.load(tmp_path / "final.pt", weights_only=False))
    for _, step, info, tree in _bases(run):
        if info.get("compacted"):
            assert info["compacted"]["by"] == "diffckpt compact"
            _assert_equals_trained(tree, steps, step)
    state = diffckpt.load_state(run)
    assert state["step"] == STEPS
    assert state["base_step"] == max(r["step"] for r in reports)  # restores start from the compacted base


def test_lifecycle_example_exports_the_trained_model() -> None:
    """examples/lifecycle.py: compaction-only bases, ls/gc/compact, exports equal to the model."""
    rc, log = run_script("examples/lifecycle.py", ["--steps", "48", "--compact-every", "16"])
    assert rc == 0, log[-3000:]
    assert "compacted step 48 of g1" in log or "already has a base" in log, log[-3000:]
    assert "equal the trained model (53 tensors, torch.equal): yes" in log, log[-3000:]


def test_best_model_path_of_an_earlier_session_survives_a_resumed_sessions_retention(tmp_path: Path) -> None:
    """ModelCheckpoint's best save names a step of session 1; session 2 (a new Trainer resuming
    the run) keeps only the newest base by its policy and writes many more, yet
    ``ckpt_path="best"`` still loads that step bit for bit. Once Lightning removes the save
    (``remove_checkpoint``), retention may reclaim the step."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from test_coexistence import _Lit, _weights

    from diffckpt import CheckpointOptions, RetentionPolicy
    from lightning_ckpt import DiffCheckpoint, DiffCheckpointIO

    run = str(tmp_path / "run")
    options = CheckpointOptions(write_batch=4, base_every_n_steps=4, retention=RetentionPolicy(keep_last_bases=1))

    def fit(epochs: int, ckpt_path: str | None) -> tuple[Any, ModelCheckpoint]:
        # mode="max": the loss falls, so the best save stays the first epoch's (step 8).
        mc = ModelCheckpoint(dirpath=tmp_path / "mc", monitor="val_loss", mode="max", save_top_k=1)
        trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_progress_bar=False,
                            enable_model_summary=False, deterministic=True, plugins=[DiffCheckpointIO()],
                            callbacks=[DiffCheckpoint(run, options=options), mc])
        trainer.fit(_Lit(), ckpt_path=ckpt_path)
        return trainer, mc

    L.seed_everything(0)
    trainer, mc = fit(2, None)
    best = mc.best_model_path
    assert best.endswith("step=8.ckpt")
    with pytest.warns(UserWarning, match="multiple `ModelCheckpoint`"):
        trainer.validate(ckpt_path="best", verbose=False)
    at_best = _weights(trainer.lightning_module)
    trainer, mc = fit(6, run)  # resumed at step 16: 8 more bases, only the newest kept by the policy
    assert mc.best_model_path == best
    bases = [(gen, step) for gen, step, *_ in _bases(run)]
    assert bases[0] == (1, 8) and len(bases) == 2 and bases[1][1] == 48, bases
    with pytest.warns(UserWarning, match="multiple `ModelCheckpoint`"):
        trainer.validate(ckpt_path="best", verbose=False)
    assert_bitwise_equal(at_best, _weights(trainer.lightning_module))
    # Lightning removes the save (top-k rotation does so through the checkpoint IO): the step goes.
    trainer.strategy.remove_checkpoint(best)
    assert not Path(best).exists() and not list((tmp_path / "run" / "kept").glob("*.json"))
    diffckpt.collect_garbage(run, dry_run=False)
    assert [step for _, step, *_ in _bases(run)] == [48]
