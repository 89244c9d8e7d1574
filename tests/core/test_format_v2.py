"""Format 2 (the segment's index in its header) stays readable: the read-only fixtures under
``tests/golden/v2/`` (written by the format-2 diffckpt, never regenerated) decode, verify, replay
bitwise and show damage as before, truncation included (the records before the cut are kept,
where a truncated format-3 segment is unusable); a run root that mixes a format-2 session and a
session of the current format restores, verifies and compacts. ``docs/format.md`` section 14
describes format 2.
"""

from __future__ import annotations

import json
import shutil
import struct
import warnings
from pathlib import Path

import pytest
import torch
import xxhash
from test_cli import cli
from test_format import _blob_offsets, _flip, assert_same, mg
from test_format_v1 import format_of, legacy_blob, resume_with_the_current_format, same_header

from diffckpt.format import FORMAT_VERSION, BaseName, decode_commit
from diffckpt.lifecycle.compaction import compact
from diffckpt.loading import load_state
from diffckpt.runstore import RunStore
from diffckpt.segment import SEGMENT_MAGIC, decode_segment
from diffckpt.storage import FsspecStorage

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
V2 = GOLDEN / "v2"
SEG1 = "diffs/000000000000-000000000002.g000001.seg"
SEG2 = "diffs/000000000002-000000000004.g000001.seg"
BASE = BaseName(0, 1)
SEGMENTS = ["run/" + SEG1, "run/" + SEG2, "segment-zstd.seg",
            *[f"sharded/ranks/r{r:05d}/{s}" for r in (0, 1) for s in (SEG1, SEG2)]]

Cap = pytest.CaptureFixture[str]


def v2(rel: str) -> bytes:
    return (V2 / rel).read_bytes()


def _copy(tmp_path: Path, what: str = "run") -> Path:
    dst = tmp_path / what
    shutil.copytree(V2 / what, dst)
    return dst


# ------------------------------------------------------------------- the fixtures as they are
def test_the_fixtures_are_format_2_and_not_regenerated() -> None:
    assert not [rel for rel in [*mg.PINNED, *mg.other_files()] if rel.startswith("v2/")]
    for what in ("run", "sharded"):
        assert json.loads(v2(f"{what}/run.json"))["version"] == 2
    for rel in (f"run/{BASE.commit_path}", *[f"sharded/ranks/r{r:05d}/{BASE.commit_path}" for r in (0, 1)]):
        assert decode_commit(v2(rel), rel)["format"] == 2


def test_a_format_2_writer_by_the_doc_gives_the_fixture_bytes_and_diffckpt_reads_them() -> None:
    """Round trip: format-2 segments and COMMIT written from docs/format.md (sections 4, 7.2 and
    14, with xxhash) are byte for byte the fixtures, and decode to the records written."""
    for rel, (_, header, records) in zip((SEG1, SEG2), mg.segment_inputs()):
        blobs = [legacy_blob(r) for r in records]
        entries = [{"length": len(b), "raw_length": len(b), "step": r["step"],
                    "xxh3_128": xxhash.xxh3_128(b).hexdigest()} for b, r in zip(blobs, records)]
        head = json.dumps(dict(header, format=2, compression="none", records=entries),
                          separators=(",", ":"), sort_keys=True).encode()
        lead = SEGMENT_MAGIC + struct.pack("<I", len(head)) + head
        data = lead + b"".join(blobs) + xxhash.xxh3_128(lead).digest()
        assert data == v2(f"run/{rel}")
        decoded_header, decoded, problem = decode_segment(data, rel)
        assert problem is None and decoded_header["format"] == 2
        assert_same(decoded, records)
    state = v2(f"run/{BASE.state_path}")
    commit = {"files": {"state.safetensors": {"size": len(state), "xxh3_128": xxhash.xxh3_128(state).hexdigest()}},
              "fingerprint": mg.commit_info(state)["fingerprint"], "format": 2, "gen": 1, "step": 0}
    assert json.dumps(commit, indent=1, sort_keys=True).encode() == v2(f"run/{BASE.commit_path}")


def test_format_2_segments_decode_to_what_format_3_holds() -> None:
    """The records are the same in both formats; only where the index lies differs."""
    for rel in SEGMENTS:
        header, records, problem = decode_segment(v2(rel), rel)
        current, expected, _ = decode_segment((GOLDEN / rel).read_bytes(), rel)
        assert problem is None and (header["format"], current["format"]) == (2, FORMAT_VERSION), rel
        # the same header but for the version and the index, whose lengths and digests follow the
        # records' bytes (laid out with whole 64-byte lines first since: docs/format.md section 5.1)
        assert same_header(header) == same_header(current), rel
        assert [e["step"] for e in header["records"]] == [e["step"] for e in current["records"]], rel
        assert_same(records, expected)


