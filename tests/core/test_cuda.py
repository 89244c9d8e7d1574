"""What was designed for CUDA and can only be checked on a CUDA device (``make gpu-check`` runs
these; they skip themselves elsewhere): the writer's host stage (gradients narrowed on the device),
the CUDA generators, replay onto the device, ``load_state(device="cuda")`` and compaction on the
device the run recorded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_runs import base_dir, untouched
from helpers import assert_bitwise_equal

from diffckpt import CheckpointEngine, CheckpointOptions, compact, load_state
from diffckpt.narrowing import is_split, narrowed
from diffckpt.recordprep import narrow_gradients
from diffckpt.rng import get_rng_state, set_rng_state
from diffckpt.segment import decode_segment
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


def _bf16_valued(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def _with_wide_rows(g: torch.Tensor, rows: list[int], values: torch.Tensor) -> torch.Tensor:
    """An embedding's gradient under autocast: bfloat16-valued but in ``rows``."""
    g[rows] = values
    return g


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes."""
    return (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def test_the_host_stage_narrows_gradients_on_the_device_as_the_host_would() -> None:
    """Each float32 gradient of a record is copied in bfloat16 where that is exact, and row-split
    where it is but in a few rows, decided on the device: the host gets, bit for bit, what
    ``narrowed`` gives on the contiguous float32 copies the stage made before. The flags (one a
    row) come back in one small pinned buffer of the pool; the record's buffers keep their dtype;
    a second record reuses every pinned buffer, the split one's low rows included."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device="cuda", generator=gen)

    nans = torch.tensor([0xFFC00000, 0x7F810000, 0x7FC10000, 0xFF800000], dtype=torch.int64).to(torch.int32)
    grads = [
        _bf16_valued(randn(64, 64)),  # bf16 autocast's gradients
        randn(100),  # float32-valued (a tied embedding's)
        _bf16_valued(randn(6, 9)).t(),  # not contiguous
        _bf16_valued(randn()),  # 0-dim
        torch.zeros(0, 3, device="cuda"),  # empty: as it is
        nans.view(torch.float32).cuda(),  # NaNs with a sign and a payload, kept bit for bit
        randn(6, 10)[:, ::2],  # not contiguous, float32-valued
        _bf16_valued(randn(6, 10))[:, ::2],  # every second element: flattened, a strided view
        randn(8).to(torch.bfloat16),  # 16 bits already
        _with_wide_rows(_bf16_valued(randn(300, 24)), [3, 150], randn(2, 24)),  # an embedding: split
    ]
    buffer = _bf16_valued(randn(16))
    want = [narrowed(g.cpu().contiguous()) for g in grads]
    stage = HostStage(pinned_bytes=1 << 20)

    def staged() -> tuple[list[torch.Tensor], dict[str, torch.Tensor], list[torch.Tensor]]:
        record = {"events": [{"grads": [grads[:4], [None, *grads[4:]]]}], "buffers": {"bn": buffer}, "step": 3}
        narrow = narrow_gradients(record)
        assert len(narrow) == len(grads)  # all on the device: left to the stage
        host, buffers = stage.to_host(record, [HostStage.mark(record)], narrow)
        assert host["events"][0]["grads"][1][0] is None
        return [g for group in host["events"][0]["grads"] for g in group if g is not None], host["buffers"], buffers

    def same(g: Any, w: Any) -> bool:
        if isinstance(w, dict):
            return is_split(g) and all(_same(g[k], w[k]) for k in ("high", "rows", "low")) and g["low"].is_pinned()
        return _same(g, w) and (g.is_pinned() or not g.numel())

    got, buffers_of_record, buffers = staged()
    for i, (g, w) in enumerate(zip(got, want)):
        assert same(g, w), i
    assert [g.dtype for g in got[:-1]] == [torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16, torch.float32,
                                           torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16]
    assert is_split(got[-1]) and got[-1]["rows"].tolist() == [3, 150]
    assert _same(buffers_of_record["bn"], buffer.cpu())
    flags = [b for b in buffers if b.dtype == torch.bool]
    # a flag per row of the 8 float32 ones that are not empty (one row below two dimensions)
    assert len(flags) == 1 and flags[0].shape == (64 + 1 + 9 + 1 + 1 + 6 + 6 + 300,) and flags[0].is_pinned()
    stage.release(buffers)
    again, _, more = staged()
    assert [b.data_ptr() for b in more] == [b.data_ptr() for b in buffers]  # the pool's
    assert all(same(g, w) for g, w in zip(again, want))


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


