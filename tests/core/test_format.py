"""Golden-file tests of the on-storage format (``docs/format.md``).

The files under ``tests/golden/`` were written by ``tests/golden/make_golden.py``. These tests
check that the current code (a) still writes exactly those bytes, (b) still reads them back to the
same values, (c) lays them out as ``docs/format.md`` says (checked by an independent reader that
uses only json/struct/xxhash), (d) reports damage precisely, (e)-(f) round-trips every supported
type of the tree encoding and refuses the rest. These are the format-3 files; the format-1 and
format-2 ones under ``tests/golden/v1/`` and ``tests/golden/v2/`` are checked by
``test_format_v1.py`` and ``test_format_v2.py``.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import math
import random
import re
import shutil
import struct
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from engine_runs import build_segment, segment_entries

from diffckpt import planning
from diffckpt.checksums import fingerprint
from diffckpt.errors import (
    CheckpointNotFoundError,
    CorruptRecordError,
    IncompatibleCheckpointError,
    UnsupportedConfigurationError,
)
from diffckpt.format import FORMAT_VERSION, BaseName, SegmentName, decode_commit, encode_commit
from diffckpt.loading import load_state
from diffckpt.options import CheckpointOptions
from diffckpt.runstore import RunStore
from diffckpt.segment import (
    SEGMENT_MAGIC,
    SegmentEncoder,
    decode_segment,
    encode_segment,
    index_length,
    lead_length,
    parse_index,
)
from diffckpt.storage import FsspecStorage
from diffckpt.tree import decode_tree, pack_tree, read_metadata, unpack_tree
from diffckpt.writer import BackgroundWriter

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
RUN = GOLDEN / "run"
DOC = ROOT / "docs" / "format.md"
SEG1 = "run/diffs/000000000000-000000000002.g000001.seg"
SEG2 = "run/diffs/000000000002-000000000004.g000001.seg"
BASE_STATE = "run/bases/000000000000.g000001/state.safetensors"
BASE_COMMIT = "run/bases/000000000000.g000001/COMMIT"


def _load_generator() -> Any:
    spec = importlib.util.spec_from_file_location("diffckpt_make_golden", GOLDEN / "make_golden.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


mg = _load_generator()


def golden(rel: str) -> bytes:
    return (GOLDEN / rel).read_bytes()


def assert_same(a: Any, b: Any, path: str = "$") -> None:
    """Deep equality that also checks types, float signs/NaN, tensor and array dtypes."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{path}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        if a.dtype.is_floating_point or a.dtype.is_complex:
            # bitwise, so NaN and -0.0 count
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
        else:
            assert torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert len(a) == len(b), f"{path}: keys {list(a)} vs {list(b)}"
        for (ka, va), (kb, vb) in zip(a.items(), b.items()):
            assert_same(ka, kb, f"{path}.key")
            assert_same(va, vb, f"{path}[{ka!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: lengths {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, (float, np.floating)):
        if math.isnan(a):
            assert math.isnan(b), path
        else:
            assert struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a!r} vs {b!r}"
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


# =========================================================================================
# (a) the current code writes exactly the golden bytes
# =========================================================================================
@pytest.mark.parametrize("rel", mg.PINNED)
def test_reencoding_is_byte_identical(rel: str) -> None:
    produced = mg.golden_files()[rel]
    assert produced == golden(rel), (
        f"tests/golden/{rel} is no longer reproduced byte for byte: the on-storage format changed. "
        "If deliberate, bump FORMAT_VERSION when old files read differently, regenerate with "
        "`python tests/golden/make_golden.py` and update docs/format.md")


def test_real_writer_produces_the_golden_run(tmp_path: Path) -> None:
    """The background writer (buffer deltas, fingerprints, segment cuts) writes the same bytes."""
    store = RunStore(FsspecStorage(str(tmp_path)))
    options = CheckpointOptions(write_batch=2, compression="none", base_every_n_steps=None,
                                fingerprint_every_n_steps=2)
    # The golden records hold float32 gradients as written; narrowing bfloat16-valued ones to 16
    # bits is the writer's policy on top of the format (tested with real runs), not pinned here.
    writer = BackgroundWriter(store, mg.GEN, options, after=0, narrow_grads=False)
    tree = mg.base_tree()
    writer.put_base(0, tree, [tree["model"][n] for n in mg.PARAM_NAMES], 0)
    for record in mg.engine_records():
        writer.put_record(record, 0)
    assert writer.close() == 4
    written = {p: (tmp_path / p).read_bytes() for p in store.storage.list("")}
    expected = {rel.removeprefix("run/"): golden(rel) for rel in mg.PINNED if rel.startswith("run/")}
    assert sorted(written) == sorted(expected)
    for path, data in expected.items():
        assert written[path] == data, f"writer output differs from golden {path}"


