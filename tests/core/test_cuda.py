"""What was designed for CUDA and can only be checked on a CUDA device (``make gpu-check`` runs
these; they skip themselves elsewhere): the writer's host stage, the CUDA generators, replay onto
the device and ``load_state(device="cuda")``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_runs import untouched
from helpers import assert_bitwise_equal

from diffckpt import CheckpointEngine, CheckpointOptions, load_state
from diffckpt.rng import get_rng_state, set_rng_state
from diffckpt.staging import HostStage

pytestmark = pytest.mark.cuda


def test_the_host_stage_copies_after_the_training_streams_event_into_reused_pinned_buffers() -> None:
    stage = HostStage(pinned_bytes=1 << 20)
    grads = [torch.randn(64, 64, device="cuda"), torch.randn(100, device="cuda")]
    record = {"grads": [grads, None], "step": 7}
    event = HostStage.mark(record)
    assert event is not None
    host, buffers = stage.to_host(record, [event])
    assert host["step"] == 7 and host["grads"][1] is None
    for got, want in zip(host["grads"][0], grads):
        assert got.device.type == "cpu" and got.is_pinned()
        assert torch.equal(got, want.cpu())
    stage.release(buffers)
    again, _ = stage.to_host({"grads": [[g * 2 for g in grads]]}, [HostStage.mark(grads)])
    assert [b.data_ptr() for b in again["grads"][0]] == [b.data_ptr() for b in buffers]  # the pool's
    assert torch.equal(again["grads"][0][0], (grads[0] * 2).cpu())


def test_cuda_generators_are_captured_and_restored() -> None:
    torch.cuda.manual_seed_all(3)
    torch.rand(4, device="cuda")
    state = get_rng_state()
    assert "cuda" in state
    expected = torch.rand(8, device="cuda")
    torch.rand(100, device="cuda")
    set_rng_state(state)
    assert torch.equal(torch.rand(8, device="cuda"), expected)


def _model() -> torch.nn.Module:
    """With a batch norm: buffers that change every step, staged through the pinned pool."""
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.GELU(),
                               torch.nn.Linear(32, 4)).cuda()


def test_a_cuda_run_replays_onto_the_device_and_loads_as_cuda_tensors(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    engine = CheckpointEngine(str(tmp_path), CheckpointOptions(write_batch=3, base_every_n_steps=None))
    engine.start(model, [opt], 0)
    engine.write_base(0, model.state_dict(), [opt.state_dict()], {})
    for step in range(1, 8):
        x = torch.randn(8, 16, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        engine.record_step(step, {})
    truth = untouched(model, [opt])
    assert engine.close() == 7
    torch.manual_seed(0)
    fresh = _model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, fused=True)
    assert CheckpointEngine(str(tmp_path)).restore(fresh, [fresh_opt]).step == 7
    assert_bitwise_equal(truth, untouched(fresh, [fresh_opt]))
    loaded = load_state(str(tmp_path), device="cuda")
    assert all(t.device.type == "cuda" for t in loaded["model"].values())
    assert_bitwise_equal({k: v.cpu() for k, v in truth["model"].items()},
                         {k: v.cpu() for k, v in loaded["model"].items()})
