"""Compressed training through the core engine: steps are recorded as codec payloads, replay
decodes them (and replays declared clipping) bit for bit, codec state is saved per base, and a
gradient changed behind the codec's back is recorded dense instead of wrongly."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from engine_runs import assert_state, record_span, snapshot
from helpers import assert_bitwise_equal

from diffckpt import (
    CheckpointEngine,
    CheckpointOptions,
    CorruptRecordError,
    IncompatibleCheckpointError,
    load_state,
)
from diffckpt.codecs import LowPrecision, PowerSGD, TopK, codec_from_config
from diffckpt.codecs.compressor import GradientCompressor
from diffckpt.planning import plan

CODECS = {
    "topk": lambda: TopK(0.05),
    "topk-ef": lambda: TopK(0.05, error_feedback=True),
    "powersgd": lambda: PowerSGD(rank=2),
    "powersgd-warm": lambda: PowerSGD(rank=2, error_feedback=False),
    "bf16": lambda: LowPrecision("bf16"),
}
# retention=None: every step is restored and checked, which the default retention would trim.
OPTIONS = {"write_batch": 3, "base_every_n_steps": 5, "fingerprint_every_n_steps": 2, "retention": None}


def make() -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 24),
                            torch.nn.Tanh(), torch.nn.Linear(24, 1))
    return m, [torch.optim.AdamW(m.parameters(), lr=1e-2)]


class Run:
    """A compressed training run with clipping, recorded into ``root``; ``truth`` keeps the true
    state and codec state after every step."""

    def __init__(self, root: Any, codec: str, clip: float | None = 0.5, start: int = 0,
                 restore: int | None = None, **options: Any) -> None:
        self.module, self.optimizers = make()
        self.compressor = GradientCompressor(CODECS[codec](), self.module, check_every=3)
        self.compressor.set_clipping("norm" if clip else None, clip)
        self.clip = clip
        self.engine = CheckpointEngine(root, CheckpointOptions(**{**OPTIONS, **options}))
        self.result = None
        if restore is not None or start:
            self.result = self.engine.restore(self.module, self.optimizers, restore, compressor=self.compressor)
            start = self.result.step
        self.start = start
        self.truth: dict[int, dict[str, Any]] = {}
        self.codec_truth: dict[int, dict[str, torch.Tensor]] = {}
        self.engine.start(self.module, self.optimizers, start, compressor=self.compressor)
        self._base(start)

    def _base(self, step: int) -> None:
        self.engine.write_base(step, self.module.state_dict(), [o.state_dict() for o in self.optimizers],
                               {"x": step}, [self.compressor.state_dict()])

    def train(self, last: int, tamper: bool = False) -> int | None:
        for step in range(self.start + 1, last + 1):
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
            opt = self.optimizers[0]
            opt.zero_grad()
            self.module(x).pow(2).mean().backward()
            self.compressor.compress_(self.module.parameters())
            if self.clip:
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
            if tamper and step >= 4:
                next(self.module.parameters()).grad.mul_(0.5)  # not declared: must be caught
            opt.step()
            self.truth[step] = snapshot(self.module, self.optimizers, step)
            self.codec_truth[step] = self.compressor.state_dict()
            self.engine.record_step(step, {"x": step})
            if self.engine.wants_base(step):
                self._base(step)
        self.start = last
        return self.engine.close()


@pytest.mark.parametrize("codec", CODECS)
def test_every_step_replays_bit_exactly_from_payloads(tmp_path, codec: str) -> None:
    run = Run(tmp_path, codec)
    assert run.train(12) == 12
    for step in range(1, 13):
        module, optimizers = make()
        compressor = GradientCompressor(CODECS[codec](), module)
        result = CheckpointEngine(tmp_path).restore(module, optimizers, step, compressor=compressor)
        assert_state(run.truth, result, module, optimizers)
        if step % 5 == 0 or not compressor.codec.error_feedback:
            # At a base step, or for a codec whose state the payloads carry, the codec state
            # is restored exactly too, so training continues exactly.
            assert_bitwise_equal(compressor.state_dict(), run.codec_truth[step])


def test_records_hold_payloads_not_dense_gradients(tmp_path) -> None:
    run = Run(tmp_path, "topk", write_batch=1)
    run.train(4)
    segment = max((tmp_path / "diffs").iterdir())
    store = run.engine.recorder.store
    records = [r for r, _ in store.read_records(plan(store, 4))]
    event = records[-1]["events"][0]
    assert "grads" not in event and event["codec"] == TopK(0.05).config()
    assert event["clip"] == {"kind": "norm", "max_norm": 0.5, "norm_type": 2.0}
    weight = event["payloads"][0][0]
    assert weight["values"].shape == (1, 13)  # ceil(5% of 8*32) entries, one rank
    assert codec_from_config(event["codec"]).name == "topk(0.05)"
    assert segment.stat().st_size < 4096


@pytest.mark.parametrize("codec", ["topk-ef", "powersgd"])
def test_resume_at_a_base_continues_exactly_between_bases_rewarms(tmp_path, codec: str) -> None:
    reference = Run(tmp_path / "ref", codec)
    reference.train(12)
    first = Run(tmp_path / "run", codec)
    first.train(7)
    # Step 5 is a base: parameters, optimizer and error-feedback state are all exact, so the
    # resumed run is the uninterrupted one.
    at_base = Run(tmp_path / "run", codec, restore=5)
    at_base.train(12)
    for step in range(6, 13):
        assert_bitwise_equal(at_base.truth[step], reference.truth[step])
    # Step 7 is between bases: the restored state is exact, residuals restart from zero.
    between = Run(tmp_path / "run", codec, restore=7)
    assert_bitwise_equal(snapshot(between.module, between.optimizers, 7)["model"], reference.truth[7]["model"])
    between.train(9)
    assert not torch.equal(between.truth[9]["model"]["0.weight"], reference.truth[9]["model"]["0.weight"])


def test_undeclared_gradient_change_is_recorded_dense(tmp_path, caplog) -> None:
    run = Run(tmp_path, "topk", clip=None, base_every_n_steps=None)
    with caplog.at_level(logging.WARNING, logger="diffckpt"):
        run.train(9, tamper=True)
    assert "changed between compression and optimizer.step()" in caplog.text
    store = run.engine.recorder.store
    events = {r["step"]: r["events"][0] for r, _ in store.read_records(plan(store, 9))}
    assert all("payloads" in events[s] for s in range(1, 4))
    assert all("grads" in events[s] for s in range(4, 10))  # caught by the check at step 4
    for step in range(1, 10):
        module, optimizers = make()
        result = CheckpointEngine(tmp_path).restore(module, optimizers, step)
        assert_state(run.truth, result, module, optimizers)


def test_load_state_rebuilds_a_compressed_run_without_knowing_the_codec(tmp_path) -> None:
    run = Run(tmp_path, "powersgd")
    run.train(8)
    state = load_state(str(tmp_path), 8)
    assert_bitwise_equal(state["model"], run.truth[8]["model"])


def test_a_codec_must_be_a_codec() -> None:
    with pytest.raises(TypeError, match="diffckpt.codecs.TopK, PowerSGD or LowPrecision"):
        GradientCompressor("topk", make()[0])  # type: ignore[arg-type]


def test_resuming_with_another_codec_starts_its_state_fresh(tmp_path) -> None:
    run = Run(tmp_path, "powersgd")
    run.train(5)  # step 5 is a base, with PowerSGD residuals and Q factors
    module, optimizers = make()
    compressor = GradientCompressor(TopK(0.05, error_feedback=True), module)
    result = CheckpointEngine(tmp_path).restore(module, optimizers, 5, compressor=compressor)
    assert result.codec_config == PowerSGD(rank=2).config()
    assert_state(run.truth, result, module, optimizers)
    assert compressor.state_dict() == {}  # PowerSGD's state is not TopK's


def test_damaged_compressed_segment_falls_back_and_a_different_model_is_refused(tmp_path) -> None:
    run = Run(tmp_path, "topk", write_batch=2, base_every_n_steps=None)
    run.train(8)
    last = max((tmp_path / "diffs").iterdir())  # steps 7..8
    data = bytearray(last.read_bytes())
    offset, length = record_span(bytes(data), 7)
    data[offset + length // 2] ^= 0xFF  # inside step 7's payloads
    last.write_bytes(bytes(data))
    module, optimizers = make()
    with pytest.warns(UserWarning, match=last.name):
        result = CheckpointEngine(tmp_path).restore(module, optimizers)
    assert result.step == 6  # the newest step before the damaged payloads
    assert_state(run.truth, result, module, optimizers)
    last.write_bytes(bytes(data[: len(data) // 3]))  # truncated
    with pytest.raises(CorruptRecordError):
        CheckpointEngine(tmp_path).restore(*make(), step=8)
    torch.manual_seed(0)
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(IncompatibleCheckpointError, match="different model"):
        CheckpointEngine(tmp_path).restore(other, [torch.optim.AdamW(other.parameters())], 4)
    assert_bitwise_equal(before, other.state_dict())  # left untouched
