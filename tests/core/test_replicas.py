"""The block a rank holds under 2-D placements, and replicated blocks' owners and checks (pure
functions; the 4-process runs are in ``tests/sharded/test_fsdp_2d.py``)."""

from __future__ import annotations

import itertools

import pytest
import torch

from diffckpt.replicas import assign_owners, not_owned, replica_problems
from diffckpt.sharding import block_of, same_layout, slice_of


def chunk_index(n: int, parts: int, i: int) -> tuple[int, int]:
    """``(start, length)`` of ``torch.chunk(torch.arange(n), parts)[i]`` (empty past the end)."""
    pieces = torch.arange(n).chunk(parts)
    if i >= len(pieces):
        return n, 0
    return int(pieces[i][0]) if len(pieces[i]) else n, len(pieces[i])


def test_blocks_are_torch_chunk_pieces_in_the_order_fsdp_and_tp_cut():
    for n, dp, tp in itertools.product(range(0, 13), (1, 2, 3, 4), (1, 2, 3)):
        full = torch.arange(n * 3).reshape(n, 3)
        covered = torch.zeros(n, 3, dtype=torch.int64)
        for d, t in itertools.product(range(dp), range(tp)):
            # FSDP x TP colwise: (_StridedShard(0, tp), Shard(0)) on (dp, tp): dp's chunk of tp's chunk
            index = slice_of([n, 3], [dp, tp], [d, t], ["_StridedShard(0, 2)", "Shard(0)"])
            by_tp = full.chunk(tp)[t] if t < len(full.chunk(tp)) else full[n:]
            by_dp = by_tp.chunk(dp)[d] if d < len(by_tp.chunk(dp)) else by_tp[len(by_tp):]
            assert torch.equal(full[index], by_dp), (n, dp, tp, d, t)
            covered[index] += 1
        assert bool((covered == 1).all())  # every element in exactly one block
        for r, s in itertools.product(range(dp), range(tp)):  # HSDP: replicated over dim 0, sharded over dim 1
            size, offset = block_of([n, 3], [dp, tp], [r, s], ["Replicate()", "Shard(0)"])
            assert (offset[0], size[0]) == chunk_index(n, tp, s) and size[1] == 3 and offset[1] == 0
    # rowwise: Shard(1) over tp after Shard(0) over dp
    assert block_of([4, 8], [2, 2], [1, 0], ["Shard(0)", "Shard(1)"]) == ([2, 4], [2, 0])


def test_owners_are_the_lowest_rank_of_each_replica_group_and_the_others_skip():
    def entry(offset: int, rows: int) -> dict:
        return {"shape": [4], "offset": [offset], "local_shape": [rows]}

    # HSDP 2x2 (rank = 2 * replica + shard): ranks 0 and 2 hold rows 0..1, ranks 1 and 3 rows 2..3
    tables = [{"w": entry(0, 2)}, {"w": entry(2, 2)}, {"w": entry(0, 2)}, {"w": entry(2, 2)}]
    owned = assign_owners(tables)
    assert [t["w"]["owner"] for t in owned] == [0, 1, 0, 1]
    assert [t["w"]["replicas"] for t in owned] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [not_owned(t, r) for r, t in enumerate(owned)] == [set(), set(), {"w"}, {"w"}]
    # 1-D FSDP2: every block held once, and written without the keys, as before; empty trailing
    # pieces at one offset are no replicas (nothing to record or to take from another stream)
    one_d = [{"w": entry(0, 2)}, {"w": entry(2, 2)}, {"w": entry(4, 0)}, {"w": entry(4, 0)}]
    assert assign_owners(one_d) == one_d
    assert same_layout(owned[2], tables[0]) and not same_layout(owned[2], tables[1])


def test_divergent_replicas_are_named_with_the_ranks_on_each_side():
    sums = [{"w": ([0, 2], "x"), "b": ([0, 1, 2, 3], "y")}, {"b": ([0, 1, 2, 3], "y")},
            {"w": ([0, 2], "z"), "b": ([0, 1, 2, 3], "v")}, {"b": ([0, 1, 2, 3], "v")}]
    assert replica_problems(sums) == ["'w' (rank 0 against rank 2)", "'b' (ranks 0, 1 against ranks 2, 3)"]
    assert replica_problems([{"w": ([0, 1], "x")}, {"w": ([0, 1], "x")}]) == []


def test_the_replica_checksum_sees_differences_that_a_sum_of_bits_misses():
    from diffckpt.replicas import replica_sums

    table = {"weight": {"replicas": [0, 1]}, "bias": {}}
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    b.load_state_dict(a.state_dict())
    with torch.no_grad():  # one element an ulp up, another an ulp down: the bits' sum is unchanged
        bits = b.weight.view(torch.int32).reshape(-1)
        bits[0] += 1
        bits[1] -= 1
    assert set(replica_sums(a, table)) == {"weight"}
    assert replica_problems([replica_sums(a, table), replica_sums(b, table)]) == ["'weight' (rank 0 against rank 1)"]


def test_a_strided_shard_that_is_not_fully_shards_over_tensor_parallel_is_refused():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from diffckpt.errors import UnsupportedConfigurationError
    from diffckpt.sharding import _check_strided, placement_name

    _check_strided("w", (_StridedShard(0, split_factor=2), Shard(0)), [4, 2])  # FSDP x TP: accepted
    with pytest.raises(UnsupportedConfigurationError, match="split factor 3 where the other shards of dim 0 make 2"):
        _check_strided("w", (_StridedShard(0, split_factor=3), Shard(0)), [4, 2])
    assert [placement_name(p) for p in (_StridedShard(1, split_factor=2), Shard(1), Replicate())] == [
        "_StridedShard(1, 2)", "Shard(1)", "Replicate()"]
    with pytest.raises(UnsupportedConfigurationError, match="Partial"):
        from torch.distributed.tensor import Partial

        placement_name(Partial())
