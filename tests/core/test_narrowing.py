"""16-bit gradients (``diffckpt/narrowing.py``): the functions the host stage runs on a GPU give,
run on CPU tensors, what :func:`narrowed` gives on the host copy the stage would otherwise have
made (contiguous), bit for bit; every bit survives the round trip, NaNs included; and a record's
host gradients are narrowed before staging while its device gradients are left to the stage."""

from __future__ import annotations

import torch

from diffckpt.narrowing import _NARROW_CHUNK, exact_flags, high_halves, narrowable, narrowed
from diffckpt.recordprep import narrow_gradients
from diffckpt.staging import HostStage


def _bits(values: list[int]) -> torch.Tensor:
    """float32 tensor of the given 32-bit patterns."""
    return torch.tensor(values, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _as_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def _cases() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(300, 7, generator=gen)
    one_low_bit = _as_bf16(torch.randn(5000, generator=gen))
    one_low_bit[-1] = one_low_bit[-1].view(torch.int32).add(1).view(torch.float32)  # past the sample
    later_chunk = _as_bf16(torch.randn(2 * _NARROW_CHUNK + 3, generator=gen))  # checked a chunk at a time
    later_chunk[_NARROW_CHUNK + 1] = later_chunk[_NARROW_CHUNK + 1].view(torch.int32).add(1).view(torch.float32)
    return {
        "bfloat16-valued over several chunks": _as_bf16(torch.randn(2 * _NARROW_CHUNK + 3, generator=gen)),
        "one low bit in a later chunk": later_chunk,
        "bfloat16-valued": _as_bf16(torch.randn(300, 7, generator=gen)),
        "float32-valued": wide,
        "one low bit at the end": one_low_bit,
        "zeros": torch.zeros(4, 4),
        "empty": torch.zeros(0, 3),
        "0-dim bfloat16-valued": torch.tensor(1.5),
        "0-dim float32-valued": torch.tensor(0.1),
        "non-contiguous bfloat16-valued": _as_bf16(torch.randn(6, 9, generator=gen)).t(),
        "non-contiguous float32-valued": torch.randn(6, 9, generator=gen)[:, ::2],
        # Every second element: flattened, a strided view (no copy), which the halves cannot read.
        "uniformly strided bfloat16-valued": _as_bf16(torch.randn(6, 10, generator=gen))[:, ::2],
        "uniformly strided float32-valued": torch.randn(6, 10, generator=gen)[:, ::2],
        "NaNs and infinities, bfloat16-valued": _bits([0xFFC00000, 0x7F810000, 0x7FC10000, 0xFF800000,
                                                       0x7F800000, 0x80000000, 0x00010000]),
        "bfloat16": torch.randn(8, generator=gen).to(torch.bfloat16),
        "float64": torch.randn(8, generator=gen, dtype=torch.float64),
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes."""
    return (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def test_the_device_path_gives_what_narrowed_gives_on_the_host_copy() -> None:
    cases = _cases()
    candidates = [g for g in cases.values() if narrowable(g)]
    flags = dict(zip(map(id, candidates), exact_flags(candidates).tolist()))  # one batch, as the stage reads them
    for name, g in cases.items():
        staged = high_halves(g) if flags.get(id(g)) else g  # what the stage copies to the host
        want = narrowed(g.contiguous())  # the stage's host buffers are contiguous
        assert _same(staged, want), name
    assert flags[id(cases["bfloat16-valued"])] and not flags[id(cases["float32-valued"])]
    assert not flags[id(cases["one low bit at the end"])] and flags[id(cases["non-contiguous bfloat16-valued"])]
    assert flags[id(cases["uniformly strided bfloat16-valued"])]
    assert flags[id(cases["bfloat16-valued over several chunks"])] and not flags[id(cases["one low bit in a later chunk"])]
    assert narrowed(cases["bfloat16-valued over several chunks"]).dtype == torch.bfloat16
    assert narrowed(cases["one low bit in a later chunk"]) is cases["one low bit in a later chunk"]
    assert not narrowable(cases["empty"]) and not narrowable(cases["bfloat16"])


def test_narrowed_keeps_host_tensors_it_cannot_read_in_place() -> None:
    cases = _cases()
    for name in ("float32-valued", "empty", "non-contiguous bfloat16-valued", "uniformly strided bfloat16-valued",
                 "bfloat16", "float64"):
        assert narrowed(cases[name]) is cases[name], name
    assert narrowed(cases["0-dim bfloat16-valued"]).dtype == torch.bfloat16


def test_every_bit_comes_back_nans_included() -> None:
    """A conversion would rewrite NaNs (sign and payload); the high halves keep them, so replay's
    cast back to float32 gives the recorded bits."""
    g = _cases()["NaNs and infinities, bfloat16-valued"]
    h = narrowed(g)
    assert h.dtype == torch.bfloat16
    assert torch.equal(h.to(torch.float32).view(torch.int32), g.view(torch.int32))
    assert torch.equal(high_halves(g).to(torch.float32).view(torch.int32), g.view(torch.int32))


def test_host_gradients_are_narrowed_and_device_ones_left_to_the_stage() -> None:
    """Only gradients: buffers keep their dtype. A tensor on the ``meta`` device stands in for one
    on a GPU, which the host stage narrows before its copy."""
    exact, wide = _as_bf16(torch.randn(4, 4)), torch.randn(4)
    on_device = torch.empty(3, device="meta")
    buffer = _as_bf16(torch.randn(4))
    record = {"events": [{"grads": [[exact, None], [wide, on_device]]}, {"payloads": [[exact]]}],
              "buffers": {"bn": buffer}, "step": 1}
    left = narrow_gradients(record)
    assert len(left) == 1 and left[0] is on_device
    (g0, none), (g1, g2) = record["events"][0]["grads"]
    assert g0.dtype == torch.bfloat16 and torch.equal(g0.float(), exact) and none is None
    assert g1 is wide and g2 is on_device
    assert record["events"][1]["payloads"][0][0] is exact and record["buffers"]["bn"] is buffer


def test_the_host_stage_narrows_into_its_pool_record_after_record() -> None:
    """Host copies come from the stage's pool and go back with the record's other buffers, so the
    next record's narrowing writes into the same memory; what was narrowed is unchanged."""
    stage = HostStage(pinned_bytes=64 << 20)
    cases = _cases()
    g = cases["bfloat16-valued over several chunks"]
    kept = cases["one low bit in a later chunk"]
    first = {"events": [{"grads": [[g, kept, None]]}]}
    assert stage.narrow(first) == []  # host gradients: nothing left for the device path
    narrowed_g, same = first["events"][0]["grads"][0][:2]
    assert narrowed_g.dtype == torch.bfloat16 and same is kept
    assert torch.equal(narrowed_g.to(torch.float32).view(torch.int32), g.view(torch.int32))
    lent = {buf.untyped_storage().data_ptr() for buf in stage._narrowed}  # kept's too: it was copied up to its low bit
    assert narrowed_g.untyped_storage().data_ptr() in lent and len(lent) == 2
    stage.release([])
    second = {"events": [{"grads": [[g.clone()]]}]}
    stage.narrow(second)
    assert second["events"][0]["grads"][0][0].untyped_storage().data_ptr() in lent
    stage.release([])
