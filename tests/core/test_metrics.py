"""The metrics a user watches (``diffckpt/*``), from one place, and the warning when a fresh
session starts on a run root that holds another run's durable steps."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_runs import OPTIONS, FaultyStorage, LoopState, make, optimizer_step

from diffckpt import CheckpointEngine, CheckpointOptions

KEYS = {"diffckpt/durable_step", "diffckpt/durability_lag_steps", "diffckpt/bytes_per_step",
        "diffckpt/bytes_written", "diffckpt/writer_stall_s", "diffckpt/queue_fill"}


def _run(root: Any, steps: int, start: int = 0, resume: bool = False, hint: str | None = None,
         **options: Any) -> tuple[CheckpointEngine, list[dict[str, float]]]:
    """Train ``start+1..steps`` through the every-process engine calls; keep the metrics after
    each commit. The engine is left open (the caller ends it)."""
    module, optimizers = make()
    engine = CheckpointEngine(root, CheckpointOptions(**{**OPTIONS, **options}))
    sched = torch.optim.lr_scheduler.StepLR(optimizers[0], 3)
    if resume:
        result = engine.resume(module, optimizers, "last")
        assert result is not None
        start = result.step
    assert engine.metrics() == {}  # no session yet
    engine.begin(module, optimizers, start, LoopState(sched), resume_hint=hint)
    seen = []
    for step in range(start + 1, steps + 1):
        optimizer_step(module, optimizers, step)
        sched.step()
        engine.commit(step, LoopState(sched))
        seen.append(engine.metrics())
    return engine, seen


def test_metrics_follow_the_writer(tmp_path: Path) -> None:
    # Slow storage, a small queue and every step durable: training waits for the writer, durability lags.
    storage = FaultyStorage(str(tmp_path / "run"), latency=0.03)
    engine, seen = _run(storage, 12, write_batch=1, max_pending_bytes=4096, durability="every_step")
    assert all(KEYS - {"diffckpt/durable_step", "diffckpt/durability_lag_steps"} <= set(m) for m in seen)
    for step, m in enumerate(seen, 1):
        if "diffckpt/durable_step" in m:
            assert m["diffckpt/durable_step"] <= step
            assert m["diffckpt/durability_lag_steps"] == step - m["diffckpt/durable_step"]
    assert max(m.get("diffckpt/durability_lag_steps", 0) for m in seen) > 0
    assert max(m["diffckpt/queue_fill"] for m in seen) > 0
    assert seen[-1]["diffckpt/writer_stall_s"] > 0  # the queue was full: training waited
    assert engine.flush() == 12
    final = engine.metrics()
    stats = engine.recorder.writer.stats  # type: ignore[union-attr]
    assert final["diffckpt/durable_step"] == 12 and final["diffckpt/durability_lag_steps"] == 0
    assert final["diffckpt/queue_fill"] == 0
    assert final["diffckpt/bytes_per_step"] == stats.segment_bytes / stats.records > 0
    assert stats.records == 12
    assert final["diffckpt/bytes_written"] == stats.segment_bytes + stats.base_bytes
    assert final["diffckpt/writer_stall_s"] == stats.stall_seconds
    engine.end()
    assert engine.metrics() == {}  # the session is over


def _warned(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "already holds a run" in str(w.message)]


def test_a_fresh_start_on_a_used_root_warns_naming_its_sessions(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        engine, _ = _run(root, 7)
        engine.end()
    assert _warned(record) == []  # an empty root
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        engine, _ = _run(root, 9, resume=True)  # resumed step 7: continuing, not a fresh start
        engine.end()
    assert _warned(record) == []
    with pytest.warns(UserWarning, match="already holds a run") as record:
        engine, _ = _run(root, 2, hint="call restore() first")
        engine.end()
    (text,) = _warned(list(record))
    assert "g1 (newest durable step 7), g2 (newest durable step 9)" in text
    assert "new session at step 0" in text and "call restore() first" in text


def test_the_local_tier_lags_at_most_one_step_while_the_run_root_lags_a_segment(tmp_path: Path) -> None:
    # write_batch 8 on slow storage: the run root lags by up to a segment and more, the
    # node-local tier by at most the step just handed over (the training thread waits for that)
    storage = FaultyStorage(str(tmp_path / "run"), latency=0.03)
    engine, seen = _run(storage, 20, write_batch=8, local_dir=str(tmp_path / "local"))
    assert all({"diffckpt/local_step", "diffckpt/local_lag_steps"} <= set(m) for m in seen[1:])
    assert max(m["diffckpt/local_lag_steps"] for m in seen[1:]) <= 1
    assert max(m.get("diffckpt/durability_lag_steps", 0) for m in seen) > 1
    engine.end("done")
    _, plain = _run(tmp_path / "plain", 3, local_dir=None)  # without a journal: no local-tier keys
    assert not any("diffckpt/local_step" in m for m in plain)
