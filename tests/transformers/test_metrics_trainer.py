"""transformers ``Trainer``: the core's ``diffckpt/*`` metrics join the training logs every
``logging_steps`` as the reporting integrations receive them (not ``log_history``, which stays
what a run without diffckpt has), and a fresh ``train()`` on a run root holding another run warns
how to resume instead."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
from test_trainer_setup import trainer
from transformers import TrainerCallback


class _Reporter(TrainerCallback):
    """Stands where the reporting integrations (``report_to``) stand: after the Trainer's default
    callbacks, before the user's (the diffckpt callback among them)."""

    def __init__(self) -> None:
        self.logs: list[dict[str, Any]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.logs.append({**(logs or {}), "step": state.global_step})


def test_metrics_join_the_training_logs(tmp_path: Path) -> None:
    root = tmp_path / "run"
    t, _ = trainer(tmp_path, str(root), max_steps=8, logging_steps=2)
    reporter = _Reporter()
    ours = next(i for i, c in enumerate(t.callback_handler.callbacks) if type(c).__name__ == "DiffCheckpointCallback")
    t.callback_handler.callbacks.insert(ours, reporter)
    t.train()
    logged = [e for e in reporter.logs if "diffckpt/bytes_per_step" in e]
    assert [e["step"] for e in logged] == [2, 4, 6, 8]
    assert all("loss" in e for e in logged)  # in the training log itself, at its frequency
    on_disk = sum(p.stat().st_size for p in (root / "diffs").iterdir())
    on_disk += sum((b / "state.safetensors").stat().st_size for b in (root / "bases").iterdir())
    for e in logged:
        # Step N is committed at the next loop event: the log of step N sees N-1 recorded. The
        # durable step is absent only until the writer made the starting base durable.
        if "diffckpt/durable_step" in e or "diffckpt/durability_lag_steps" in e:
            assert 0 <= e["diffckpt/durable_step"] <= e["step"] - 1
            assert e["diffckpt/durability_lag_steps"] == e["step"] - 1 - e["diffckpt/durable_step"]
        assert 0 <= e["diffckpt/queue_fill"] <= 1 and e["diffckpt/writer_stall_s"] >= 0
        assert 0 <= e["diffckpt/bytes_written"] <= on_disk and e["diffckpt/bytes_per_step"] >= 0
    written = [e["diffckpt/bytes_written"] for e in logged]
    assert written == sorted(written)  # a running total
    # Not in the evaluation or summary logs, and never in log_history (trainer_state.json stays
    # what a run without diffckpt writes).
    assert not any("diffckpt/bytes_per_step" in e for e in reporter.logs if "loss" not in e)
    assert [e["step"] for e in t.state.log_history if "loss" in e] == [2, 4, 6, 8]
    assert not any(k.startswith("diffckpt/") for e in t.state.log_history for k in e)


def _used_root_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "already holds a run" in str(w.message)]


def test_a_fresh_train_on_a_used_root_warns_and_a_resume_does_not(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer(tmp_path, root, max_steps=3)[0].train()
        trainer(tmp_path, root, max_steps=5)[0].train(resume_from_checkpoint=True)
    assert _used_root_warnings(record) == []
    with pytest.warns(UserWarning, match="already holds a run") as record:
        trainer(tmp_path, root, max_steps=2)[0].train()
    (text,) = _used_root_warnings(list(record))
    assert "g1 (newest durable step 3), g2 (newest durable step 5)" in text
    assert "resume_from_checkpoint=True" in text
