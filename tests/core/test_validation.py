"""Input from storage is validated explicitly (never with ``assert``): a damaged COMMIT marker,
segment header or state tree is a :class:`CorruptRecordError`, under ``python -O`` too, and the
fallback to an older base catches it."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from engine_runs import base_dir, build_segment, train

from diffckpt import CorruptRecordError, RetentionPolicy
from diffckpt.checksums import XXH3_128
from diffckpt.format import FORMAT_VERSION, BaseName, SegmentName, decode_commit, encode_commit
from diffckpt.inventory import Inventory
from diffckpt.segment import SEGMENT_MAGIC, decode_segment
from diffckpt.tree import pack_tree, read_metadata, unpack_tree

GOOD = {"step": 10, "gen": 1, "fingerprint": "xxh3-128:" + "ab" * 16,
        "files": {"state.safetensors": {"size": 840, "xxh3_128": "ff" * 16}}}


def _without(info: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in info.items() if k != key}


DAMAGED_COMMITS: dict[str, Any] = {
    "files is a list": {**GOOD, "files": [GOOD["files"]["state.safetensors"]]},
    "files lacks the state": {**GOOD, "files": {"other.bin": {"size": 1, "xxh3_128": "00"}}},
    "state is a string": {**GOOD, "files": {"state.safetensors": "ff" * 16}},
    "size is a string": {**GOOD, "files": {"state.safetensors": {"size": "840", "xxh3_128": "ff" * 16}}},
    "size is negative": {**GOOD, "files": {"state.safetensors": {"size": -1, "xxh3_128": "ff" * 16}}},
    "xxh3_128 is missing": {**GOOD, "files": {"state.safetensors": {"size": 840}}},
    "a format-1 digest in the current format": {**GOOD, "files": {"state.safetensors": {"size": 840, "sha256": "ff" * 32}}},
    "step is missing": _without(GOOD, "step"),
    "step is a string": {**GOOD, "step": "10"},
    "gen is a bool": {**GOOD, "gen": True},
    "fingerprint is a number": {**GOOD, "fingerprint": 7},
}


def test_a_well_formed_commit_decodes() -> None:
    assert decode_commit(encode_commit(GOOD), "COMMIT") == {**GOOD, "format": FORMAT_VERSION}
    assert decode_commit(encode_commit({**GOOD, "compacted": {"from_base": 5}}), "COMMIT")["compacted"]


@pytest.mark.parametrize("how", sorted(DAMAGED_COMMITS))
def test_a_damaged_commit_is_a_corrupt_record(how: str) -> None:
    with pytest.raises(CorruptRecordError, match="COMMIT: COMMIT marker is damaged"):
        decode_commit(encode_commit(DAMAGED_COMMITS[how]), "COMMIT")


@pytest.mark.parametrize("data", [b'{"format": true}', b"[" * 100_000, b"\xff\xfe", b"null", b'"COMMIT"'])
def test_commit_bytes_that_are_no_marker_are_a_corrupt_record(data: bytes) -> None:
    with pytest.raises(CorruptRecordError, match="COMMIT marker is damaged"):
        decode_commit(data, "COMMIT")


_UNDER_O = r"""
import json, sys, warnings
assert sys.flags.optimize >= 1, "not running under python -O"
from diffckpt import CorruptRecordError, load_state
from diffckpt.format import BaseName
from diffckpt.runstore import RunStore
from diffckpt.storage import open_storage

out = {}
for root in sys.argv[1:]:
    try:
        RunStore(open_storage(root)).load_base(BaseName(10, 1))
        direct = "loaded"
    except CorruptRecordError as exc:
        direct = "CorruptRecordError: " + str(exc)
    except Exception as exc:  # what assert-based validation let through under -O
        direct = type(exc).__name__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            state = load_state(root)
            restored = [state["step"], state["base_step"]]
        except Exception as exc:
            restored = type(exc).__name__
    out[root] = {"direct": direct, "restored": restored, "warnings": [str(w.message) for w in caught]}
