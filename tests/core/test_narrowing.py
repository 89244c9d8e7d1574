"""16-bit gradients (``diffckpt/narrowing.py``): the functions the host stage runs on a GPU give,
run on CPU tensors, what :func:`narrowed` gives on the host copy the stage would otherwise have
made (contiguous), bit for bit, row-split gradients included; every bit survives the round trip,
NaNs included; and a record's host gradients are narrowed before staging while its device
gradients are left to the stage."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_runs import untouched
from helpers import assert_bitwise_equal

from diffckpt import CheckpointEngine, CheckpointOptions
from diffckpt.narrowing import (
    _NARROW_CHUNK,
    high_halves,
    is_split,
    low_rows,
    narrowable,
    narrowed,
    plan,
    row_flags,
    shape_rows,
    widened,
    worth_splitting,
)
from diffckpt.recordprep import narrow_gradients
from diffckpt.segment import decode_segment
from diffckpt.staging import HostStage


def _bits(values: list[int]) -> torch.Tensor:
    """float32 tensor of the given 32-bit patterns."""
    return torch.tensor(values, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _as_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def _with_wide_rows(rows: int, width: int, wide: list[int], gen: torch.Generator) -> torch.Tensor:
    """An embedding's gradient under autocast: bfloat16-valued but in rows ``wide``."""
    g = _as_bf16(torch.randn(rows, width, generator=gen))
    g[wide] = torch.randn(len(wide), width, generator=gen)
    return g


def _cases() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    last_low_bit = _as_bf16(torch.randn(3000, 70, generator=gen))
    last_low_bit[-1, -1] = last_low_bit[-1, -1].view(torch.int32).add(1).view(torch.float32)
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
        # Rows over several chunks, a few of them float32-valued: split.
        "an embedding with a few wide rows": _with_wide_rows(8000, 70, [0, 5, 3999, 7999], gen),
        "one low bit in the last row": last_low_bit,
        "wide rows past the quarter saved": _with_wide_rows(40, 16, list(range(1, 40, 2)), gen),
        "wide rows outside the sample": _with_wide_rows(64, 8, [1, 2, 3, 5, 6, 7, 9, 10, 11], gen),
        "most sampled rows wide": _with_wide_rows(64, 8, list(range(0, 64, 4))[:9], gen),
        "3-D, one wide row": _with_wide_rows(6, 20, [2], gen).view(6, 4, 5),
        "float64": torch.randn(8, generator=gen, dtype=torch.float64),
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes."""
    return (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _staged(g: torch.Tensor, flags: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
    """What the host stage copies to the host for ``g``, given its rows' flags."""
    rows = plan(g, flags) if narrowable(g) else None
    if rows is None:
        return g
    if not len(rows):
        return high_halves(g)
    return {"high": high_halves(g), "rows": rows, "low": low_rows(g, rows)}


def _same_stored(a: torch.Tensor | dict[str, torch.Tensor], b: torch.Tensor | dict[str, torch.Tensor]) -> bool:
    if isinstance(a, dict) or isinstance(b, dict):
        return is_split(a) and is_split(b) and all(_same(a[k], b[k]) for k in ("high", "rows", "low"))
    return _same(a, b)


def test_the_device_path_gives_what_narrowed_gives_on_the_host_copy() -> None:
    cases = _cases()
    candidates = [g for g in cases.values() if narrowable(g)]
    flags = row_flags(candidates)  # one batch, as the stage reads them
    by_id, at = {}, 0
    for g in candidates:
        by_id[id(g)] = flags[at:at + shape_rows(g)[0]]
        at += shape_rows(g)[0]
    assert at == len(flags)
    stored = {}
    for name, g in cases.items():
        staged = _staged(g, by_id[id(g)]) if id(g) in by_id else g
        want = narrowed(g.contiguous())  # the stage's host buffers are contiguous
        assert _same_stored(staged, want), name
        stored[name] = want
    kinds = {name: "split" if is_split(v) else "16" if v.dtype == torch.bfloat16 else "32" for name, v in stored.items()}
    assert kinds["bfloat16-valued"] == kinds["non-contiguous bfloat16-valued"] == "16"
    assert kinds["float32-valued"] == kinds["one low bit at the end"] == kinds["one low bit in a later chunk"] == "32"
    assert kinds["uniformly strided bfloat16-valued"] == kinds["bfloat16-valued over several chunks"] == "16"
    assert kinds["an embedding with a few wide rows"] == kinds["one low bit in the last row"] == "split"
    assert kinds["wide rows outside the sample"] == kinds["3-D, one wide row"] == "split"
    assert kinds["wide rows past the quarter saved"] == kinds["most sampled rows wide"] == "32"
    assert stored["an embedding with a few wide rows"]["rows"].tolist() == [0, 5, 3999, 7999]
    assert stored["one low bit in the last row"]["rows"].tolist() == [2999]
    assert not narrowable(cases["empty"]) and not narrowable(cases["bfloat16"])


