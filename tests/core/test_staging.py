"""The host stage's pinned memory (``diffckpt/staging.py``), on the CPU: the bound derived from the
machine, the bytes counted as torch's host allocator takes them, and a pool that grows to the
largest record it staged and no further (``pin=False``: the same pool without page-locking)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from diffckpt.staging import (
    PINNED_CAP,
    PINNED_UNKNOWN,
    HostStage,
    PinnedPool,
    memory_limit,
    pinned_bound,
    pinned_size,
)

GiB = 1 << 30


def test_the_bound_is_a_quarter_of_the_memory_at_most_the_cap() -> None:
    assert pinned_bound(8 * GiB) == 2 * GiB
    assert pinned_bound(1024 * GiB) == PINNED_CAP == 16 * GiB
    assert pinned_bound(None) == PINNED_UNKNOWN == 512 << 20


def test_the_memory_is_the_machines_or_a_containers_limit_when_lower(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    machine = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    unlimited, limited, missing = tmp_path / "memory.max", tmp_path / "limit_in_bytes", tmp_path / "absent"
    unlimited.write_text("max\n")
    limited.write_text(f"{GiB}\n")
    assert memory_limit([str(unlimited), str(missing)]) == machine
    assert memory_limit([str(unlimited), str(limited)]) == min(machine, GiB)

    def unknown(name: str) -> int:
        raise ValueError(name)

    monkeypatch.setattr(os, "sysconf", unknown)
    assert memory_limit([str(limited)]) == GiB
    assert memory_limit([str(missing)]) is None


def test_pinned_bytes_are_counted_as_torch_rounds_them() -> None:
    assert [pinned_size(n) for n in (0, 1, 3, 4096, 4097)] == [0, 1, 4, 4096, 8192]


def test_the_stage_takes_the_machines_bound_unless_given_one() -> None:
    assert HostStage().pool.capacity == pinned_bound(memory_limit())
    assert HostStage(pinned_bytes=1 << 20).pool.capacity == 1 << 20


def test_the_pool_grows_to_the_largest_record_and_no_further() -> None:
    """A record at a time (the writer stages one, writes it, releases its buffers): the pool holds
    the buffers of the largest one, reused by shape and dtype, and past its bound lends ordinary
    memory that it does not keep."""
    pool = PinnedPool(capacity=1024, pin=False)

    def stage(*likes: torch.Tensor) -> list[torch.Tensor]:
        buffers = [pool.take(t) for t in likes]
        pool.give_back(buffers)
        return buffers

    small = [torch.zeros(24, dtype=torch.bfloat16), torch.zeros(10)]  # 48 and 40 bytes: 64 + 64 pinned
    first = stage(*small)
    assert pool.held == 128
    assert [b.data_ptr() for b in stage(*small)] == [b.data_ptr() for b in first]  # reused, no growth
    larger = stage(*small, torch.zeros(100))  # a record with one more gradient: 400 bytes -> 512
    assert pool.held == 640 and larger[0] is first[0]
    past = stage(*small, torch.zeros(100), torch.zeros(200, dtype=torch.bfloat16))  # 400 -> 512 more: past 1024
    assert pool.held == 640
    assert pool.take(torch.zeros(200, dtype=torch.bfloat16)) is not past[-1]  # not kept
