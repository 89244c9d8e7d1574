"""The core engine on intact runs: every durable step restores bitwise, resumes continue exactly,
and misuse of the engine's call order is a clear error."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_runs import OPTIONS, assert_state, make, restore, snapshot, train, train_steps
from helpers import assert_bitwise_equal

from diffckpt import (
    CheckpointEngine,
    CheckpointNotFoundError,
    CheckpointOptions,
    DiffCkptError,
    UnsupportedConfigurationError,
    load_state,
)
from diffckpt.runstore import RunStore
from diffckpt.storage import FsspecStorage


@pytest.mark.parametrize("url", ["local", "memory"])
def test_every_step_restores_bitwise(tmp_path: Path, url: str) -> None:
    root = str(tmp_path / "run") if url == "local" else f"memory://diffckpt-tests/{tmp_path.name}"
    truth, durable = train(root)
    assert durable == 13
    layout = RunStore(FsspecStorage(root)).inventory()
    assert [b.step for b in layout.bases] == [0, 5, 10]
    assert [(s.after, s.last) for s in layout.segments] == [(0, 3), (3, 5), (5, 8), (8, 10), (10, 13)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in [None, *range(14)]:
            result, m, o = restore(root, step)
            assert result.step == (13 if step is None else step)
            assert result.base_step == max(b for b in (0, 5, 10) if b <= result.step)
            assert result.replayed == result.step - result.base_step
            assert_state(truth, result, m, o)
            loaded = load_state(root, step)
            assert loaded["step"] == result.step and loaded["state"] == {"x": result.step}
            assert_bitwise_equal(truth[result.step]["model"], loaded["model"])
            assert_bitwise_equal(truth[result.step]["optimizers"], loaded["optimizers"])


def test_resume_continues_exactly_in_a_new_session(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    truth, _ = train(root)
    # resume from step 7 and train again to 20: a second session of the same run
    result, m, o = restore(root, 7)
    engine = CheckpointEngine(root, CheckpointOptions(**OPTIONS))
    assert engine.start(m, o, 7) == 2
    engine.write_base(7, m.state_dict(), [x.state_dict() for x in o], {"x": 7})
    resumed: dict[int, dict[str, Any]] = {}
    train_steps(engine, m, o, 8, 20, resumed)
    assert engine.close() == 20
    for step in range(8, 14):  # the resumed run continues bitwise like the uninterrupted one
        assert_bitwise_equal(truth[step], resumed[step])
    truth.update(resumed)
    result, m, o = restore(root)
    assert (result.step, result.base_step) == (20, 17)
    assert_state(truth, result, m, o)
    for step in (3, 9, 13, 15):  # the newest session holding a step serves it
        result, m, o = restore(root, step)
        assert_state(truth, result, m, o)


def test_steps_that_are_not_restorable_points(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    truth, durable = train(root, every=2, write_batch=2, base_every_n_steps=None)
    assert durable == 12  # step 13 has no state: it is not a restorable point and is not kept
    for step in (2, 6, 12):
        result, m, o = restore(root, step)
        assert_state(truth, result, m, o)
    with pytest.raises(CheckpointNotFoundError, match="step 5 is not a restorable step.*nearest below: 4"):
        restore(root, 5)
    with pytest.raises(CheckpointNotFoundError, match="step 13 is not durable"):
        restore(root, 13)


def test_flush_and_durable_step(tmp_path: Path) -> None:
    m, o = make()
    engine = CheckpointEngine(str(tmp_path / "run"), CheckpointOptions(**OPTIONS))
    assert engine.durable_step is None and not engine.started
    engine.start(m, o, 0)
    engine.write_base(0, m.state_dict(), [x.state_dict() for x in o], {"x": 0})
    assert engine.flush() == 0
    train_steps(engine, m, o, 1, 4, {})
    assert engine.flush() == 4 == engine.durable_step  # flush commits records short of a batch
    assert engine.close() == 4
    assert engine.durable_step == 4 and not engine.started
    assert engine.close() is None  # closing twice is harmless


def test_call_order_errors(tmp_path: Path) -> None:
    m, o = make()
    engine = CheckpointEngine(str(tmp_path / "run"))
    with pytest.raises(DiffCkptError, match=r"start\(\) must be called before recording steps"):
        engine.record_step(1, {})
    engine.start(m, o, 0)
    with pytest.raises(DiffCkptError, match=r"start\(\) called twice"):
        engine.start(m, o, 0)
    engine.write_base(0, m.state_dict(), [x.state_dict() for x in o], {})
    engine.record_step(1, {})
    with pytest.raises(DiffCkptError, match="step 1 recorded after step 1; steps must increase"):
        engine.record_step(1, {})
    with pytest.raises(DiffCkptError, match="lacks parameters"):
        engine.write_base(1, {}, [x.state_dict() for x in o], {})
    engine.close()


def test_restore_while_training_does_not_record_the_replay(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    m, o = make()
    engine = CheckpointEngine(root, CheckpointOptions(**OPTIONS))
    engine.start(m, o, 0)
    engine.write_base(0, m.state_dict(), [x.state_dict() for x in o], {"x": 0})
    truth = {0: snapshot(m, o, 0)}
    train_steps(engine, m, o, 1, 6, truth)
    engine.flush()
    # replay into the training model and optimizer themselves: their hooks must stay quiet
    result = engine.restore(m, o, 4)
    assert_state(truth, result, m, o)
    assert engine.recorder.capture is not None and engine.recorder.capture.take() == []
    engine.close()


class _Delegating(torch.optim.SGD):
    """A subclass whose step() calls the parent's: torch runs the step hooks in both."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        return super().step(closure)