def test_a_format_2_run_restores_by_replay_bitwise() -> None:
    info, tree = RunStore(FsspecStorage(str(V2 / "run"))).load_base(BASE)
    assert info["format"] == 2
    assert_same(tree, mg.base_tree())
    sim = mg.simulate()
    for step in (None, 3, 2, 0):
        result = load_state(str(V2 / "run"), step)
        expected = 4 if step is None else step
        assert (result["step"], result["base_step"], result["replayed"]) == (expected, 0, expected)
        for name in mg.PARAM_NAMES:
            assert torch.equal(result["model"][name], sim[expected][name]), name
        for name, value in (mg.buffers_at(expected) if expected else mg.initial_buffers()).items():
            assert torch.equal(result["model"][name], value), name
        assert result["state"] == (mg.base_tree()["state"] if expected == 0 else mg._STEPS[expected][2])
    result = load_state(str(V2 / "sharded"))
    for name in mg.PARAM_NAMES:
        assert torch.equal(result["model"][name], sim[4][name]), name


@pytest.mark.parametrize("what", ["run", "sharded"])
def test_cli_verify_passes_on_format_2(tmp_path: Path, capsys: Cap, what: str) -> None:
    rc, out, _ = cli(capsys, "verify", _copy(tmp_path, what), "--deep")
    assert rc == 0 and "OK: every checksum matches" in out, out


# ------------------------------------------------------------------------------------ damage
def test_damage_to_format_2_segments_is_found_as_before() -> None:
    data = v2("run/" + SEG1)
    (step1, off1, _), (step2, off2, len2) = _blob_offsets(data)
    _, expected, _ = decode_segment(data)
    _, records, problem = decode_segment(_flip(data, off2 + len2 // 2), "seg")
    assert_same(records, expected[:1])
    assert problem is not None and f"step {step2} fails its checksum" in problem
    _, records, problem = decode_segment(_flip(data, off1 + 1), "seg")
    assert records == [] and problem is not None and f"step {step1}" in problem
    _, records, problem = decode_segment(_flip(data, len(data) - 1), "seg")  # the digest
    assert len(records) == 2 and problem is not None and "checksum does not match" in problem


def test_a_truncated_format_2_segment_keeps_the_records_before_the_cut() -> None:
    """Format 2 lists the records in front, so a cut keeps them (format 3 loses its index)."""
    data = v2("run/" + SEG1)
    (_, _, _), (step2, off2, _) = _blob_offsets(data)
    for cut in (len(data) - 1, len(data) - 16):  # into the digest: records intact
        _, records, problem = decode_segment(data[:cut], "seg")
        assert len(records) == 2 and problem is not None and "checksum does not match" in problem
    for cut in (len(data) - 17, off2 + 10, off2):  # into the second record
        _, records, problem = decode_segment(data[:cut], "seg")
        assert len(records) == 1 and problem is not None and f"step {step2} fails its checksum" in problem
    _, records, problem = decode_segment(data[: off2 - 400], "seg")  # into the first
    assert records == [] and problem is not None and "step 1" in problem
    for cut in (0, 11, 40):  # into the magic or the header
        with pytest.raises(ValueError):
            decode_segment(data[:cut], "seg")


def test_cli_verify_names_a_damaged_format_2_record(tmp_path: Path, capsys: Cap) -> None:
    root = _copy(tmp_path)
    seg = root / SEG2
    data = seg.read_bytes()
    (_, _, _), (step4, off4, len4) = _blob_offsets(data)
    seg.write_bytes(_flip(data, off4 + len4 // 2))
    rc, out, _ = cli(capsys, "verify", root)
    assert rc == 1 and f"record for step {step4} fails its checksum" in out
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert load_state(str(root))["step"] == 3  # the newest intact step, as before
    seg.write_bytes(data[: off4 + 10])  # truncated in step 4's record: step 3 is still kept
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert load_state(str(root))["step"] == 3


# ----------------------------------------------------------------- a root with both formats
def test_a_run_root_with_a_format_2_and_a_current_session(tmp_path: Path, capsys: Cap) -> None:
    root = _copy(tmp_path)
    truth = resume_with_the_current_format(root)
    formats = [format_of(root, rel) for rel in
               [BASE.commit_path, SEG1, SEG2, BaseName(4, 2).commit_path,
                "diffs/000000000004-000000000006.g000002.seg", "diffs/000000000006-000000000008.g000002.seg"]]
    assert formats == [2, 2, 2, *[FORMAT_VERSION] * 3]
    sim = mg.simulate()

    def check(step: int | None, expected: int, base: int) -> None:
        result = load_state(str(root), step)
        assert (result["step"], result["base_step"]) == (expected, base)
        want = truth[expected] if expected > 4 else sim[expected]
        for name in mg.PARAM_NAMES:
            assert torch.equal(result["model"][name], want[name]), (step, name)

    check(None, 8, 4)  # the current format's session
    check(3, 3, 0)  # the format-2 session
    # Compaction of the format-2 chain writes a current base that a format-2 segment continues.
    assert compact(str(root), to=2).written
    assert format_of(root, BaseName(2, 1).commit_path) == FORMAT_VERSION
    check(3, 3, 2)
    rc, out, _ = cli(capsys, "verify", root, "--deep")
    assert rc == 0 and "OK: every checksum matches" in out, out
