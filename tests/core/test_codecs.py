"""Gradient codecs on their own: payloads survive serialization bit for bit, decompression is a
pure function of the payload, state round-trips, and training on decompressed gradients replays
exactly from the payloads alone."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import assert_bitwise_equal

from diffckpt.codecs import Codec, LowPrecision, PowerSGD, TopK, codec_from_config
from diffckpt.tree import pack_tree, unpack_tree

CODECS = {
    "topk": lambda: TopK(0.01),
    "topk-ef": lambda: TopK(0.05, error_feedback=True),
    "powersgd": lambda: PowerSGD(rank=2),
    "powersgd-plain": lambda: PowerSGD(rank=2, error_feedback=False, warm_start=False),
    "bf16": lambda: LowPrecision("bf16"),
    "fp16": lambda: LowPrecision("fp16"),
}


def grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 48, generator=g), "conv": torch.randn(8, 4, 3, 3, generator=g),
            "b": torch.randn(48, generator=g)}


@pytest.mark.parametrize("name", CODECS)
def test_payload_is_a_lossless_diff(name: str) -> None:
    codec = CODECS[name]()
    assert isinstance(codec, Codec)
    json.dumps(codec.config())
    for step in range(3):
        payloads = codec.encode(grads(step))
        for key, g in grads(step).items():
            dense = codec.decode(payloads[key], g.shape, g.dtype)
            assert dense.shape == g.shape and dense.dtype == g.dtype
            stored = unpack_tree(pack_tree(payloads[key]))  # what a diff record holds
            assert_bitwise_equal(dense, codec.decode(stored, g.shape, g.dtype))
            for t in payloads[key].values():  # decoding never hands out the payload's memory
                assert dense.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_topk_keeps_the_largest_entries_in_a_small_payload() -> None:
    g = torch.randn(1000, 100, generator=torch.Generator().manual_seed(0))
    payload = TopK(0.01).encode({"w": g})["w"]
    dense = TopK(0.01).decode(payload, g.shape, g.dtype)
    kept = dense != 0
    assert int(kept.sum()) == math.ceil(0.01 * g.numel()) == 1000
    assert g[kept].abs().min() >= g[~kept].abs().max()  # the largest magnitudes
    assert torch.equal(dense[kept], g[kept])
    nbytes = sum(t.numel() * t.element_size() for t in payload.values())
    assert nbytes == 8 * 1000  # an fp32 value and an int32 index delta per kept entry: 2% of dense


def test_topk_error_feedback_carries_what_was_dropped() -> None:
    codec = TopK(0.1, error_feedback=True)
    g1, g2 = torch.randn(100, generator=torch.Generator().manual_seed(1)), torch.randn(100)
    d1 = codec.decode(codec.encode({"b": g1})["b"], g1.shape, g1.dtype)
    assert torch.equal(codec.state_dict()["b/residual"], g1 - d1)
    d2 = codec.decode(codec.encode({"b": g2})["b"], g2.shape, g2.dtype)
    assert torch.equal(d2[d2 != 0], (g2 + (g1 - d1))[d2 != 0])


def test_powersgd_is_low_rank_and_sends_vectors_whole() -> None:
    codec = PowerSGD(rank=2)
    g = grads(0)
    payloads = codec.encode(g)
    payload = payloads["w"]
    assert payload["p"].shape == (64, 2) and payload["q"].shape == (48, 2)
    assert torch.linalg.matrix_rank(codec.decode(payload, g["w"].shape, torch.float32)) == 2
    assert torch.equal(codec.decode(payloads["b"], g["b"].shape, torch.float32), g["b"])


@pytest.mark.parametrize("name", CODECS)
def test_codecs_leave_the_global_rng_alone(name: str) -> None:
    before = torch.random.get_rng_state()
    codec = CODECS[name]()
    codec.encode(grads(0))
    assert torch.equal(torch.random.get_rng_state(), before)


@pytest.mark.parametrize("name", ["topk-ef", "powersgd"])
def test_state_round_trip_continues_identically(name: str) -> None:
    a = CODECS[name]()
    for step in range(3):
        a.encode(grads(step))
    b = CODECS[name]()
    b.load_state_dict(unpack_tree(pack_tree(a.state_dict())))
    assert a.error_feedback and a.state_dict()
    assert_bitwise_equal(a.encode(grads(3)), b.encode(grads(3)))


def test_powersgd_warm_start_is_rebuilt_from_the_last_payloads() -> None:
    a = PowerSGD(rank=2, error_feedback=False)
    for step in range(3):
        last = a.encode(grads(step))
    b = PowerSGD(rank=2, error_feedback=False)
    b.resume(unpack_tree(pack_tree(last)))
    assert_bitwise_equal(a.state_dict(), b.state_dict())
    assert_bitwise_equal(a.encode(grads(3)), b.encode(grads(3)))


@pytest.mark.parametrize("name", CODECS)
def test_codec_is_rebuilt_from_its_recorded_config(name: str) -> None:
    codec = CODECS[name]()
    again = codec_from_config(json.loads(json.dumps(codec.config())))
    assert type(again) is type(codec) and again.config() == codec.config() and again.name == codec.name
    with pytest.raises(ValueError, match="unknown gradient codec 'zfp'.*upgrade diffckpt"):
        codec_from_config({"codec": "zfp"})


@pytest.mark.parametrize("name", CODECS)
def test_training_on_decompressed_gradients_replays_exactly_from_payloads(name: str) -> None:
    def model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    codec = CODECS[name]()
    m, opt = model()
    records = []
    for step in range(6):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        payloads = codec.encode({key: p.grad for key, p in m.named_parameters()})
        for key, p in m.named_parameters():
            p.grad = codec.decode(payloads[key], p.shape, p.dtype)  # compressed training
        opt.step()
        records.append(pack_tree(payloads))
    replayed, ropt = model()
    for blob in records:
        payloads = unpack_tree(blob)
        for key, p in replayed.named_parameters():
            p.grad = codec.decode(payloads[key], p.shape, p.dtype)
        ropt.step()
    assert_bitwise_equal(m.state_dict(), replayed.state_dict())
    assert_bitwise_equal(opt.state_dict(), ropt.state_dict())


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="ratio"):
        TopK(0)
    with pytest.raises(ValueError, match="rank"):
        PowerSGD(rank=0)
    with pytest.raises(ValueError, match="bf16"):
        LowPrecision("int8")