def test_optimizer_subclass_calling_super_step(tmp_path: Path) -> None:
    def maker() -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        m, _ = make()
        return m, [_Delegating(m.parameters(), lr=1e-2, momentum=0.9)]

    torch.optim.SGD(make()[0].parameters(), lr=0.1)  # any SGD instance patches SGD.step's hooks
    root = str(tmp_path / "run")
    truth, _ = train(root, maker=maker, fingerprint_every_n_steps=None)
    result, m, o = restore(root, 4, maker=maker)
    assert_state(truth, result, m, o)


def test_fused_adamw_replays_bitwise(tmp_path: Path) -> None:
    # The transformers Trainer's default optimizer (adamw_torch_fused): replay runs the same
    # fused kernel on the recorded gradients.
    def maker() -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        m, _ = make()
        return m, [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)]

    root = str(tmp_path / "run")
    truth, _ = train(root, maker=maker)
    for step in (3, 7, 13):
        result, m, o = restore(root, step, maker=maker)
        assert o[0].param_groups[0]["fused"]
        assert_state(truth, result, m, o)


def test_fused_step_driven_by_a_grad_scaler_is_refused_before_it_applies(tmp_path: Path) -> None:
    # GradScaler leaves the gradients scaled for a fused optimizer: what would be recorded is not
    # what the update consumed, so the step is refused in the pre-hook, before it changes anything.
    m, _ = make()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    engine = CheckpointEngine(str(tmp_path / "run"), CheckpointOptions(**OPTIONS))
    engine.start(m, [opt], 0)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(m(torch.randn(4, 8)).pow(2).mean()).backward()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(UnsupportedConfigurationError, match=r"fused=True\) was stepped by a GradScaler"):
        scaler.step(opt)
    assert_bitwise_equal(before, m.state_dict())
    engine.close()


class _Tied(torch.nn.Module):
    """An embedding and an output layer sharing one weight, as language models tie them."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Linear(8, 6, bias=False)
        self.head = torch.nn.Linear(6, 8, bias=False)
        self.head.weight = self.emb.weight  # tied: one parameter, two state-dict keys

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.emb(x) @ self.head.weight


def test_tied_weights_are_rebuilt_without_the_module(tmp_path: Path) -> None:
    # load_state (export, the CLI) has no module to tie them: the session lists the alias, and
    # the second key gets the parameter's replayed value, as a copy (files refuse shared tensors).
    def maker() -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        torch.manual_seed(0)
        m = _Tied()
        return m, [torch.optim.AdamW(m.parameters(), lr=1e-2)]

    root = str(tmp_path / "run")
    truth, _ = train(root, maker=maker)
    for step in (4, 7, 13):
        loaded = load_state(root, step)
        assert torch.equal(loaded["model"]["head.weight"], truth[step]["model"]["emb.weight"])
        assert loaded["model"]["head.weight"].data_ptr() != loaded["model"]["emb.weight"].data_ptr()
        assert_bitwise_equal(truth[step]["model"], loaded["model"])