print(json.dumps(out))
"""


def test_a_damaged_commit_falls_back_to_an_older_base_under_python_O(
        tmp_path: Path, python_env: dict[str, str]) -> None:
    run = tmp_path / "run"
    _, durable = train(run, steps=13)  # bases at 0, 5, 10
    assert durable == 13
    commit = json.loads((base_dir(run, 10) / "COMMIT").read_text())
    cases = {"files is a list": {**commit, "files": [commit["files"]["state.safetensors"]]},
             "files lacks the state": {**commit, "files": {}},
             "size is a string": {**commit, "files": {"state.safetensors": {
                 **commit["files"]["state.safetensors"], "size": "big"}}}}
    roots = {}
    for i, (how, info) in enumerate(cases.items()):
        roots[how] = tmp_path / f"case{i}"
        shutil.copytree(run, roots[how])
        (base_dir(roots[how], 10) / "COMMIT").write_text(json.dumps(info))
    done = subprocess.run([sys.executable, "-O", "-c", _UNDER_O, *map(str, roots.values())],
                          env=python_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for how, root in roots.items():
        got = out[str(root)]
        assert got["direct"].startswith("CorruptRecordError: "), (how, got)
        assert "COMMIT marker is damaged" in got["direct"], (how, got)
        assert got["restored"] == [13, 5], (how, got)  # base 10 skipped, replayed from base 5
        assert any("older base at step 5" in w for w in got["warnings"]), (how, got)


# ----------------------------------------------------------------------------- segments
def _segment(header: dict[str, Any], body: bytes = b"", version: int = FORMAT_VERSION) -> bytes:
    """A segment of ``version`` around ``header`` (its ``format`` key says a version itself) and
    ``body``: format 3 splits the header into the lead and the index at the end (``last`` and
    ``records``), format 2 keeps it whole in front."""
    if version >= 3:
        index = {k: header.pop(k) for k in ("last", "records") if k in header}
        return build_segment(header, [body], index)
    head = json.dumps(header).encode()
    lead = SEGMENT_MAGIC + struct.pack("<I", len(head)) + head
    return lead + body + XXH3_128.digest(lead)


_EMPTY = XXH3_128.hexdigest(b"")
_PART = {2: "header", 3: "index"}  # where the record entries are


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("records", [
    [1, 2], {"a": 1}, [{"step": 1, "length": 0, "xxh3_128": _EMPTY}],  # no raw_length
    [{"step": "1", "length": 0, "raw_length": 0, "xxh3_128": _EMPTY}],
    [{"step": 1, "length": -5, "raw_length": 0, "xxh3_128": _EMPTY}],
    [{"step": 1, "length": 0, "raw_length": 0, "xxh3_128": None}],
    [{"step": 1, "length": 0, "raw_length": 0, "sha256": _EMPTY}],  # format 1's key in format 2 or 3
])
def test_a_damaged_record_list_is_a_corrupt_record(records: Any, version: int) -> None:
    data = _segment({"format": version, "compression": "none", "after": 0, "last": 1, "gen": 1,
                     "records": records}, version=version)
    with pytest.raises(CorruptRecordError, match=f"segment {_PART[version]} is damaged"):
        decode_segment(data, "seg")


@pytest.mark.parametrize("index", [[], "x", None, {"last": 1}, {"last": 1, "records": None}])
def test_a_format_3_index_that_is_no_object_with_records_is_a_corrupt_record(index: Any) -> None:
    data = build_segment({"after": 0, "compression": "none", "format": 3, "gen": 1}, [], index)
    with pytest.raises(CorruptRecordError, match="seg: segment index is damaged or truncated"):
        decode_segment(data, "seg")


@pytest.mark.parametrize("length", [2**32 - 1, 10**6])
def test_a_format_3_index_length_past_the_lead_is_a_corrupt_record(length: int) -> None:
    data = bytearray(build_segment({"after": 0, "compression": "none", "format": 3, "gen": 1}, [],
                                   {"last": 1, "records": []}))
    data[-20:-16] = struct.pack("<I", length)
    with pytest.raises(CorruptRecordError, match="seg: segment index is damaged or truncated"):
        decode_segment(bytes(data), "seg")


@pytest.mark.parametrize("version", [None, "2", True, 2.0, "3", 3.0])
def test_a_segment_format_that_is_no_version_number_is_damage(version: Any) -> None:
    data = _segment({"format": version, "compression": "none", "after": 0, "last": 1, "gen": 1, "records": []})
    with pytest.raises(CorruptRecordError, match="segment header is damaged"):
        decode_segment(data, "seg")


def test_a_header_that_is_no_object_is_a_corrupt_record() -> None:
    for header in ([], "x", None, 3):
        head = json.dumps(header).encode()
        with pytest.raises(CorruptRecordError, match="segment header is damaged"):
            decode_segment(SEGMENT_MAGIC + struct.pack("<I", len(head)) + head + b"\x00" * 32, "seg")


@pytest.mark.parametrize("version", [2, 3])
def test_a_record_that_is_no_step_record_is_a_problem_not_an_error(version: int) -> None:
    blob = pack_tree(["not", "a", "record"])
    entry = {"step": 1, "length": len(blob), "raw_length": len(blob), "xxh3_128": XXH3_128.hexdigest(blob)}
    data = _segment({"format": version, "compression": "none", "after": 0, "last": 1, "gen": 1,
                     "records": [entry]}, blob, version)
    _, records, problem = decode_segment(data, "seg")
    assert records == [] and problem is not None and "not a step record" in problem


def test_safetensors_metadata_that_is_no_map_of_strings_is_a_corrupt_record() -> None:
    data = pack_tree({"a": 1})
    (size,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + size])
    for meta in (["x"], "diffckpt.tree", {"diffckpt.tree": 5}):
        head = json.dumps({**header, "__metadata__": meta}).encode()
        head += b" " * (-len(head) % 8)
        bad = struct.pack("<Q", len(head)) + head + data[8 + size:]
        with pytest.raises(CorruptRecordError, match="metadata"):
            read_metadata(bad)
        with pytest.raises(CorruptRecordError, match="metadata"):
            unpack_tree(bad)


def test_a_segment_name_that_does_not_advance_ends_the_chain() -> None:
    # A damaged or hand-made name diffs/5-5 (or 5-3) would make a chain walk loop forever.
    inv = Inventory(bases=[BaseName(0, 1)],
                    segments=sorted([SegmentName(0, 5, 1), SegmentName(5, 5, 1), SegmentName(5, 3, 1),
                                     SegmentName(3, 5, 1)]))
    assert inv.chain(BaseName(0, 1)) == [SegmentName(0, 5, 1)]
    assert inv.chain_end(BaseName(0, 1)) == 5


# ----------------------------------------------------------------------------- session files
@pytest.mark.parametrize("options", [
    {"retention": {"keep_last_bases": 0}}, {"retention": {"keep_forever": True}}])
def test_a_recorded_retention_policy_that_cannot_be_used_is_a_corrupt_record(
        tmp_path: Path, options: dict[str, Any]) -> None:
    from diffckpt import collect_garbage

    root = tmp_path / "run"
    (root / "sessions").mkdir(parents=True)
    (root / "run.json").write_text("{}")
    (root / "sessions" / "g000001.json").write_text(json.dumps({"gen": 1, "options": options}))
    with pytest.raises(CorruptRecordError, match=r"g000001\.json records a retention policy"):
        collect_garbage(root)
    assert collect_garbage(root, RetentionPolicy()).objects == 0  # an explicit policy is used


def test_session_options_of_another_shape_mean_no_recorded_policy(tmp_path: Path) -> None:
    from diffckpt.lifecycle.retention import recorded_policy
    from diffckpt.runstore import RunStore
    from diffckpt.storage import open_storage

    root = tmp_path / "run"
    (root / "sessions").mkdir(parents=True)
    for gen, body in ((1, {"options": ["not", "a", "dict"]}), (2, [1, 2])):
        (root / "sessions" / f"g{gen:06d}.json").write_text(json.dumps(body))
    # g2 is damaged (skipped), g1's options are no mapping: no policy, no AttributeError
    assert recorded_policy(RunStore(open_storage(root))) is None