def test_golden_files_are_small() -> None:
    total = sum(p.stat().st_size for p in GOLDEN.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert total < 125_000  # the format-4 files, the fixtures of formats 1 to 3 and the CLI outputs


# =========================================================================================
# (b) decoding the golden files gives the expected values
# =========================================================================================
def test_tree_golden_decodes() -> None:
    assert_same(unpack_tree(golden("tree.safetensors")), mg.all_tags_tree())


@pytest.mark.parametrize("index, rel", [(0, SEG1), (1, SEG2)])
def test_segment_golden_decodes(index: int, rel: str) -> None:
    name, header, records = mg.segment_inputs()[index]
    decoded_header, decoded, problem = decode_segment(golden(rel), rel)
    assert problem is None
    assert {k: decoded_header[k] for k in ("gen", "after", "last")} == header
    assert decoded_header["format"] == FORMAT_VERSION and decoded_header["compression"] == "none"
    assert [e["step"] for e in decoded_header["records"]] == [r["step"] for r in records]
    assert_same(decoded, records)
    assert SegmentName.parse(rel.removeprefix("run/")) == name


def test_zstd_segment_decodes() -> None:
    _, _, records = mg.segment_inputs()[0]
    header, decoded, problem = decode_segment(golden("segment-zstd.seg"))
    assert problem is None and header["compression"] == "zstd"
    assert_same(decoded, records)
    none_header, _, _ = decode_segment(golden(SEG1))
    assert [e["raw_length"] for e in header["records"]] == [e["length"] for e in none_header["records"]]
    for e in header["records"]:
        assert e["length"] < e["raw_length"]


def test_record_contents_match_the_documented_shape() -> None:
    _, records, _ = decode_segment(golden(SEG1))
    _, more, _ = decode_segment(golden(SEG2))
    records += more
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["prev"] for r in records] == [0, 1, 2, 3]
    for r in records:
        assert list(r)[:6] == ["step", "prev", "events", "param_groups", "buffers", "state"]
    # buffers: all after the base, then only those that changed
    assert [sorted(r["buffers"]) for r in records] == [
        ["count", "scale"], ["count", "scale"], ["count"], ["count"]]
    assert [r["state"] is None for r in records] == [True, False, False, False]
    assert [len(r["events"]) for r in records] == [1, 1, 0, 1]
    assert records[1]["events"][0]["grads"][0][1] is None  # parameter without gradient
    assert records[3]["events"][0]["groups"][0]["lr"] == 0.25  # in force for the step
    assert records[3]["param_groups"][0][0]["lr"] == 0.125  # after the scheduler stepped
    assert ["fingerprint" in r for r in records] == [False, True, False, True]
    sim = mg.simulate()
    for r in (records[1], records[3]):
        assert r["fingerprint"] == _fingerprint_by_the_doc([sim[r["step"]][n] for n in mg.PARAM_NAMES])


def _fingerprint_by_the_doc(tensors: list[torch.Tensor]) -> str:
    """Section 8 of docs/format.md, written independently of diffckpt.checksums."""
    h = xxhash.xxh3_128()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode("ascii"))
        h.update(t.numpy().astype(t.numpy().dtype.newbyteorder("<"), copy=False).tobytes())
    return "xxh3-128:" + h.hexdigest()


def test_fingerprint_definition() -> None:
    params = mg.initial_params()
    tensors = [params[n] for n in mg.PARAM_NAMES]
    assert fingerprint(tensors) == _fingerprint_by_the_doc(tensors)
    assert fingerprint(tensors) == "xxh3-128:0711a8a0cc841de4686850e6450f2b41"
    manual = xxhash.xxh3_128(b"(torch.float32, (2, 3))" + tensors[0].numpy().tobytes()
                             + b"(torch.float32, (2,))" + tensors[1].numpy().tobytes()).hexdigest()
    assert fingerprint(tensors) == "xxh3-128:" + manual
    assert fingerprint([torch.zeros(0)]) == "xxh3-128:" + xxhash.xxh3_128(b"(torch.float32, (0,))").hexdigest()
    assert fingerprint([torch.tensor(1.0, dtype=torch.bfloat16)]) == "xxh3-128:" + xxhash.xxh3_128(
        b"(torch.bfloat16, ())" + bytes([0x80, 0x3F])).hexdigest()


def test_base_and_commit_golden_decode() -> None:
    info = decode_commit(golden(BASE_COMMIT), BASE_COMMIT)
    state = golden(BASE_STATE)
    assert info == {"step": 0, "gen": 1, "format": FORMAT_VERSION,
                    "fingerprint": fingerprint([mg.initial_params()[n] for n in mg.PARAM_NAMES]),
                    "files": {"state.safetensors": {"size": len(state),
                                                    "xxh3_128": xxhash.xxh3_128(state).hexdigest()}}}
    store = RunStore(FsspecStorage(str(RUN)))
    loaded_info, tree = store.load_base(BaseName(0, 1))
    assert loaded_info == info
    assert_same(tree, mg.base_tree())


def test_golden_run_restores_by_replay() -> None:
    sim = mg.simulate()
    for step in (None, 4, 3, 2, 0):
        result = load_state(str(RUN), step)
        expected_step = 4 if step is None else step
        assert result["step"] == expected_step and result["base_step"] == 0
        assert result["replayed"] == expected_step
        for name in mg.PARAM_NAMES:
            assert torch.equal(result["model"][name], sim[expected_step][name]), name
        buffers = mg.buffers_at(expected_step) if expected_step else mg.initial_buffers()
        for name, value in buffers.items():
            assert torch.equal(result["model"][name], value), name
        expected_state = mg.base_tree()["state"] if expected_step == 0 else mg._STEPS[expected_step][2]
        assert result["state"] == expected_state
    with pytest.raises(CheckpointNotFoundError):
        load_state(str(RUN), 5)


def test_sharded_golden_run_reassembles_the_full_tensors() -> None:
    """Both rank streams of ``sharded/``, replayed and put together by their shard tables, give
    the full tensors of the unsharded run at every restorable step (SGD is elementwise)."""
    sim = mg.simulate()
    for step in (None, 4, 2, 0):
        result = load_state(str(GOLDEN / "sharded"), step)
        expected_step = 4 if step is None else step
        assert result["step"] == expected_step
        for name in mg.PARAM_NAMES:
            assert torch.equal(result["model"][name], sim[expected_step][name]), name
        buffers = mg.buffers_at(expected_step) if expected_step else mg.initial_buffers()
        for name, value in buffers.items():
            assert torch.equal(result["model"][name], value), name
        assert result["state"]["ranks"] == [{"rank": 0}, None]  # rank 0's own record
        momentum = result["optimizers"][0]["state"]
        if expected_step:
            assert [tuple(momentum[i]["momentum_buffer"].shape) for i in (0, 1)] == [(2, 3), (2,)]
        assert [p[1] for p in result["parameters"]] == [[2, 3], [2]]
    with pytest.raises(CheckpointNotFoundError, match="not durable on every rank"):
        load_state(str(GOLDEN / "sharded"), 5)


