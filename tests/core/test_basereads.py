"""Restore reads a base straight into the tensors that hold it (issue 37): the live parameters,
the optimizer state it hands the optimizers, or new tensors, by ranged reads in file order with
the checksum fed as they go; no whole-file buffer and no second copy. What it reads is bitwise
what ``unpack_tree`` of the whole file gives, on every kind of storage and destination, and
damage is found as before (named as damage, never as another model)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_runs import assert_state, base_dir, restore, train
from helpers import assert_bitwise_equal

from diffckpt import CorruptRecordError, basereads
from diffckpt.checksums import CURRENT
from diffckpt.storage import FsspecStorage
from diffckpt.tree import pack_tree, unpack_tree

STEPS = 13


class Counted:
    """A local storage that counts its reads (``read_into``, ``read_range``, ``read``)."""

    def __init__(self, root: str) -> None:
        self.inner = FsspecStorage(root)
        self.url = self.inner.url
        self.ranged = True
        self.calls: list[tuple[str, int]] = []

    def read_into(self, path: str, start: int, out: memoryview) -> int:
        self.calls.append(("read_into", out.nbytes))
        return self.inner.read_into(path, start, out)

    def read_range(self, path: str, start: int, end: int) -> bytes:
        self.calls.append(("read_range", end - start))
        return self.inner.read_range(path, start, end)

    def read(self, path: str) -> bytes:
        self.calls.append(("read", 0))
        return self.inner.read(path)


class Plain:
    """A caller's storage that reads whole objects only (no ``read_range``)."""

    def __init__(self) -> None:
        self.url = "memory://plain"
        self.objects: dict[str, bytes] = {}

    def write(self, path: str, data: bytes) -> None:
        self.objects[path] = data

    def read(self, path: str) -> bytes:
        return self.objects[path]


def _tree() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {"model": {"big": torch.randn(300, 1000, generator=gen),  # 1.2 MB: read in place
                      **{f"small{i}": torch.randn(i + 1, generator=gen) for i in range(40)},
                      "half": torch.randn(700, 1000, generator=gen).to(torch.bfloat16),
                      "empty": torch.empty(0, 3)},
            "optimizers": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(300, 1000)}},
                            "param_groups": [{"lr": 0.1, "params": [0]}]}],
            "state": {"x": 1}}


def _file(storage: Any, tree: dict[str, Any]) -> basereads.BaseFile:
    data = pack_tree(tree)
    (FsspecStorage(storage.url) if not isinstance(storage, Plain) else storage).write("state.safetensors", data)
    return basereads.BaseFile(storage, "state.safetensors", len(data), CURRENT, CURRENT.hexdigest(data))


