"""The rest of an epoch dealt over another number of ranks (``diffckpt.dealing``), against the
sampler it stands in for, torch's ``DistributedSampler`` (Accelerate's ``BatchSamplerShard``:
tests/accelerate/test_accelerate_setup.py)."""

from __future__ import annotations

import itertools

import pytest
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

from diffckpt.dealing import (
    IndexSampler,
    Remainder,
    deal,
    distributed_dealing,
    drawn_order,
    global_order,
)


def _sampler(n: int, world: int, rank: int, shuffle: bool = True, drop_last: bool = False,
             epoch: int = 3) -> DistributedSampler:
    s = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=11, drop_last=drop_last)
    s.set_epoch(epoch)
    return s


@pytest.mark.parametrize("n, world, drop_last", itertools.product([1, 7, 12, 13, 50], [1, 2, 3, 5], [False, True]))
def test_deal_is_what_distributed_sampler_gives_each_rank(n, world, drop_last):
    order = drawn_order(distributed_dealing(_sampler(n, world, 0), 3))
    assert sorted(order) == list(range(n))
    for rank in range(world):
        assert deal(order, world, rank, drop_last) == list(_sampler(n, world, rank, drop_last=drop_last))


@pytest.mark.parametrize("n, world, batch", [(48, 2, 4), (50, 3, 4), (13, 5, 2), (96, 4, 3)])
def test_the_first_batches_of_every_rank_are_a_prefix_of_the_order(n, world, batch):
    """After ``c`` batches on every rank, what was consumed is the order's first
    ``c × batch × world`` samples: the fact a resume on another number of ranks rests on."""
    order = global_order(_sampler(n, world, 0))
    assert order == drawn_order(distributed_dealing(_sampler(n, world, 1), 3))
    per_rank = [list(BatchSampler(_sampler(n, world, r), batch, drop_last=False)) for r in range(world)]
    for c in range(min(len(b) for b in per_rank) + 1):
        consumed = sorted(i for b in per_rank for batch_ in b[:c] for i in batch_)
        if c * batch * world <= n:
            assert consumed == sorted(order[:c * batch * world])


@pytest.mark.parametrize("old, new", [(2, 3), (3, 2), (4, 1), (1, 3)])
def test_rest_dealt_over_new_ranks_completes_the_epoch_once(old, new):
    n, batch, c = 96, 4, 2
    order = drawn_order(distributed_dealing(_sampler(n, old, 0), 3))
    consumed = c * batch * old
    rest = [i for r in range(new) for i in deal(order[consumed:], new, r, False)]
    assert sorted(set(order[:consumed] + rest)) == list(range(n))
    assert len(rest) - (n - consumed) == -(n - consumed) % new  # padding only to a whole round


def test_remainder_and_index_sampler():
    r = Remainder(SequentialSampler(range(10)), 7)
    assert list(r) == [7, 8, 9] and len(r) == 3
    assert list(Remainder(SequentialSampler(range(3)), 5)) == [] and len(Remainder(range(3), 5)) == 0
    assert list(IndexSampler([4, 2])) == [4, 2] and len(IndexSampler([4, 2])) == 2


def test_only_orders_a_recipe_can_name_are_named():
    assert distributed_dealing(RandomSampler(range(5)), 0) is None
    assert drawn_order(distributed_dealing(SequentialSampler(range(5)), 4)) == [0, 1, 2, 3, 4]

    class Mine(DistributedSampler):
        pass

    assert distributed_dealing(Mine(range(5), num_replicas=1, rank=0), 0) is None