def test_sharded_golden_run_restores_into_an_unsharded_module(tmp_path: Path) -> None:
    """``CheckpointEngine.restore`` (one process, a plain module) rebuilds a sharded run's step."""
    from diffckpt import CheckpointEngine

    shutil.copytree(GOLDEN / "sharded", tmp_path / "run")
    module = torch.nn.Linear(3, 2)
    module.register_buffer("count", torch.tensor(0))
    module.register_buffer("scale", torch.ones(2))
    opt = torch.optim.SGD(module.parameters(), **mg._hyper(0.5))
    result = CheckpointEngine(str(tmp_path / "run")).restore(module, [opt], 4)
    assert result.step == 4
    sim = mg.simulate()
    assert torch.equal(module.weight.detach(), sim[4]["weight"]) and torch.equal(module.bias.detach(), sim[4]["bias"])
    assert torch.equal(module.scale, mg.buffers_at(4)["scale"])
    with pytest.raises(IncompatibleCheckpointError, match="'count' is in the checkpoint, not in this model"):
        CheckpointEngine(str(tmp_path / "run")).restore(torch.nn.Linear(3, 2), [torch.optim.SGD(module.parameters())])


def test_sharded_golden_sessions_follow_the_documented_schema() -> None:
    from diffckpt.sharding import slice_of

    root = json.loads((GOLDEN / "sharded/sessions/g000001.json").read_text())
    assert root["sharded"] == {"world_size": 2, "streams": "ranks/r<rank:05d>/"}
    params = mg.initial_params()
    for rank in (0, 1):
        meta = json.loads((GOLDEN / f"sharded/ranks/r{rank:05d}/sessions/g000001.json").read_text())
        assert meta["rank"] == rank and meta["world_size"] == 2
        for name, entry in meta["shards"].items():
            assert set(entry) == {"shape", "dtype", "placements", "mesh", "coord", "local_shape", "offset"}
            full = params[name]
            index = slice_of(entry["shape"], entry["mesh"], entry["coord"], entry["placements"])
            assert [s.start for s in index] == entry["offset"]
            assert [s.stop - s.start for s in index] == entry["local_shape"] == list(full[index].shape)
        base = unpack_tree(golden(f"sharded/ranks/r{rank:05d}/bases/000000000000.g000001/state.safetensors"))
        for name in mg.PARAM_NAMES:  # a stream's base holds its pieces, as plain tensors
            assert torch.equal(base["model"][name], params[name][slice_of(params[name].shape, [2], [rank], ["Shard(0)"])])


def test_non_restorable_step_is_refused() -> None:
    with pytest.raises(CheckpointNotFoundError):
        load_state(str(RUN), 1)


# =========================================================================================
# (c) the layout is as docs/format.md states: an independent reader
# =========================================================================================
_SAFETENSORS_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "C64": torch.complex64,
}


def _read_tree_buffer(buf: bytes) -> tuple[Any, dict[str, torch.Tensor], list[str]]:
    """Section 5.1 with struct/json only: return (structure, tensors by name, header key order)."""
    (m,) = struct.unpack_from("<Q", buf, 0)
    assert (8 + m) % 8 == 0, "header is padded to a multiple of 8"
    raw_header = buf[8 : 8 + m]
    assert raw_header == raw_header.rstrip(b" ") + b" " * (len(raw_header) - len(raw_header.rstrip(b" ")))
    header = json.loads(raw_header)
    assert list(header["__metadata__"]) == ["diffckpt.tree"]
    data = buf[8 + m :]
    tensors = {}
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, stop = entry["data_offsets"]
        dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
        chunk = bytearray(data[begin:stop])
        t = torch.frombuffer(chunk, dtype=dtype) if chunk else torch.empty(0, dtype=dtype)
        tensors[name] = t.reshape(entry["shape"])
        end = max(end, stop)
    assert end == len(data), "data section is exactly the tensors"
    assert sorted(tensors, key=int) == [str(i) for i in range(len(tensors))], "names are 0..n-1"
    return json.loads(header["__metadata__"]["diffckpt.tree"]), tensors, list(header)


