"""``diffckpt.checksums``: the hash algorithms (XXH3-128 now, SHA-256 for format 1), streaming over
buffers, and self-describing parameter fingerprints that are checked with the algorithm they name."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from diffckpt.checksums import (
    CURRENT,
    SHA256,
    XXH3_128,
    Algorithm,
    _tensor_parts,
    fingerprint,
    fingerprint_matches,
)
from diffckpt.errors import CorruptRecordError
from diffckpt.format import CHECKSUMS, FORMAT_VERSION, checksum_for

# XXH3-128 of no bytes, seed 0: xxHash's own sanity check (tests/sanity_test_vectors.h and
# cli/xsum_sanity_check.c, XSUM_XXH128_testdata: {0x6001C324468D497F, 0x99AA06D3014798D8},
# low 64 bits first; the hex digest is the high half first).
XXH3_128_EMPTY = "99aa06d3014798d86001c324468d497f"
# XXH3-128 of b"a", seed 0, as an integer: python-xxhash's tests/test_xxh3_128.py.
XXH3_128_A = 225219434562328483135862406050043285023
# SHA-256 of b"abc": FIPS 180-2, appendix B.1.
SHA256_ABC = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_known_vectors() -> None:
    assert XXH3_128.hexdigest(b"") == XXH3_128_EMPTY
    assert XXH3_128.digest(b"") == bytes.fromhex(XXH3_128_EMPTY)
    assert int(XXH3_128.hexdigest(b"a"), 16) == XXH3_128_A
    assert SHA256.hexdigest(b"abc") == SHA256_ABC
    assert (XXH3_128.digest_size, SHA256.digest_size) == (16, 32)
    assert (XXH3_128.key, SHA256.key) == ("xxh3_128", "sha256")


def test_formats_name_their_algorithm() -> None:
    assert CHECKSUMS == {1: SHA256, 2: XXH3_128, 3: XXH3_128, 4: XXH3_128}  # 3 moved the index, 4 split gradients
    assert CHECKSUMS[FORMAT_VERSION] is CURRENT is XXH3_128
    assert checksum_for(1, "x") is SHA256 and checksum_for(2, "x") is checksum_for(4, "x") is XXH3_128
    for version in (0, 5, 99, True, "2", None):
        with pytest.raises(CorruptRecordError, match=f"x format {version!r} is not one this diffckpt "
                           r"reads \(formats 1, 2, 3 and 4\); .*upgrade diffckpt"):
            checksum_for(version, "x")


@pytest.mark.parametrize("algorithm", [XXH3_128, SHA256], ids=lambda a: a.key)
def test_streaming_is_hashing_the_concatenation(algorithm: Algorithm) -> None:
    rng = np.random.default_rng(0)
    big = rng.integers(0, 256, 3 << 20, dtype=np.uint8)  # above the size where xxhash drops the GIL
    parts = [b"head", memoryview(b"")[:0], big.data, memoryview(bytes(range(200)))[10:90], b"x" * 70_000]
    whole = b"".join(bytes(p) for p in parts)
    assert algorithm.hash_parts(parts).hexdigest() == algorithm.hexdigest(whole)
    assert algorithm.hexdigest(*parts) == algorithm.hexdigest(whole)
    assert algorithm.digest(*parts) == bytes.fromhex(algorithm.hexdigest(whole))
    assert algorithm.hexdigest() == algorithm.hexdigest(b"")


@pytest.mark.parametrize("algorithm", [XXH3_128, SHA256], ids=lambda a: a.key)
def test_a_flipped_byte_changes_the_digest(algorithm: Algorithm) -> None:
    data = bytearray(np.random.default_rng(1).integers(0, 256, 1 << 17, dtype=np.uint8).tobytes())
    before = algorithm.hexdigest(bytes(data))
    for where in (0, len(data) // 2, len(data) - 1):
        for bit in (0x01, 0x80):
            data[where] ^= bit
            assert algorithm.hexdigest(bytes(data)) != before
            data[where] ^= bit
    assert algorithm.hexdigest(bytes(data)) == before
    assert algorithm.hexdigest(bytes(data[:-1])) != before  # truncated


PARAMS = [(torch.arange(6, dtype=torch.float32).reshape(2, 3) - 2) / 8, torch.tensor([0.5, -0.25])]


def _by_the_doc(tensors: list[torch.Tensor], new: Callable[[], Any]) -> str:
    """docs/format.md section 8: dtype and shape as text, then the raw bytes, per tensor."""
    h = new()
    for t in tensors:
        h.update(str((t.dtype, tuple(t.shape))).encode("ascii"))
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def test_fingerprints_describe_their_algorithm() -> None:
    import xxhash

    fp = fingerprint(PARAMS)
    assert fp == "xxh3-128:" + _by_the_doc(PARAMS, xxhash.xxh3_128)
    assert fp == "xxh3-128:0711a8a0cc841de4686850e6450f2b41"  # the golden base's (docs/format.md)
    prefix, hexdigest = fp.split(":")
    assert prefix == "xxh3-128" and len(hexdigest) == 32 and int(hexdigest, 16) >= 0
    assert fingerprint(iter(PARAMS)) == fp  # any iterable, consumed once
    assert fingerprint([]) == "xxh3-128:" + XXH3_128_EMPTY


def test_fingerprints_are_equal_iff_bitwise_equal() -> None:
    fp = fingerprint(PARAMS)
    assert fingerprint([t.clone() for t in PARAMS]) == fp
    assert fingerprint([PARAMS[0].t().contiguous().t(), PARAMS[1]]) == fp  # layout does not count
    assert fingerprint([PARAMS[0].reshape(3, 2), PARAMS[1]]) != fp  # same bytes, other shape
    assert fingerprint([PARAMS[0].double(), PARAMS[1]]) != fp
    assert fingerprint([torch.tensor([0.0])]) != fingerprint([torch.tensor([-0.0])])
    assert fingerprint(PARAMS[::-1]) != fp


def test_a_fingerprint_of_either_format_is_checked_with_its_own_algorithm() -> None:
    current = fingerprint(PARAMS)
    format1 = _by_the_doc(PARAMS, hashlib.sha256)  # what format 1 recorded: bare SHA-256 hex
    assert format1 == "b9992cece49168b4f248891dc1083b208f9c0e040f45c61091aa211d5b33c48d"
    for recorded in (current, format1):
        assert fingerprint_matches(PARAMS, recorded)
        assert fingerprint_matches(iter(PARAMS), recorded)
        changed = [PARAMS[0].clone(), PARAMS[1].clone()]
        changed[1].view(torch.uint8)[0] ^= 1  # one flipped bit in one byte
        assert not fingerprint_matches(changed, recorded)
    assert not fingerprint_matches(PARAMS, format1[:-1])  # a damaged record
    assert not fingerprint_matches(PARAMS, "xxh3-128:" + format1[:32])


def test_a_fingerprint_of_an_unknown_algorithm_is_refused() -> None:
    with pytest.raises(CorruptRecordError, match="'blake3:00ff' uses a hash this diffckpt does not know; "
                       "upgrade diffckpt"):
        fingerprint_matches(PARAMS, "blake3:00ff")


def test_contiguous_cpu_tensors_are_hashed_in_place() -> None:
    t = torch.arange(1 << 16, dtype=torch.float32)
    _, data = list(_tensor_parts([t]))
    assert isinstance(data, memoryview) and data.nbytes == t.numel() * 4
    assert np.frombuffer(data, dtype=np.uint8).ctypes.data == t.data_ptr()  # no copy
    empty = list(_tensor_parts([torch.zeros(0, 3)]))
    assert empty == [b"(torch.float32, (0, 3))"]  # an empty tensor adds its text only
