"""Accelerate: the core's ``diffckpt/*`` metrics reach the trackers through ``accelerator.log``
every ``log_every_n_steps``, and a fresh start on a run root holding another run warns."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.tracking import GeneralTracker
from torch.utils.data import DataLoader, TensorDataset

from accelerate_ckpt import DiffCheckpointer


class _Captured(GeneralTracker):
    """A real tracker that keeps what ``accelerator.log`` hands it."""

    name = "captured"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int | None, dict[str, Any]]] = []

    @property
    def tracker(self) -> Any:
        return self

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.logged.append((step, dict(values)))


@pytest.fixture(autouse=True)
def _reset_accelerate():
    yield
    AcceleratorState._reset_state(True)


def _train(root: Path, steps: int, tracker: _Captured | None = None, restore: bool = False,
           flush_at: tuple[int, ...] = (), **kwargs: Any) -> DiffCheckpointer:
    acc = Accelerator(cpu=True, log_with=[tracker] if tracker is not None else None)
    if tracker is not None:
        acc.init_trackers("diffckpt-test")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    data = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 2)), batch_size=4, shuffle=True)
    model, opt, data = acc.prepare(model, opt, data)
    with DiffCheckpointer(acc, root, write_batch=2, base_every_n_steps=None, **kwargs) as ckpt:
        start = ckpt.restore() if restore else 0
        loader = ckpt.dataloader(data)
        step = start
        for x, y in loader:
            if step >= steps:
                break
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            step += 1
            if step in flush_at:  # what is committed so far becomes durable: definite metrics next
                ckpt.engine.flush()
    return ckpt


def test_metrics_reach_the_trackers_every_n_steps(tmp_path: Path) -> None:
    tracker = _Captured()
    root = tmp_path / "run"
    # Flushed a step before each logged one: steps up to the one before are durable by then.
    _train(root, 12, tracker, log_every_n_steps=4, flush_at=(3, 7, 11))
    logged = [(step, values) for step, values in tracker.logged if "diffckpt/bytes_per_step" in values]
    assert [step for step, _ in logged] == [4, 8, 12]
    on_disk = sum(p.stat().st_size for p in (root / "diffs").iterdir())
    on_disk += sum((b / "state.safetensors").stat().st_size for b in (root / "bases").iterdir())
    for step, m in logged:
        assert step is not None and step - 2 <= m["diffckpt/durable_step"] <= step
        assert m["diffckpt/durability_lag_steps"] == step - m["diffckpt/durable_step"]
        assert 0 <= m["diffckpt/queue_fill"] <= 1 and m["diffckpt/writer_stall_s"] >= 0
        assert 0 < m["diffckpt/bytes_written"] <= on_disk  # the flush wrote the base and segments
    assert logged[-1][1]["diffckpt/bytes_per_step"] > 0


def test_log_every_n_steps_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="log_every_n_steps must be a positive number of steps, got 0"):
        _train(tmp_path / "run", 1, log_every_n_steps=0)


def _used_root_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "already holds a run" in str(w.message)]


def test_a_fresh_start_on_a_used_root_warns_and_a_restore_does_not(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _train(root, 5)
        _train(root, 7, restore=True)
    assert _used_root_warnings(record) == []
    with pytest.warns(UserWarning, match="already holds a run") as record:
        _train(root, 2)
    (text,) = _used_root_warnings(list(record))
    assert "g1 (newest durable step 5), g2 (newest durable step 7)" in text
    assert "checkpointer.restore()" in text
