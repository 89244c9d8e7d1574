"""Format 3 (format 4 without row-split gradients) stays readable: the read-only fixtures under
``tests/golden/v3/`` (written by the format-3 diffckpt, never regenerated) decode to the records
the current format holds, verify, and replay bitwise; a run root that mixes a format-3 session and
a session of the current format restores, verifies and compacts. ``docs/format.md`` section 10
says what changed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_cli import cli
from test_format import assert_same, mg
from test_format_v1 import format_of, resume_with_the_current_format, same_header
from test_format_v2 import BASE, GOLDEN, SEG1, SEG2, SEGMENTS, Cap

from diffckpt.format import FORMAT_VERSION, BaseName, decode_commit
from diffckpt.lifecycle.compaction import compact
from diffckpt.loading import load_state
from diffckpt.segment import decode_segment
from diffckpt.tree import unpack_tree

V3 = GOLDEN / "v3"


def v3(rel: str) -> bytes:
    return (V3 / rel).read_bytes()


def test_the_fixtures_are_format_3_and_not_regenerated() -> None:
    assert not [rel for rel in [*mg.PINNED, *mg.other_files()] if rel.startswith("v3/")]
    for what in ("run", "sharded"):
        assert json.loads(v3(f"{what}/run.json"))["version"] == 3
    for rel in (f"run/{BASE.commit_path}", *[f"sharded/ranks/r{r:05d}/{BASE.commit_path}" for r in (0, 1)]):
        assert decode_commit(v3(rel), rel)["format"] == 3


def test_format_3_objects_hold_what_the_current_format_holds() -> None:
    """Segments: the same records and header but for the version; bases: the same state file."""
    for rel in SEGMENTS:
        header, records, problem = decode_segment(v3(rel), rel)
        current, expected, _ = decode_segment((GOLDEN / rel).read_bytes(), rel)
        assert problem is None and (header["format"], current["format"]) == (3, FORMAT_VERSION), rel
        # the same header but for the version and the index, whose lengths and digests follow the
        # records' bytes (laid out with whole 64-byte lines first since: docs/format.md section 5.1)
        assert same_header(header) == same_header(current), rel
        assert [e["step"] for e in header["records"]] == [e["step"] for e in current["records"]], rel
        assert_same(records, expected)
    for rel in (f"run/{BASE.state_path}", *[f"sharded/ranks/r{r:05d}/{BASE.state_path}" for r in (0, 1)]):
        assert_same(unpack_tree(v3(rel)), unpack_tree((GOLDEN / rel).read_bytes()))


def test_a_format_3_run_restores_by_replay_bitwise() -> None:
    sim = mg.simulate()
    for step in (None, 3, 0):
        result = load_state(str(V3 / "run"), step)
        expected = 4 if step is None else step
        assert (result["step"], result["base_step"], result["replayed"]) == (expected, 0, expected)
        for name in mg.PARAM_NAMES:
            assert torch.equal(result["model"][name], sim[expected][name]), name
    result = load_state(str(V3 / "sharded"))
    for name in mg.PARAM_NAMES:
        assert torch.equal(result["model"][name], sim[4][name]), name


@pytest.mark.parametrize("what", ["run", "sharded"])
def test_cli_verify_passes_on_format_3(tmp_path: Path, capsys: Cap, what: str) -> None:
    root = tmp_path / what
    shutil.copytree(V3 / what, root)
    rc, out, _ = cli(capsys, "verify", root, "--deep")
    assert rc == 0 and "OK: every checksum matches" in out, out


def test_a_run_root_with_a_format_3_and_a_current_session(tmp_path: Path, capsys: Cap) -> None:
    root = tmp_path / "run"
    shutil.copytree(V3 / "run", root)
    truth = resume_with_the_current_format(root)
    formats = [format_of(root, rel) for rel in
               [BASE.commit_path, SEG1, SEG2, BaseName(4, 2).commit_path,
                "diffs/000000000004-000000000006.g000002.seg", "diffs/000000000006-000000000008.g000002.seg"]]
    assert formats == [3, 3, 3, *[FORMAT_VERSION] * 3] and FORMAT_VERSION == 4
    sim = mg.simulate()
    for step, expected, base in ((None, 8, 4), (3, 3, 0)):
        result = load_state(str(root), step)
        assert (result["step"], result["base_step"]) == (expected, base)
        want = truth[expected] if expected > 4 else sim[expected]
        for name in mg.PARAM_NAMES:
            assert torch.equal(result["model"][name], want[name]), (step, name)
    assert compact(str(root), to=2).written  # a format-4 base that a format-3 segment continues
    assert format_of(root, BaseName(2, 1).commit_path) == FORMAT_VERSION
    assert torch.equal(load_state(str(root), 3)["model"]["weight"], sim[3]["weight"])
    rc, out, _ = cli(capsys, "verify", root, "--deep")
    assert rc == 0 and "OK: every checksum matches" in out, out
