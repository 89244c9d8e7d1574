"""A base's host copies made beside training (``diffckpt/snapshot.py``): the next optimizer step
waits for them, a base holds the state at its step bitwise, and a parameter changed outside the
optimizer before it was copied makes the base fail loudly instead of being written wrong."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_runs import base_dir, make, optimizer_step, untouched
from helpers import assert_bitwise_equal

from diffckpt import CheckpointEngine, CheckpointOptions
from diffckpt.errors import DiffCkptError
from diffckpt.snapshot import snapshot_tree

OPTIONS = CheckpointOptions(write_batch=1, base_every_n_steps=None, durability="every_step")


class HeldCopies:
    """``torch._foreach_copy_`` on the snapshot's thread held until ``go`` is set (the test's
    stand-in for a copy that is slower than training; every other thread copies at once)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.go, self.started = threading.Event(), threading.Event()
        real = torch._foreach_copy_

        def held(dst: list[torch.Tensor], src: list[torch.Tensor]) -> Any:
            if threading.current_thread().name == "diffckpt-snapshot":
                self.started.set()
                assert self.go.wait(60), "the test never let the copy go"
            return real(dst, src)

        monkeypatch.setattr(torch, "_foreach_copy_", held)


def test_only_what_the_optimizer_changes_is_copied_beside_training() -> None:
    m, o = make()
    optimizer_step(m, o, 1)  # the optimizer has state
    tree, copying = snapshot_tree({"model": m.state_dict(), "optimizers": [x.state_dict() for x in o]}, m, o, 1)
    assert copying is not None
    state_tensors = sum(isinstance(t, torch.Tensor) for x in o for s in x.state.values() for t in s.values())
    assert copying.count == len(list(m.parameters())) + state_tensors  # AdamW: exp_avg, exp_avg_sq, step
    copying.result()
    assert_bitwise_equal(untouched(m, o), tree)
    state = m.state_dict()
    for name, p in m.named_parameters():  # copies, not the tensors themselves
        assert tree["model"][name].data_ptr() != p.data_ptr()
    for name in ("1.running_mean", "1.num_batches_tracked"):  # buffers (a forward changes them): cloned at once
        assert tree["model"][name].data_ptr() != state[name].data_ptr()
    _, none = snapshot_tree({"x": torch.ones(2)}, torch.nn.Linear(1, 1), [], 1)
    assert none is None  # nothing of the optimizer's: nothing deferred


def test_the_next_step_waits_for_the_copy_and_the_base_holds_its_step(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    m, o = make()
    engine = CheckpointEngine(str(tmp_path), OPTIONS)
    engine.start(m, o, 0)
    engine.write_base(0, m.state_dict(), [x.state_dict() for x in o], {"x": 0})
    for step in (1, 2):
        optimizer_step(m, o, step)
        engine.record_step(step, {"x": step})
    truth = untouched(m, o)
    held = HeldCopies(monkeypatch)
    engine.write_base(2, m.state_dict(), [x.state_dict() for x in o], {"x": 2})
    assert held.started.wait(30)
    stepped = threading.Event()

    def step_on() -> None:
        optimizer_step(m, o, 3)
        stepped.set()

    thread = threading.Thread(target=step_on, daemon=True)
    thread.start()
    assert not stepped.wait(0.5), "optimizer.step() ran while the base was being copied"
    held.go.set()
    thread.join(30)
    assert stepped.is_set()
    engine.record_step(3, {"x": 3})
    assert engine.close() == 3
    restored_m, restored_o = make()
    assert CheckpointEngine(str(tmp_path)).restore(restored_m, restored_o, 2).base_step == 2
    assert_bitwise_equal(truth, untouched(restored_m, restored_o))


def test_a_parameter_changed_outside_the_optimizer_before_the_copy_fails_the_base(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m, o = make()
    engine = CheckpointEngine(str(tmp_path), OPTIONS)
    engine.start(m, o, 0)
    engine.write_base(0, m.state_dict(), [x.state_dict() for x in o], {"x": 0})
    optimizer_step(m, o, 1)
    engine.record_step(1, {"x": 1})
    held = HeldCopies(monkeypatch)
    engine.write_base(1, m.state_dict(), [x.state_dict() for x in o], {"x": 1})
    assert held.started.wait(30)
    with torch.no_grad():
        next(m.parameters()).add_(1.0)  # not the optimizer's step: in no record, so in no base
    held.go.set()
    with pytest.raises(DiffCkptError, match="changed after the base at step 1 was taken"):
        engine.close()
    assert base_dir(tmp_path, 0).exists() and not base_dir(tmp_path, 1).exists()