def _decode_by_the_doc(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Section 5.2 decoding rules, written independently of diffckpt.tree."""
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [_decode_by_the_doc(v, tensors) for v in node]
    tag = next(iter(node))
    assert len(node) == (2 if tag == "npscalar" else 1)
    value = node[tag]
    if tag == "dict":
        out = {}
        for k, v in value:
            k = _decode_by_the_doc(k, tensors)
            out[k] = _decode_by_the_doc(v, tensors)
        return out
    if tag == "tuple":
        return tuple(_decode_by_the_doc(v, tensors) for v in value)
    if tag == "tensor":
        return tensors[value]
    if tag == "ndarray":
        return tensors[value].numpy()
    if tag == "npscalar":
        assert list(node) == ["npscalar", "value"]
        return np.dtype(value).type(_decode_by_the_doc(node["value"], tensors))
    if tag == "float":
        assert value in ("inf", "-inf", "nan")
        return float(value)
    if tag == "bytes":
        return base64.b64decode(value, validate=True)
    if tag == "dtype":
        return getattr(torch, value)
    if tag == "device":
        return torch.device(value)
    raise AssertionError(f"undocumented tag {tag}")


def _read_segment_by_the_doc(data: bytes) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
    """Section 4 (formats 3 and 4) with struct/json/xxhash only: return (lead, index, records)."""
    assert data[0:8] == bytes.fromhex("44434b5345470001")
    (lead_len,) = struct.unpack("<I", data[8:12])
    lead_bytes = data[12 : 12 + lead_len]
    lead = json.loads(lead_bytes)
    assert json.dumps(lead, separators=(",", ":"), sort_keys=True).encode() == lead_bytes
    assert lead["format"] == 4
    (index_len,) = struct.unpack("<I", data[-20:-16])
    index_bytes = data[-20 - index_len : -20]
    index = json.loads(index_bytes)
    assert json.dumps(index, separators=(",", ":"), sort_keys=True).encode() == index_bytes
    # the digest covers the lead, then the index and its length
    assert xxhash.xxh3_128(data[: 12 + lead_len] + data[-20 - index_len : -16]).digest() == data[-16:]
    offset = 12 + lead_len
    records = []
    for entry in index["records"]:
        assert list(entry) == ["length", "raw_length", "step", "xxh3_128"]
        blob = data[offset : offset + entry["length"]]
        assert xxhash.xxh3_128(blob).hexdigest() == entry["xxh3_128"]
        if lead["compression"] == "none":
            assert entry["raw_length"] == entry["length"]
        else:
            import zstandard
            blob = zstandard.ZstdDecompressor().decompress(blob)
            assert len(blob) == entry["raw_length"]
        structure, tensors, _ = _read_tree_buffer(blob)
        record = _decode_by_the_doc(structure, tensors)
        assert record["step"] == entry["step"]
        records.append(record)
        offset += entry["length"]
    assert offset == len(data) - 20 - index_len, "nothing between the last record and the index"
    return lead, index, records


@pytest.mark.parametrize("rel", [SEG1, SEG2, "segment-zstd.seg"])
def test_independent_reader_agrees(rel: str) -> None:
    lead, index, records = _read_segment_by_the_doc(golden(rel))
    assert list(lead) == ["after", "compression", "format", "gen"] and list(index) == ["last", "records"]
    header, expected, _ = decode_segment(golden(rel))
    assert header == {**lead, **index}
    assert_same(records, expected)
    # and a writer by the doc, given the same lead, blobs and index, writes the same bytes
    blobs = [golden(rel)[o : o + n] for _, o, n in _blob_offsets(golden(rel))]
    assert build_segment(lead, blobs, index) == golden(rel)


def test_independent_tree_reader_agrees() -> None:
    structure, tensors, keys = _read_tree_buffer(golden("tree.safetensors"))
    assert keys[0] == "__metadata__"
    assert_same(_decode_by_the_doc(structure, tensors), mg.all_tags_tree())
    structure, tensors, _ = _read_tree_buffer(golden(BASE_STATE))
    assert_same(_decode_by_the_doc(structure, tensors), mg.base_tree())


def test_segment_bytes_at_documented_offsets() -> None:
    """The worked example of docs/format.md section 4, offset by offset."""
    data = golden(SEG1)
    assert data[:8] == SEGMENT_MAGIC == b"DCKSEG\x00\x01"
    assert data[8:12] == bytes([0x33, 0x00, 0x00, 0x00])  # L = 51, little-endian
    assert data[12:0x3F] == b'{"after":0,"compression":"none","format":4,"gen":1}'  # 12 .. 12 + L - 1
    assert data[0x3F:0x47] == struct.pack("<Q", 952)  # first blob: its safetensors length
    assert (8 + 952) % 64 == 0  # its tensor data start on a 64-byte line (section 5.1)
    assert data[0x47:0x59] == b'{"__metadata__":{"'
    assert read_metadata(data[0x42F : 0x42F + 1128])["diffckpt.tree"].startswith('{"dict":[["step",2]')
    assert data[0x897 : 0x897 + 21] == b'{"last":2,"records":[' and data[0x95E:0x95F] == b"}"
    assert data[0x95F:0x963] == struct.pack("<I", 200)  # I = 0x95F - 0x897
    assert len(data) == 0x973 == 2419 == 12 + 51 + 1008 + 1128 + 200 + 4 + 16
    assert data[0x963:] == xxhash.xxh3_128(data[:0x3F] + data[0x897:0x963]).digest()


def test_doc_hex_dump_matches_golden() -> None:
    text = DOC.read_text()
    blocks = re.findall(r"<!-- golden-hexdump: (\S+) -->\n```text\n(.*?)```", text, re.DOTALL)
    assert blocks, "docs/format.md lost its golden hex dump"
    shown: dict[str, set[int]] = {}
    for rel, block in blocks:
        data = golden(rel)
        for line in block.strip().splitlines():
            m = re.match(r"^([0-9a-f]{8})  ((?:[0-9a-f]{2} {1,2})*[0-9a-f]{2})\s+\|", line)
            assert m, line
            offset = int(m[1], 16)
            hexbytes = bytes.fromhex(m[2].replace(" ", ""))
            assert data[offset : offset + len(hexbytes)] == hexbytes, f"doc hex dump line {m[1]}"
            shown.setdefault(rel, set()).update(range(offset, offset + len(hexbytes)))
    # the example shows both ends of the segment: the lead, and the index, its length and digest
    data = golden(SEG1)
    end = set(range(len(data) - index_length(data, SEG1), len(data)))
    assert set(range(lead_length(data, SEG1))) | end <= shown[SEG1], "the doc's dumps lost an end"


def test_commit_bytes_are_as_documented() -> None:
    data = golden(BASE_COMMIT)
    info = json.loads(data)
    assert data == json.dumps(info, indent=1, sort_keys=True).encode()
    assert not data.endswith(b"\n")
    assert sorted(info) == ["files", "fingerprint", "format", "gen", "step"]
    assert encode_commit({k: v for k, v in info.items() if k != "format"}) == data
    assert data.decode() in DOC.read_text(), "the COMMIT example in docs/format.md is stale"


def test_kept_marker_bytes_and_name_are_as_documented() -> None:
    """Section 9a's example: the marker of ``saved as best.ckpt`` at step 3 of session 1; the
    name is XXH3-128 of ``why`` in UTF-8, computed here with xxhash itself."""
    import xxhash

    from diffckpt.keptsteps import decode_kept, encode_kept, is_kept_path, kept_path

    why = "saved as best.ckpt"
    path, data = kept_path(why), encode_kept(1, 3, why)
    assert path == f"kept/{xxhash.xxh3_128(why.encode()).hexdigest()}.json" and is_kept_path(path)
    assert not is_kept_path("kept/.x.json.1234abcd.tmp") and not is_kept_path("kept/a/b.json")
    assert json.loads(data) == {"format": 4, "gen": 1, "step": 3, "why": why}
    assert decode_kept(data, path).step == 3
    assert f"{path}\n{data.decode()}" in DOC.read_text(), "the kept marker example in docs/format.md is stale"


def test_names_and_run_layout() -> None:
    assert SegmentName(0, 2, 1).path == "diffs/000000000000-000000000002.g000001.seg"
    assert BaseName(0, 1).commit_path == "bases/000000000000.g000001/COMMIT"
    assert BaseName(12, 3).state_path == "bases/000000000012.g000003/state.safetensors"
    assert SegmentName.parse("diffs/000000000002-000000000004.g000001.seg") == SegmentName(2, 4, 1)
    assert BaseName.parse("bases/000000000000.g000001/COMMIT") == BaseName(0, 1)
    for bad in ("diffs/00000000002-000000000004.g000001.seg", "diffs/000000000002-000000000004.g1.seg",
                "diffs/000000000002-000000000004.g000001.seg.tmp",
                "x/diffs/000000000002-000000000004.g000001.seg",
                "bases/000000000000.g000001/state.safetensors", "bases/000000000000.g000001/COMMIT.tmp"):
        assert SegmentName.parse(bad) is None and BaseName.parse(bad) is None, bad
    store = RunStore(FsspecStorage(str(RUN)))
    inv = store.inventory()
    assert inv.bases == [BaseName(0, 1)]
    assert inv.segments == [SegmentName(0, 2, 1), SegmentName(2, 4, 1)]
    assert list(inv.sessions) == [1]
    assert inv.chain(BaseName(0, 1)) == inv.segments
    plan = planning.plan(store)
    assert (plan.base, plan.segments, plan.target, plan.latest) == (BaseName(0, 1), inv.segments, 4, True)
    assert planning.plan(store, 2).segments == [SegmentName(0, 2, 1)]
    assert store.session_meta(1)["parameters"] == [["weight", [2, 3]], ["bias", [2]]]


def _copy_run(tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(RUN, dst)
    return dst


def test_readers_ignore_dot_files_uncommitted_bases_and_gaps(tmp_path: Path) -> None:
    run = _copy_run(tmp_path)
    seg = golden(SEG2)
    (run / "diffs" / ".000000000004-000000000006.g000001.seg.0a1b2c3d.tmp").write_bytes(seg)
    (run / "bases" / "000000000004.g000001").mkdir()
    (run / "bases" / "000000000004.g000001" / "state.safetensors").write_bytes(golden(BASE_STATE))
    (run / "bases" / "000000000004.g000001" / ".COMMIT.deadbeef.tmp").write_bytes(golden(BASE_COMMIT))
    (run / "diffs" / "000000000005-000000000006.g000001.seg").write_bytes(seg)  # after a gap
    (run / "diffs" / "000000000004-000000000006.g000002.seg").write_bytes(seg)  # other session
    store = RunStore(FsspecStorage(str(run)))
    inv = store.inventory()
    assert inv.bases == [BaseName(0, 1)]
    assert not any(p.rsplit("/", 1)[-1].startswith(".") for p in inv.sizes)
    plan = planning.plan(store)
    assert (plan.base, plan.target) == (BaseName(0, 1), 4)
    assert plan.segments == [SegmentName(0, 2, 1), SegmentName(2, 4, 1)]


def test_newest_generation_with_a_base_wins_for_last(tmp_path: Path) -> None:
    run = _copy_run(tmp_path)
    (run / "sessions" / "g000003.json").write_text("{}")  # a session that never committed a base
    newer = run / "bases" / "000000000002.g000002"
    newer.mkdir()
    (newer / "state.safetensors").write_bytes(golden(BASE_STATE))
    (newer / "COMMIT").write_bytes(golden(BASE_COMMIT))
    store = RunStore(FsspecStorage(str(run)))
    plan = planning.plan(store)
    assert (plan.base, plan.segments, plan.target) == (BaseName(2, 2), [], 2)
    # an explicit step only gen 1 has is still found, newest generation first
    assert planning.plan(store, 4).base == BaseName(0, 1)


# =========================================================================================
# (d) corruption
# =========================================================================================
def _flip(data: bytes, offset: int) -> bytes:
    return data[:offset] + bytes([data[offset] ^ 0xFF]) + data[offset + 1 :]


def _blob_offsets(data: bytes) -> list[tuple[int, int, int]]:
    """``(step, offset, length)`` of each record blob of an intact segment of any format."""
    return [(e["step"], offset, e["length"]) for e, offset in segment_entries(data)]


@pytest.mark.parametrize("rel", [SEG1, "segment-zstd.seg"])
def test_flipped_byte_keeps_good_records_and_names_the_bad_step(rel: str) -> None:
    data = golden(rel)
    (step1, off1, _len1), (step2, off2, len2) = _blob_offsets(data)
    _, expected, _ = decode_segment(data)
    for where in (off2, off2 + len2 // 2, off2 + len2 - 1):
        _, records, problem = decode_segment(_flip(data, where), "seg")
        assert_same(records, expected[:1])
        assert problem is not None and f"step {step2}" in problem and "checksum" in problem
    _, records, problem = decode_segment(_flip(data, off1 + 100), "seg")
    assert records == [] and problem is not None and f"step {step1}" in problem


def test_a_flipped_digest_keeps_all_records_but_reports() -> None:
    data = golden(SEG1)
    for where in range(len(data) - 16, len(data)):
        _, records, problem = decode_segment(_flip(data, where), "seg")
        assert len(records) == 2 and problem is not None and "checksum does not match" in problem


def test_a_damaged_lead_or_index_makes_the_segment_unusable() -> None:
    """Every byte of the lead and of the index (with its length) is needed to find the records:
    damage there is an error for the whole segment, never a guess (its digest is not needed to
    tell: a flipped byte there is invalid UTF-8 JSON or a length that points elsewhere)."""
    data = golden(SEG1)
    lead, end = lead_length(data, SEG1), index_length(data, SEG1)
    for where in range(8, lead):
        with pytest.raises(CorruptRecordError, match="seg: segment header is damaged or truncated"):
            decode_segment(_flip(data, where), "seg")
    for where in range(len(data) - end, len(data) - 16):
        with pytest.raises(CorruptRecordError, match="seg: segment index is damaged or truncated"):
            decode_segment(_flip(data, where), "seg")


def test_a_truncated_segment_has_lost_its_index() -> None:
    """The index is at the end: a segment cut anywhere (or with bytes appended) has none, so it
    is unusable as a whole and restore falls back to the step before it. Formats 1 and 2 kept
    the records before the cut (``test_format_v2.py``)."""
    data = golden(SEG1)
    lead = lead_length(data, SEG1)
    for cut in range(len(data)):
        expected = ("not a diffckpt segment" if cut < 12 else "segment header is damaged or truncated"
                    if cut < lead else "segment index is damaged or truncated")
        with pytest.raises(CorruptRecordError, match=expected):
            decode_segment(data[:cut], "seg")
    for extra in (b"\x00", b"\x00" * 16, data[-20:]):
        with pytest.raises(CorruptRecordError, match="segment index is damaged or truncated"):
            decode_segment(data + extra, "seg")


@pytest.mark.parametrize("rel", [SEG1, "segment-zstd.seg"])
def test_a_segment_is_read_by_ranges(rel: str) -> None:
    """Section 4's ranged reading: the lead (its length from the first 12 bytes), the end (its
    length from the last 20), then each record at its span; nothing else is read."""
    data = golden(rel)
    head = data[: lead_length(data[:12], rel)]
    tail = data[len(data) - index_length(data[-20:], rel) :]
    index = parse_index(head, tail, len(data), rel)
    header, expected, _ = decode_segment(data, rel)
    assert index.problem is None and index.header == header
    assert [(e["step"], o, e["length"]) for e, o in index.spans] == _blob_offsets(data)
    assert_same([index.decode(e, data[o : o + e["length"]]) for e, o in index.spans], expected)
    entry, offset = index.spans[1]
    with pytest.raises(CorruptRecordError, match=f"{rel}: record for step 2 fails its checksum"):
        index.decode(entry, _flip(data[offset : offset + entry["length"]], 7))


def test_the_encoder_streams_the_golden_segment_record_by_record() -> None:
    """The writer's way: the lead comes with the first record's bytes, each record's bytes as it
    arrives (the record is not kept), the index last; together they are the golden bytes."""
    _, header, records = mg.segment_inputs()[0]
    data = golden(SEG1)
    encoder = SegmentEncoder({"after": header["after"], "gen": header["gen"]}, "none", 1)
    first = encoder.add(records[0])
    assert bytes(first[0]) == data[: lead_length(data, SEG1)]
    pieces = [*first, *encoder.add(records[1]), encoder.tail(last=header["last"])]
    assert b"".join(bytes(p) for p in pieces) == data


def test_bad_magic_and_bad_header() -> None:
    data = golden(SEG1)
    for bad in (b"XCKSEG\x00\x01" + data[8:], b"DCKSEG\x00\x02" + data[8:], b"", b"DCKSEG\x00\x01"):
        with pytest.raises(CorruptRecordError, match="not a diffckpt segment"):
            decode_segment(bad, "seg")
    with pytest.raises(CorruptRecordError, match="damaged or truncated"):
        decode_segment(data[:12] + b"[" + data[13:], "seg")
    with pytest.raises(CorruptRecordError, match="damaged or truncated"):
        decode_segment(data[:8] + struct.pack("<I", 10**6) + data[12:], "seg")
    newer = data.replace(b'"format":4', b'"format":5', 1)
    with pytest.raises(CorruptRecordError, match="seg: segment format 5 is not one this diffckpt reads "
                       r"\(formats 1, 2, 3 and 4\); .*upgrade diffckpt"):
        decode_segment(newer, "seg")
    with pytest.raises(ValueError):  # CorruptRecordError is also a ValueError
        decode_segment(b"garbage" * 10)


def _with_tree_json(buf: bytes, old: bytes, new: bytes) -> bytes:
    """Replace bytes inside the safetensors header, keeping its length (same-length edit)."""
    assert len(old) == len(new)
    (m,) = struct.unpack_from("<Q", buf, 0)
    header = buf[8 : 8 + m]
    assert old in header
    return buf[:8] + header.replace(old, new, 1) + buf[8 + m :]


def test_damaged_tree_buffers_raise_corrupt_record_error() -> None:
    buf = golden("tree.safetensors")
    cases = {
        "invalid structure JSON": _with_tree_json(buf, b"]]}", b"]}]"),
        "unknown tag": _with_tree_json(buf, b'{\\"tuple\\"', b'{\\"tupel\\"'),
        "unknown dtype": _with_tree_json(buf, b'\\"dtype\\":\\"bfloat16\\"', b'\\"dtype\\":\\"bfloat61\\"'),
        "missing tensor": _with_tree_json(buf, b'{\\"tensor\\":\\"0\\"}', b'{\\"tensor\\":\\"X\\"}'),
        "invalid safetensors header": _with_tree_json(buf, b'{"__metadata__"', b'["__metadata__"'),
        "no diffckpt metadata": _with_tree_json(buf, b'"diffckpt.tree"', b'"diffckpt.TREE"'),
        "header longer than buffer": struct.pack("<Q", len(buf)) + buf[8:],
        "shorter than its size field": buf[:5],
    }
    for label, bad in cases.items():
        with pytest.raises(CorruptRecordError):
            unpack_tree(bad)
            pytest.fail(f"no error for: {label}")
    import safetensors.torch
    with pytest.raises(CorruptRecordError, match="no diffckpt state tree"):
        unpack_tree(safetensors.torch.save({"w": torch.zeros(2)}))


@pytest.mark.parametrize("damage", ["truncated", "trailing bytes", "bad offsets"])
def test_damaged_tensor_data_raises_corrupt_record_error(damage: str) -> None:
    buf = golden("tree.safetensors")
    bad = {"truncated": buf[:-3], "trailing bytes": buf + b"xx",
           "bad offsets": _with_tree_json(buf, b'"data_offsets":[0,', b'"data_offsets":[1,')}[damage]
    with pytest.raises(CorruptRecordError):
        unpack_tree(bad)


def test_unknown_tags_and_bad_nodes_raise() -> None:
    for node in ({"set": [1, 2]}, {"pickle": "gASVAAAA"}, {}, {"dict": [], "x": 1, "y": 2},
                 {"value": 1.0, "npscalar": "<f4"}, {"dtype": "Tensor"}, {"dtype": "nn"}, {"tensor": "7"}):
        with pytest.raises(CorruptRecordError):
            decode_tree(node, {})


@pytest.mark.parametrize("node", [{"dict": 5}, {"dict": [[1]]}, {"dict": [[{"dict": []}, 1]]}, {"tuple": 3},
                                  {"npscalar": "<f4"}, {"npscalar": "zz", "value": 1}, {"float": "abc"},
                                  {"device": "nowhere"}, {"tensor": [1]}])
def test_malformed_nodes_raise_corrupt_record_error(node: Any) -> None:
    with pytest.raises(CorruptRecordError):
        decode_tree(node, {})


def test_unknown_compression_is_refused() -> None:
    _, header, records = mg.segment_inputs()[0]
    with pytest.raises(ValueError, match="unknown compression 'lz4'"):
        encode_segment(header, records, "lz4", 1)
    blobs = [golden(SEG1)[o : o + n] for _, o, n in _blob_offsets(golden(SEG1))]
    index = decode_segment(golden(SEG1))[0]
    data = build_segment({"after": 0, "compression": "lz4", "format": 3, "gen": 1}, blobs,
                         {"last": 2, "records": index["records"]})
    with pytest.raises(CorruptRecordError, match="seg: unknown compression 'lz4'"):
        decode_segment(data, "seg")


def test_damaged_commit_and_base(tmp_path: Path) -> None:
    data = golden(BASE_COMMIT)
    for bad in (data[:-1], b"", data.replace(b'"format": 4', b'"format": 5'),
                data.replace(b'"files"', b'"filez"'), b"[]"):
        with pytest.raises(CorruptRecordError):
            decode_commit(bad, "COMMIT")
    run = _copy_run(tmp_path)
    state = run / "bases" / "000000000000.g000001" / "state.safetensors"
    state.write_bytes(_flip(state.read_bytes(), 100))
    with pytest.raises(CorruptRecordError, match="fails its checksum"):
        RunStore(FsspecStorage(str(run))).load_base(BaseName(0, 1))
    state.unlink()
    with pytest.raises(CorruptRecordError, match="missing although its COMMIT exists"):
        RunStore(FsspecStorage(str(run))).load_base(BaseName(0, 1))


def test_damaged_last_segment_falls_back_to_the_newest_intact_step(tmp_path: Path) -> None:
    run = _copy_run(tmp_path)
    seg = run / SEG2.removeprefix("run/")
    data = seg.read_bytes()
    (_, _, _), (_, off4, len4) = _blob_offsets(data)
    seg.write_bytes(_flip(data, off4 + len4 // 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = load_state(str(run))
    assert result["step"] == 3 and any("step 4" in str(w.message) for w in caught)
    assert torch.equal(result["model"]["weight"], mg.simulate()[3]["weight"])
    with pytest.raises(CorruptRecordError):
        load_state(str(run), 4)


# =========================================================================================
# (e) tree round trip per supported type; refusal of the rest
# =========================================================================================
ROUND_TRIP = {
    "none": None, "true": True, "false": False, "int": -42, "big_int": -(2**100), "float": 1.0 / 3,
    "neg_zero": -0.0, "inf": math.inf, "neg_inf": -math.inf, "nan": math.nan, "str": "ünïcode ☃",
    "empty_str": "", "list": [1, [2, [3]]], "tuple": (1, (2,), ()), "dict": {"a": {"b": {}}},
    "int_keys": {3: "x", -1: "y"}, "tuple_key": {(1, 2): 3}, "bytes": bytes(range(256)),
    "empty_bytes": b"", "dtype": torch.float16, "device_cpu": torch.device("cpu"),
    "device_cuda": torch.device("cuda:3"), "device_meta": torch.device("meta"),
    "tensor_f32": torch.tensor([[1.0, -2.5]]), "tensor_bf16": torch.tensor([0.1], dtype=torch.bfloat16),
    "tensor_f64_nan": torch.tensor([math.nan, -0.0], dtype=torch.float64),
    "tensor_i16": torch.tensor([-7], dtype=torch.int16),
    "tensor_u32": torch.tensor([2**32 - 1], dtype=torch.uint32),
    "tensor_bool": torch.tensor([[True], [False]]), "tensor_0d": torch.tensor(5),
    "tensor_empty": torch.zeros(3, 0, dtype=torch.int64),
    "tensor_c64": torch.tensor([1 + 2j], dtype=torch.complex64),
    "tensor_grad": torch.ones(2, requires_grad=True),
    "ndarray_f64": np.linspace(0, 1, 5), "ndarray_bool": np.array([True, False]),
    "ndarray_0d": np.array(3, dtype=np.int16), "np_int64": np.int64(2**40), "np_float32": np.float32(0.5),
    "np_float16_inf": np.float16("inf"), "np_bool": np.bool_(False), "np_uint8": np.uint8(255),
    "rng_like": ("MT19937", np.arange(4, dtype=np.uint32), 2, 0, 0.0),
}


@pytest.mark.parametrize("key", list(ROUND_TRIP))
def test_tree_round_trip(key: str) -> None:
    value = ROUND_TRIP[key]
    back = unpack_tree(pack_tree({"v": value}))["v"]
    if key == "tensor_grad":
        assert not back.requires_grad
        value = value.detach()
    assert_same(back, value)


def test_views_and_shared_storage_round_trip() -> None:
    base = torch.arange(10.0)
    tree = [base, base[2:5], base.view(2, 5).t(), base[::3]]
    assert_same(unpack_tree(pack_tree(tree)), [t.contiguous() for t in tree])


def test_unsupported_objects_are_refused_with_their_path() -> None:
    cases = [
        ({"a": [1, {"fn": lambda: 0}]}, r"function at \$\['a'\]\[1\]\['fn'\]"),
        ({"s": {1, 2}}, r"set at \$\['s'\]"),
        ([0, 1j], r"complex at \$\[1\]"),
        ({"obj": object()}, r"object at \$\['obj'\]"),
        ({"sp": torch.zeros(2, 2).to_sparse()}, r"sparse tensor at \$\['sp'\]"),
        ({"k": {frozenset([1]): 1}}, r"frozenset at \$\['k'\]\.key"),
    ]
    for tree, pattern in cases:
        with pytest.raises(UnsupportedConfigurationError, match=pattern):
            pack_tree(tree)


@pytest.mark.parametrize("value", [np.float64("inf"), np.float64("-inf"), np.float64("nan")])
def test_numpy_float64_non_finite_round_trip(value: Any) -> None:
    back = unpack_tree(pack_tree([value]))[0]
    assert math.isnan(back) if math.isnan(value) else back == value


@pytest.mark.parametrize("value", [np.array(["a", None], dtype=object), np.array(["text"]),
                                   torch.zeros(2, dtype=torch.complex128)])
def test_unsupported_dtypes_are_refused_with_their_path(value: Any) -> None:
    with pytest.raises(UnsupportedConfigurationError, match=r"\$\['x'\]"):
        pack_tree({"x": value})


# =========================================================================================
# (f) property-style: random nested trees round-trip
# =========================================================================================
_TENSOR_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
                  torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]
_ARRAY_DTYPES = [np.float32, np.float64, np.int32, np.int64, np.uint8, np.uint32, np.bool_, np.int8]
_NP_SCALARS = [np.int8, np.int16, np.int32, np.int64, np.uint16, np.float16, np.float32, np.bool_]


def _random_leaf(rng: random.Random, gen: torch.Generator) -> Any:
    kind = rng.randrange(14)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, -1, rng.randrange(-(2**63), 2**63), rng.randrange(2**64, 2**80)])
    if kind == 2:
        return rng.choice([rng.uniform(-1e6, 1e6), math.inf, -math.inf, math.nan, -0.0, 5e-324, 1e308])
    if kind == 3:
        return "".join(rng.choice("ab\"\\\n\u00e9\u2603{}[]:,") for _ in range(rng.randrange(6)))
    if kind == 4:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(8)))
    if kind in (5, 6, 7):
        dtype = rng.choice(_TENSOR_DTYPES)
        shape = [rng.randrange(4) for _ in range(rng.randrange(4))]
        numel = int(np.prod(shape or [1]))
        raw = torch.randint(0, 256, (numel * torch.empty((), dtype=dtype).element_size(),),
                            generator=gen, dtype=torch.uint8)
        t = (raw % 2).bool() if dtype == torch.bool else raw.view(dtype)  # any bit pattern, NaNs too
        t = t.reshape(shape)
        return t.t() if t.dim() == 2 and rng.random() < 0.5 else t
    if kind == 8:
        dtype = rng.choice(_ARRAY_DTYPES)
        shape = tuple(rng.randrange(3) for _ in range(rng.randrange(3)))
        values = np.arange(int(np.prod(shape)), dtype=np.int64) * rng.randrange(1, 9)
        return values.astype(dtype).reshape(shape)
    if kind == 9:
        t = rng.choice(_NP_SCALARS)
        return t(rng.randrange(2) if t is np.bool_ else rng.randrange(100))
    if kind == 10:
        return rng.choice([torch.float32, torch.int64, torch.bool, torch.bfloat16, torch.uint8])
    if kind == 11:
        return rng.choice([torch.device("cpu"), torch.device("cuda", rng.randrange(8)),
                           torch.device("cuda")])
    if kind == 12:
        return torch.Size([rng.randrange(5) for _ in range(rng.randrange(3))])
    return rng.random()


def _random_key(rng: random.Random) -> Any:
    return rng.choice([f"k{rng.randrange(50)}", rng.randrange(-50, 50), None, (rng.randrange(3), "t"),
                       b"b%d" % rng.randrange(9), rng.randrange(9) + 0.5, True])


def _random_tree(rng: random.Random, gen: torch.Generator, depth: int = 0) -> Any:
    if depth > 3 or rng.random() < 0.3:
        return _random_leaf(rng, gen)
    kind = rng.randrange(3)
    children = [_random_tree(rng, gen, depth + 1) for _ in range(rng.randrange(5))]
    if kind == 0:
        return children
    if kind == 1:
        return tuple(children)
    return {_random_key(rng): c for c in children}


def _normalize(value: Any) -> Any:
    """What decoding gives back for ``value``: torch.Size is a tuple, tensors are contiguous."""
    if isinstance(value, torch.Size):
        return tuple(value)
    if isinstance(value, torch.Tensor):
        return value.contiguous()
    if isinstance(value, dict):
        return {k: _normalize(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_normalize(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_normalize(v) for v in value)
    return value


def test_random_trees_round_trip() -> None:
    rng = random.Random(20240607)
    gen = torch.Generator().manual_seed(7)
    for i in range(300):
        tree = _random_tree(rng, gen)
        buf = pack_tree(tree)
        assert_same(unpack_tree(buf), _normalize(tree), f"tree {i}")
        assert pack_tree(unpack_tree(buf)) == buf, f"tree {i}: re-encoding is not stable"
