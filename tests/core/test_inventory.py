"""Chains, chain ends and durable spans are computed once per inventory and agree with the
definition (a base, then segments whose ``after`` is the previous ``last``, the longest one where
several start at a step); retention planning stays linear on thousands of segments."""

from __future__ import annotations

import random
import time

import pytest

from diffckpt import inventory as inventory_module
from diffckpt.format import BaseName, SegmentName
from diffckpt.inventory import Inventory
from diffckpt.lifecycle.retention import RetentionPolicy, plan_gc
from diffckpt.planning import candidates, durable_ranges
from diffckpt.runstore import RunStore


def _chain_by_definition(inv: Inventory, base: BaseName) -> list[SegmentName]:
    """``Inventory.chain`` as it was written before chains were cached: one scan per question."""
    by_after: dict[int, SegmentName] = {}
    for seg in inv.segments:
        if seg.gen == base.gen:
            current = by_after.get(seg.after)
            if current is None or seg.last > current.last:
                by_after[seg.after] = seg
    out, step = [], base.step
    while step in by_after:
        out.append(by_after[step])
        step = by_after[step].last
    return out


def _durable_by_definition(inv: Inventory, gen: int) -> list[list[int]]:
    """``diffckpt ls``'s durable intervals as the CLI computed them."""
    spans = sorted((b.step, c[-1].last if (c := _chain_by_definition(inv, b)) else b.step)
                   for b in inv.bases if b.gen == gen)
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return merged


def _random_inventory(rng: random.Random) -> Inventory:
    bases, segments = set(), set()
    for gen in range(1, rng.randint(1, 3) + 1):
        step = rng.randint(0, 5)
        for _ in range(rng.randint(0, 40)):
            width = rng.randint(1, 4)
            if rng.random() < 0.9:  # else a gap
                segments.add(SegmentName(step, step + width, gen))
            if rng.random() < 0.15:  # a longer, overlapping segment from the same step
                segments.add(SegmentName(step, step + width + rng.randint(1, 3), gen))
            if rng.random() < 0.2:
                bases.add(BaseName(step, gen))
            step += width
        bases.add(BaseName(rng.randint(0, step), gen))
    return Inventory(bases=sorted(bases), segments=sorted(segments))


@pytest.mark.parametrize("seed", range(40))
def test_cached_chains_agree_with_the_definition(seed: int) -> None:
    inv = _random_inventory(random.Random(seed))
    for base in inv.bases:
        expected = _chain_by_definition(inv, base)
        assert inv.chain(base) == expected
        assert list(inv.chains[base]) == expected
        assert inv.chain_end(base) == (expected[-1].last if expected else base.step)
    for gen in {b.gen for b in inv.bases}:
        assert [list(span) for span in inv.durable_spans(gen)] == _durable_by_definition(inv, gen)
        assert inv.newest_step(gen) == max(inv.chain_end(b) for b in inv.bases if b.gen == gen)
    assert inv.durable_spans(99) == [] and inv.newest_step(99) is None
    stranger = BaseName(10**6, 1)  # not listed: answered, not cached
    assert inv.chain(stranger) == [] and inv.chain_end(stranger) == 10**6 and stranger not in inv.chains


def test_chains_are_computed_once_per_inventory(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = inventory_module._all_chains

    def counting(*args: object) -> object:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(inventory_module, "_all_chains", counting)
    inv = Inventory(bases=[BaseName(0, 1), BaseName(4, 1)],
                    segments=[SegmentName(0, 2, 1), SegmentName(2, 4, 1), SegmentName(4, 6, 1)])
    assert calls == []  # lazily
    for _ in range(3):
        assert inv.chain_end(BaseName(0, 1)) == 6
        assert inv.durable_spans(1) == [(0, 6)]
        assert inv.newest_step(1) == 6
    assert calls == [1]
    chain = inv.chain(BaseName(0, 1))
    chain.clear()  # a copy: the cache is not the caller's to change
    assert inv.chain(BaseName(0, 1)) == [SegmentName(0, 2, 1), SegmentName(2, 4, 1), SegmentName(4, 6, 1)]
    with pytest.raises(TypeError):
        inv.chains[BaseName(0, 1)] = ()  # type: ignore[index]


def test_durable_ranges_and_candidates_use_the_spans() -> None:
    inv = Inventory(bases=[BaseName(0, 1), BaseName(6, 1), BaseName(20, 1), BaseName(0, 2)],
                    segments=[SegmentName(0, 3, 1), SegmentName(3, 8, 1), SegmentName(6, 9, 1),
                              SegmentName(20, 21, 1), SegmentName(0, 1, 2)])
    assert inv.durable_spans(1) == [(0, 9), (20, 21)]
    store = RunStore(None)  # type: ignore[arg-type]  # planning from an inventory reads nothing
    assert durable_ranges(store, inv) == "g1: 0..9, 20..21; g2: 0..1"
    plans = candidates(store, None, inv)
    assert [(p.base, p.target) for p in plans] == [(BaseName(0, 2), 1)]


class _Listing:
    """A run of which only a listing exists: enough to plan a garbage collection."""

    url = "memory://scale"

    def __init__(self, listing: dict[str, int]) -> None:
        self.listing = listing

    def list(self, prefix: str) -> dict[str, int]:
        return dict(self.listing)

    def read(self, path: str) -> bytes:
        raise FileNotFoundError(path)

    def write(self, path: str, data: object) -> None:
        raise AssertionError("planning writes nothing")

    def create(self, path: str, data: bytes) -> bool:
        raise AssertionError("planning writes nothing")

    def delete(self, path: str) -> None:
        raise AssertionError("planning deletes nothing")

    def exists(self, path: str) -> bool:
        return path in self.listing


@pytest.mark.parametrize("policy", [RetentionPolicy(), RetentionPolicy(keep_last_bases=2),
                                    RetentionPolicy(keep_every_n_steps=7),
                                    RetentionPolicy(keep_newer_than_s=3600)], ids=repr)
def test_planning_stays_linear_on_10k_segments_and_100_bases(policy: RetentionPolicy) -> None:
    listing = {"run.json": 10, "sessions/g000001.json": 10}
    for b in range(100):
        listing[BaseName(b * 100, 1).commit_path] = 100
        listing[BaseName(b * 100, 1).state_path] = 1000
    for after in range(10_000):
        listing[SegmentName(after, after + 1, 1).path] = 50
    start = time.perf_counter()
    plan = plan_gc(RunStore(_Listing(listing)), policy)  # type: ignore[arg-type]
    elapsed = time.perf_counter() - start
    # Linear planning takes well under a second here (a bound loose enough for a busy machine).
    assert elapsed < 8, f"planning took {elapsed:.1f}s"
    assert plan.kept[-1].step == 10_000
    if policy.keep_last_bases == 2:
        assert [b.step for b in plan.bases] == list(range(0, 9800, 100)) and len(plan.segments) == 9800
