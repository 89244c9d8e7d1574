"""Lightning: the core's ``diffckpt/*`` metrics reach the loggers at ``log_every_n_steps``, and a
fresh ``fit`` on a run root that holds another run warns how to resume instead."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from test_integration import _Tiny
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_ckpt import DiffCheckpoint, DiffCheckpointIO


def _fit(root: Path, steps: int, logger: object = False, ckpt_path: str | None = None,
         **trainer_kwargs: object) -> L.Trainer:
    torch.manual_seed(0)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=logger, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=True, plugins=[DiffCheckpointIO()],
                        callbacks=[DiffCheckpoint(str(root), write_batch=2, base_every_n_steps=None)],
                        **trainer_kwargs)  # type: ignore[arg-type]
    inputs = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    trainer.fit(_Tiny(), StatefulDataLoader(inputs, batch_size=4), ckpt_path=ckpt_path)
    return trainer


def test_metrics_reach_a_csv_logger_at_its_frequency(tmp_path: Path) -> None:
    root = tmp_path / "run"
    logger = L.pytorch.loggers.CSVLogger(str(tmp_path / "logs"), name="", version="")
    _fit(root, 12, logger=logger, log_every_n_steps=4)
    with open(tmp_path / "logs" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("diffckpt/bytes_per_step")]
    assert [int(r["step"]) for r in rows] == [4, 8, 12]
    on_disk = sum(p.stat().st_size for p in (root / "diffs").iterdir())
    on_disk += sum((b / "state.safetensors").stat().st_size for b in (root / "bases").iterdir())
    for r in rows:
        step = int(r["step"])
        # Absent (an empty cell, or no column at all when no logged step had one) only until the
        # writer made the starting base durable, which a loaded machine may not do in 12 steps.
        if r.get("diffckpt/durable_step") or r.get("diffckpt/durability_lag_steps"):
            durable = float(r["diffckpt/durable_step"])
            assert 0 <= durable <= step and float(r["diffckpt/durability_lag_steps"]) == step - durable
        assert 0 <= float(r["diffckpt/queue_fill"]) <= 1
        assert float(r["diffckpt/writer_stall_s"]) >= 0
        assert 0 <= float(r["diffckpt/bytes_written"]) <= on_disk
    # Bytes per step are those of the segments written so far: none yet, or a step's worth.
    assert all(float(r["diffckpt/bytes_per_step"]) >= 0 for r in rows)
    written = [float(r["diffckpt/bytes_written"]) for r in rows]
    assert written == sorted(written)  # a running total


def _used_root_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "already holds a run" in str(w.message)]


def test_a_fresh_fit_on_a_used_root_warns_and_a_resume_does_not(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _fit(root, 6)
        _fit(root, 8, ckpt_path="last")
    assert _used_root_warnings(record) == []  # an empty root, then a resume
    with pytest.warns(UserWarning, match="already holds a run") as record:
        _fit(root, 2)
    (text,) = _used_root_warnings(list(record))
    assert "g1 (newest durable step 6), g2 (newest durable step 8)" in text
    assert 'ckpt_path="last"' in text