@pytest.mark.parametrize("where", ["local", "memory", "plain"])
def test_a_base_filled_into_its_destinations_is_bitwise_the_file(tmp_path: Path, where: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Into live tensors (in place), a non-contiguous one (copied once verified) and new tensors;
    small spans batched into one read, large ones read in CHUNK pieces; on a local root, an
    fsspec store and a caller's storage without ranges."""
    monkeypatch.setattr(basereads, "CHUNK", 256 << 10)  # the 1.2 and 1.4 MB tensors in several pieces
    storage: Any = {"local": lambda: Counted(str(tmp_path)), "memory": lambda: FsspecStorage(f"memory://{tmp_path.name}"),
                    "plain": Plain}[where]()
    tree = _tree()
    state = _file(storage, tree)
    skel = state.skeleton
    assert skel["model"]["big"].device.type == "meta" and skel["state"] == {"x": 1}
    live = torch.zeros(300, 1000)
    twisted = torch.zeros(1000, 700, dtype=torch.bfloat16).t()  # not contiguous
    got = state.fill({id(skel["model"]["big"]): live, id(skel["model"]["half"]): twisted})
    assert_bitwise_equal(unpack_tree(pack_tree(tree)), got)
    assert got["model"]["big"] is live and got["model"]["half"] is twisted
    assert torch.equal(twisted, tree["model"]["half"])
    if where == "local":
        reads = [n for kind, n in storage.calls if kind == "read_into"]
        assert max(reads) <= 256 << 10  # never more than CHUNK at once
        small = sum(t.numel() * 4 for k, t in tree["model"].items() if k.startswith("small"))
        assert small < 256 << 10 and sum(n < 64 << 10 for n in reads) <= 3  # 42 small spans batched, not 42 reads
    if where == "plain":  # no ranges: one whole read, sliced
        assert state._whole is not None


@pytest.mark.parametrize("damage", ["truncated", "longer", "flipped data", "flipped header"])
def test_damage_is_found_and_named(tmp_path: Path, damage: str) -> None:
    storage = FsspecStorage(str(tmp_path))
    data = bytearray(pack_tree(_tree()))
    digest, size = CURRENT.hexdigest(bytes(data)), len(data)
    if damage == "truncated":
        data = data[: size // 2]
    elif damage == "longer":
        data += b"x"
    elif damage == "flipped data":
        data[-100] ^= 0xFF
    else:
        data[12] ^= 0xFF  # inside the JSON header
    storage.write("state.safetensors", bytes(data))
    expected = {"truncated": rf"size {size // 2}, expected {size}", "longer": f"longer than the {size} bytes",
                "flipped data": rf"its size, {size}, as recorded, but not its xxh3_128 digest",
                "flipped header": rf"its size, {size}, as recorded, but not its xxh3_128 digest"}[damage]
    with pytest.raises(CorruptRecordError, match=rf"state.safetensors fails its checksum \({expected}"):
        basereads.BaseFile(storage, "state.safetensors", size, CURRENT, digest).fill()


def _renamed_key(path: Path, old: str, new: str) -> None:
    """The base's tree names model key ``old`` as ``new`` (same length): a header that parses,
    and describes another model, as damage could."""
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack_from("<Q", data)
    header = bytes(data[8 : 8 + n]).replace(json.dumps(json.dumps(old))[1:-1].encode(),
                                            json.dumps(json.dumps(new))[1:-1].encode())
    assert len(header) == n and header != bytes(data[8 : 8 + n])
    data[8 : 8 + n] = header
    path.write_bytes(bytes(data))


def test_restore_reads_the_base_into_the_live_model_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    truth, _ = train(str(tmp_path / "run"), STEPS)
    seen: list[dict[int, torch.Tensor]] = []
    fill = basereads.BaseFile.fill

    def spy(self: basereads.BaseFile, into: dict[int, torch.Tensor] | None = None) -> Any:
        seen.append(dict(into or {}))
        return fill(self, into)

    monkeypatch.setattr(basereads.BaseFile, "fill", spy)
    result, m, o = restore(str(tmp_path / "run"), 10)
    assert result.base_step == 10 and len(seen) == 1
    live = {t.data_ptr() for t in m.state_dict().values()}
    assert {t.data_ptr() for t in seen[0].values()} == live  # every model tensor read in place
    assert_state(truth, result, m, o)


def test_a_header_that_reads_as_another_model_is_damage_and_an_older_base_is_used(tmp_path: Path) -> None:
    truth, _ = train(str(tmp_path / "run"), STEPS)
    _renamed_key(base_dir(tmp_path / "run", 10) / "state.safetensors", "0.weight", "0.weighX")
    with pytest.warns(UserWarning, match=r"000000000010.*fails its checksum.*older base at step 5"):
        result, m, o = restore(str(tmp_path / "run"))
    assert (result.step, result.base_step) == (STEPS, 5)
    assert_state(truth, result, m, o)


class _Hooked(torch.nn.Sequential):
    """A model whose load_state_dict hook sees what it is given: it is given a copy."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
        self.loaded: list[set[str]] = []
        self.register_load_state_dict_pre_hook(lambda module, sd, *_: self.loaded.append(set(sd)))


def test_a_model_with_load_hooks_is_loaded_through_them(tmp_path: Path) -> None:
    truth, _ = train(str(tmp_path / "run"), STEPS)

    def hooked() -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        m = _Hooked()
        return m, [torch.optim.AdamW(m.parameters(), lr=1e-2)]

    result, m, o = restore(str(tmp_path / "run"), 12, maker=hooked)
    assert m.loaded and "0.weight" in m.loaded[0]
    assert_state(truth, result, m, o)
