"""``diffckpt verify --deep``: every segment is replayed once, and each base must equal the replay
of the base before it. A base that passes every checksum but holds the wrong state (written wrong,
or swapped in) is invisible to the plain ``verify``; ``--deep`` names it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from engine_runs import base_dir, train

from diffckpt.checksums import fingerprint
from diffckpt.cli import main
from diffckpt.format import decode_commit, encode_commit, state_entry
from diffckpt.tree import pack_tree, unpack_tree

STEPS = 20  # bases at 0, 5, 10, 15 and 20: four chains of five steps, the newest step is a base
Cap = pytest.CaptureFixture[str]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    train(root, STEPS, base_every_n_steps=5)
    return root


def cli(capsys: Cap, *argv: Any) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def forge_base(root: Path, step: int) -> None:
    """Replace base ``step`` by a valid one with perturbed weights: its checksum and the
    fingerprint in its COMMIT are recomputed, so nothing but its content is wrong."""
    directory = base_dir(root, step)
    tree = unpack_tree((directory / "state.safetensors").read_bytes())
    tree["model"]["0.weight"][0, 0] += 1e-3
    data = pack_tree(tree)
    (directory / "state.safetensors").write_bytes(data)
    names = [n for n, _ in json.loads((root / "sessions/g000001.json").read_text())["parameters"]]
    info = decode_commit((directory / "COMMIT").read_bytes(), "COMMIT")
    info["files"]["state.safetensors"] = state_entry([data])
    info["fingerprint"] = fingerprint(tree["model"][n] for n in names)
    (directory / "COMMIT").write_bytes(encode_commit(info))


def test_clean_run_passes(root: Path, capsys: Cap) -> None:
    rc, out, _ = cli(capsys, "verify", root, "--deep", "--json")
    report = json.loads(out)
    assert rc == 0 and report["ok"] and report["problems"] == []
    deep = report["deep"]
    assert (deep["replayed_steps"], deep["bases_compared"], deep["chains"]) == (STEPS, 4, 4)
    assert deep["seconds"] >= 0
    rc, out, _ = cli(capsys, "verify", root, "--deep")
    assert rc == 0
    assert ("deep: replayed 20 steps across 4 chains; every base equals the replay of the one "
            "before") in out


def test_plain_verify_has_no_deep_section(root: Path, capsys: Cap) -> None:
    rc, out, _ = cli(capsys, "verify", root, "--json")
    assert rc == 0 and json.loads(out)["deep"] is None


def test_progress_names_each_chain(root: Path, capsys: Cap, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    rc, _, err = cli(capsys, "verify", root, "--deep")
    assert rc == 0
    assert "[1/4] replaying base 0 -> 5" in err and "[4/4] replaying base 15 -> 20" in err


def test_forged_base_is_caught_only_by_deep(root: Path, capsys: Cap) -> None:
    forge_base(root, 10)
    rc, out, _ = cli(capsys, "verify", root)
    assert rc == 0 and "OK: every checksum matches" in out  # checksums and step 20 are fine
    rc, out, _ = cli(capsys, "verify", root, "--deep", "--json")
    report = json.loads(out)
    assert rc == 1 and not report["ok"]
    name = "bases/000000000010.g000001/state.safetensors"
    assert {"object": name, "problem": "differs from the replay of base 5 at tensor model/0.weight"} \
        in report["problems"]
    # Replay from the forged base then departs from the fingerprints recorded in training.
    (replay,) = [p for p in report["problems"] if p["object"] == "deep replay g1 10..15"]
    assert "do not match the fingerprint" in replay["problem"]
    rc, out, _ = cli(capsys, "verify", root, "--deep")
    assert rc == 1
    assert f"BAD {name}: differs from the replay of base 5 at tensor model/0.weight" in out
    assert "deep: replayed 15 steps across 4 chains; 2 problem(s), listed below" in out


def test_damaged_base_is_replayed_across(root: Path, capsys: Cap) -> None:
    state = base_dir(root, 10) / "state.safetensors"
    state.write_bytes(state.read_bytes()[:100])
    rc, out, _ = cli(capsys, "verify", root, "--deep", "--json")
    report = json.loads(out)
    assert rc == 1
    # reported once, by the checksum pass; base 5 replays on to base 15 in its place
    assert [p["object"] for p in report["problems"]] == ["bases/000000000010.g000001/state.safetensors"]
    deep = report["deep"]
    assert (deep["replayed_steps"], deep["bases_compared"], deep["chains"]) == (STEPS, 3, 3)
