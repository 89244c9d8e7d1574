"""``StepDriver``: the step life cycle adapters share (begin at the first boundary, commit, stop
with every rank on SIGTERM, close), without a framework."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from engine_runs import LoopState, make

from diffckpt import CheckpointEngine, load_state
from diffckpt.driver import StepDriver, step_metrics


def _step(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    module(torch.randn(4, 8)).pow(2).mean().backward()
    for o in optimizers:
        o.step()
        o.zero_grad()


def test_boundaries_begin_commit_and_a_sigterm_stop_runs_on_close(tmp_path):
    module, optimizers = make()
    engine = CheckpointEngine(str(tmp_path / "run"))
    sched = torch.optim.lr_scheduler.StepLR(optimizers[0], 1)
    closed: list[int] = []
    driver = StepDriver(engine, engine.options, on_close=lambda: closed.append(engine.recorded_step))
    driver.arm()
    began: list[int] = []

    def begin() -> bool:
        if not began:  # the first boundary waits (as the Trainer's epoch event may)
            began.append(0)
            return False
        engine.begin(module, optimizers, 0, LoopState(sched))
        return True

    assert driver.boundary(0, begin, lambda: LoopState(sched)) is None and not driver.started
    assert driver.boundary(0, begin, lambda: LoopState(sched)) is None and driver.started
    for step in (1, 2):
        _step(module, optimizers)
        done = driver.boundary(step, begin, lambda: LoopState(sched))
        assert done is not None and done.step == step and done.restorable
        metrics = step_metrics(engine, done, step, 2)  # the engine's metrics every 2 steps only
        assert ("diffckpt/queue_fill" in metrics) == (step == 2)
    _step(module, optimizers)
    os.kill(os.getpid(), signal.SIGTERM)  # caught by the driver's handler: acted on at the boundary
    with pytest.raises(SystemExit) as stopped:
        driver.boundary(3, begin, lambda: LoopState(sched))
    assert stopped.value.code == 128 + signal.SIGTERM
    # The stop closed the session: step 3 made restorable and durable, and the adapter's hooks
    # undone (on_close) after it was recorded.
    assert driver.closed and closed == [3] and driver.durable_step == 3
    assert signal.getsignal(signal.SIGTERM) is not driver._sigterm._on_signal  # handed back
    assert load_state(str(tmp_path / "run"))["step"] == 3
    assert driver.boundary(4, begin, lambda: LoopState(sched)) is None  # closed: nothing more
    assert driver.close(4, lambda: LoopState(sched)) == 3 and closed == [3]