def test_a_split_gradient_widens_to_every_bit_it_had() -> None:
    cases = _cases()
    for name in ("an embedding with a few wide rows", "one low bit in the last row", "wide rows outside the sample",
                 "3-D, one wide row"):
        g, split = cases[name], narrowed(cases[name])
        assert is_split(split), name
        back = widened(split)
        assert back.dtype == torch.float32 and back.shape == g.shape, name
        assert torch.equal(back.view(torch.int32), g.view(torch.int32)), name
    special = [0xFFC00000, 0x7F810000, 0x7FC10000, 0xFF800000, 0x7F800000, 0x80000000, 0x00010000, 0x0]
    nans = _bits([0xFFC00001, *special[1:], *special * 3]).view(4, 8)  # row 0: a NaN with a low payload bit
    split = narrowed(nans)
    assert is_split(split) and split["rows"].tolist() == [0]
    assert torch.equal(widened(split).view(torch.int32), nans.view(torch.int32))


def test_parts_that_do_not_fit_are_refused() -> None:
    split = narrowed(_cases()["an embedding with a few wide rows"])
    assert is_split(split)
    for bad, what in ((dict(split, rows=split["rows"] + 8000), "rows"), (dict(split, low=split["low"][:2]), "low"),
                      (dict(split, high=split["high"].float()), "high"), (dict(split, rows=split["rows"].int()), "rows")):
        with pytest.raises(ValueError, match="parts do not fit"):
            widened(bad)
        assert what


def test_a_split_saves_at_least_a_quarter() -> None:
    assert worth_splitting(1, 50257, 768) and worth_splitting(24000, 50257, 768)
    assert not worth_splitting(26000, 50257, 768)
    assert not worth_splitting(0, 100, 10) and not worth_splitting(1, 1, 1000)
    assert worth_splitting(99, 1000, 1) and not worth_splitting(101, 1000, 1)  # 8 bytes of index for 2 saved


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


class _TiedLM(torch.nn.Module):
    """An embedding tied to the output head, as GPT-2's: under bf16 autocast the head's part of
    the shared gradient is bfloat16-valued in every row and the embedding's float32-valued in the
    rows of the batch's tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(512, 32)
        self.mix = torch.nn.Linear(32, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.mix(self.embed(tokens)))
        return torch.nn.functional.linear(hidden, self.embed.weight)


def _train(model: _TiedLM, opt: torch.optim.Optimizer, steps: range, engine: CheckpointEngine | None = None) -> None:
    for step in steps:
        tokens = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.float().view(-1, 512), tokens.view(-1)).backward()
        opt.step()
        if engine is not None:
            engine.record_step(step, {"step": step})


def test_a_tied_embedding_under_autocast_is_stored_split_and_replays_bitwise(tmp_path: Path) -> None:
    """Real bf16 autocast on the CPU: the tied embedding's gradient is stored split (the rows of
    the batch's tokens in float32), the Linear's in 16 bits; a restore of every
    step after the base replays bitwise against a run that never used diffckpt."""
    torch.manual_seed(0)
    model = _TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = CheckpointEngine(str(tmp_path), CheckpointOptions(write_batch=3, base_every_n_steps=None, local_dir=None))
    engine.start(model, [opt], 0)
    engine.write_base(0, model.state_dict(), [opt.state_dict()], {"step": 0})
    _train(model, opt, range(1, 7), engine)
    assert engine.close() == 6
    records = [r for seg in sorted((tmp_path / "diffs").glob("*.seg")) for r in decode_segment(seg.read_bytes(), str(seg))[1]]
    assert [r["step"] for r in records] == list(range(1, 7))
    for r in records:
        (embed, *others), = r["events"][0]["grads"]
        assert [g.dtype for g in others] == [torch.bfloat16, torch.bfloat16]  # the Linear's, under autocast
        tokens = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(r["step"]))
        assert is_split(embed) and embed["rows"].tolist() == sorted(set(tokens.view(-1).tolist()))
    for step in (6, 4):
        torch.manual_seed(0)
        expect_model = _TiedLM()
        expect_opt = torch.optim.AdamW(expect_model.parameters(), lr=1e-2)
        _train(expect_model, expect_opt, range(1, step + 1))
        fresh = _TiedLM()
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        assert CheckpointEngine(str(tmp_path)).restore(fresh, [fresh_opt], step).step == step
        assert_bitwise_equal(untouched(expect_model, [expect_opt]), untouched(fresh, [fresh_opt]))