def _recorded_run(root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> dict[str, Any]:
    """``steps`` training steps recorded every step (segments of 3, a base at step 0 only); the
    trained state."""
    engine = CheckpointEngine(str(root), CheckpointOptions(write_batch=3, base_every_n_steps=None))
    engine.start(model, [opt], 0)
    engine.write_base(0, model.state_dict(), [opt.state_dict()], {})
    for step in range(1, steps + 1):
        x = torch.randn(8, 16, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        engine.record_step(step, {})
    truth = untouched(model, [opt])
    assert engine.close() == steps
    return truth


def _restored(root: Path, **adamw: Any) -> tuple[Any, dict[str, Any]]:
    """The newest step restored onto a fresh model and AdamW (``adamw``: its options): the
    restore's result and the restored state."""
    torch.manual_seed(0)
    fresh = _model()
    opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, **adamw)
    result = CheckpointEngine(str(root)).restore(fresh, [opt])
    return result, untouched(fresh, [opt])


def test_a_cuda_run_replays_onto_the_device_and_loads_as_cuda_tensors(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _model()
    truth = _recorded_run(tmp_path, model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), 7)
    result, state = _restored(tmp_path, fused=True)
    assert result.step == 7
    assert_bitwise_equal(truth, state)
    loaded = load_state(str(tmp_path), device="cuda")
    assert all(t.device.type == "cuda" for t in loaded["model"].values())
    assert_bitwise_equal({k: v.cpu() for k, v in truth["model"].items()},
                         {k: v.cpu() for k, v in loaded["model"].items()})
    # Compaction replays on the device the session recorded (cuda:0) unless told otherwise, and
    # its base is the trained state, bit for bit.
    assert json.loads((tmp_path / "sessions" / "g000001.json").read_text())["device"] == "cuda:0"
    assert compact(str(tmp_path)).written
    assert json.loads((base_dir(tmp_path, 7) / "COMMIT").read_text())["compacted"]["device"] == "cuda"
    result, state = _restored(tmp_path, fused=True)
    assert (result.step, result.base_step, result.replayed) == (7, 7, 0)
    assert_bitwise_equal(truth, state)


def test_a_cuda_run_stores_bfloat16_valued_gradients_in_16_bits_and_replays_bitwise(tmp_path: Path) -> None:
    """Under bf16 autocast most gradients hold bfloat16 values (here the first layer's, made so by
    a hook), some do not (the batch norm's), and an embedding's does but in the rows of the batch's
    tokens (the last layer's weight here, made so by a hook that keeps its first row float32): the first
    are stored in 16 bits, the second in 32 and the last split, decided on the device; the restore
    is bitwise."""
    torch.manual_seed(0)
    model = _model()
    for p in model[0].parameters():
        p.register_hook(_bf16_valued)
    model[3].bias.register_hook(_bf16_valued)
    model[3].weight.register_hook(lambda g: torch.cat([g[:1], _bf16_valued(g[1:])]))
    truth = _recorded_run(tmp_path, model, torch.optim.AdamW(model.parameters(), lr=1e-2), 6)
    records = [r for seg in sorted((tmp_path / "diffs").glob("*.seg"))
               for r in decode_segment(seg.read_bytes(), str(seg))[1]]
    assert [r["step"] for r in records] == list(range(1, 7))
    for r in records:  # parameters: first Linear's weight and bias, the batch norm's two, the last Linear's two
        (group,) = r["events"][0]["grads"]
        assert [g.dtype for g in group[:5]] == [torch.bfloat16] * 2 + [torch.float32] * 2 + [torch.bfloat16]
        assert is_split(group[5]) and group[5]["rows"].tolist() == [0]
    result, state = _restored(tmp_path)
    assert result.step == 6
    assert_bitwise_equal(truth, state)
