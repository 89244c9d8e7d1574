"""Format 1 (SHA-256) stays readable: the read-only fixtures under ``tests/golden/v1/`` (written by
the format-1 diffckpt, never regenerated) decode, verify, replay bitwise and show damage as
before; a run root that mixes format-1 sessions and sessions of the current format restores,
verifies, compacts and is collected; a format this diffckpt does not know is refused with a
message naming it. ``docs/format.md`` section 13 describes format 1.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import warnings
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from test_cli import cli
from test_format import _blob_offsets, _flip, assert_same, mg

from diffckpt import CheckpointEngine, CheckpointOptions, RetentionPolicy
from diffckpt.checksums import fingerprint_matches
from diffckpt.errors import CorruptRecordError
from diffckpt.format import FORMAT_VERSION, BaseName, decode_commit
from diffckpt.lifecycle.compaction import compact
from diffckpt.lifecycle.retention import collect_garbage
from diffckpt.loading import load_state
from diffckpt.runstore import RunStore
from diffckpt.segment import SEGMENT_MAGIC, decode_segment
from diffckpt.storage import FsspecStorage
from diffckpt.tree import encode_tree

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
V1 = GOLDEN / "v1"
SEG1 = "diffs/000000000000-000000000002.g000001.seg"
SEG2 = "diffs/000000000002-000000000004.g000001.seg"
BASE = BaseName(0, 1)

Cap = pytest.CaptureFixture[str]


def legacy_blob(record: Any) -> bytes:
    """A record blob as formats 1 to 4 wrote it before records kept whole 64-byte lines first:
    exactly what ``safetensors`` writes (its order, the header padded to 8 bytes), the tree's
    structure in the metadata (docs/format.md section 5)."""
    tensors: dict[str, torch.Tensor] = {}
    structure = json.dumps(encode_tree(record, tensors), separators=(",", ":"), allow_nan=False)
    return safetensors.torch.save(tensors, metadata={"diffckpt.tree": structure})


def same_header(header: dict[str, Any]) -> dict[str, Any]:
    """A segment's header without what differs between formats (its version) and between record
    layouts (the index: lengths and digests of the records' bytes)."""
    return {k: v for k, v in header.items() if k not in ("format", "records")}


def v1(rel: str) -> bytes:
    return (V1 / rel).read_bytes()


def _sha256_fingerprint(tensors: list[torch.Tensor]) -> str:
    """A format-1 fingerprint by docs/format.md section 8 and 13: bare hex SHA-256."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(str((t.dtype, tuple(t.shape))).encode("ascii"))
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def _v1_records() -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """``(header, records)`` of the two golden segments as format 1 stored them: the records of
    formats 2 and 3 with SHA-256 fingerprints."""
    sim = mg.simulate()
    out = []
    for _, header, records in mg.segment_inputs():
        records = [dict(r, fingerprint=_sha256_fingerprint([sim[r["step"]][n] for n in mg.PARAM_NAMES]))
                   if "fingerprint" in r else r for r in records]
        out.append((header, records))
    return out


def _copy(tmp_path: Path, what: str = "run") -> Path:
    dst = tmp_path / what
    shutil.copytree(V1 / what, dst)
    return dst


# ------------------------------------------------------------------- the fixtures as they are
def test_the_fixtures_are_format_1_and_not_regenerated() -> None:
    assert not [rel for rel in mg.golden_files() if rel.startswith("v1/")]
    assert not [rel for rel in mg.other_files() if rel.startswith("v1/")]
    assert json.loads(v1("run/run.json"))["version"] == 1
    assert decode_commit(v1(f"run/{BASE.commit_path}"), "COMMIT")["format"] == 1


def test_a_format_1_writer_by_the_doc_gives_the_fixture_bytes_and_diffckpt_reads_them() -> None:
    """Round trip: format-1 segments and COMMIT written from docs/format.md (sections 4, 7.2 and
    13, with hashlib) are byte for byte the fixtures, and decode to the records written."""
    for rel, (header, records) in zip((SEG1, SEG2), _v1_records()):
        blobs = [legacy_blob(r) for r in records]
        entries = [{"length": len(b), "raw_length": len(b), "sha256": hashlib.sha256(b).hexdigest(),
                    "step": r["step"]} for b, r in zip(blobs, records)]
        head = json.dumps(dict(header, format=1, compression="none", records=entries),
                          separators=(",", ":"), sort_keys=True).encode()
        lead = SEGMENT_MAGIC + struct.pack("<I", len(head)) + head
        data = lead + b"".join(blobs) + hashlib.sha256(lead).digest()
        assert data == v1(f"run/{rel}")
        decoded_header, decoded, problem = decode_segment(data, rel)
        assert problem is None and decoded_header["format"] == 1
        assert_same(decoded, records)
    state = v1(f"run/{BASE.state_path}")
    params = mg.initial_params()
    commit = {"files": {"state.safetensors": {"sha256": hashlib.sha256(state).hexdigest(), "size": len(state)}},
              "fingerprint": _sha256_fingerprint([params[n] for n in mg.PARAM_NAMES]),
              "format": 1, "gen": 1, "step": 0}
    assert json.dumps(commit, indent=1, sort_keys=True).encode() == v1(f"run/{BASE.commit_path}")


@pytest.mark.parametrize("rel", ["run/" + SEG1, "run/" + SEG2, "segment-zstd.seg",
                                 *[f"sharded/ranks/r{r:05d}/{s}" for r in (0, 1) for s in (SEG1, SEG2)]])
def test_format_1_segments_decode_to_what_the_current_format_holds(rel: str) -> None:
    header, records, problem = decode_segment(v1(rel), rel)
    assert problem is None and header["format"] == 1
    assert all(sorted(e) == ["length", "raw_length", "sha256", "step"] for e in header["records"])
    now = rel.replace("v1/", "")
    _, current, _ = decode_segment((GOLDEN / now).read_bytes())
    assert [r["step"] for r in records] == [r["step"] for r in current]
    for old, new in zip(records, current):
        assert ("fingerprint" in old) == ("fingerprint" in new)
        assert_same({k: v for k, v in old.items() if k != "fingerprint"},
                    {k: v for k, v in new.items() if k != "fingerprint"})
        if "fingerprint" in old:  # the same parameters: SHA-256 then, XXH3-128 now
            assert len(old["fingerprint"]) == 64 and new["fingerprint"].startswith("xxh3-128:")


def test_format_1_fingerprints_are_checked_with_sha256() -> None:
    sim = mg.simulate()
    (_, first), (_, second) = _v1_records()
    for record in first + second:
        if "fingerprint" in record:
            params = [sim[record["step"]][n] for n in mg.PARAM_NAMES]
            assert fingerprint_matches(params, record["fingerprint"])
            assert not fingerprint_matches([p + 1 for p in params], record["fingerprint"])


def test_a_format_1_base_loads() -> None:
    info, tree = RunStore(FsspecStorage(str(V1 / "run"))).load_base(BASE)
    state = v1(f"run/{BASE.state_path}")
    assert info["format"] == 1
    assert info["files"] == {"state.safetensors": {"size": len(state), "sha256": hashlib.sha256(state).hexdigest()}}
    assert fingerprint_matches([mg.initial_params()[n] for n in mg.PARAM_NAMES], info["fingerprint"])
    assert_same(tree, mg.base_tree())


def test_a_format_1_run_restores_by_replay_bitwise() -> None:
    sim = mg.simulate()
    for step in (None, 4, 3, 2, 0):
        result = load_state(str(V1 / "run"), step)
        expected = 4 if step is None else step
        assert (result["step"], result["base_step"], result["replayed"]) == (expected, 0, expected)
        assert result["result"].verified_through == (2 if expected in (2, 3) else expected)
        for name in mg.PARAM_NAMES:
            assert torch.equal(result["model"][name], sim[expected][name]), name
        for name, value in (mg.buffers_at(expected) if expected else mg.initial_buffers()).items():
            assert torch.equal(result["model"][name], value), name
        assert result["state"] == (mg.base_tree()["state"] if expected == 0 else mg._STEPS[expected][2])


def test_a_format_1_sharded_run_reassembles_bitwise() -> None:
    sim = mg.simulate()
    for step in (None, 2):
        result = load_state(str(V1 / "sharded"), step)
        expected = 4 if step is None else step
        for name in mg.PARAM_NAMES:
            assert torch.equal(result["model"][name], sim[expected][name]), name


@pytest.mark.parametrize("what", ["run", "sharded"])
def test_cli_verify_passes_on_format_1(tmp_path: Path, capsys: Cap, what: str) -> None:
    root = _copy(tmp_path, what)
    for deep in ([], ["--deep"]):
        rc, out, _ = cli(capsys, "verify", root, *deep)
        assert rc == 0 and "OK: every checksum matches" in out, out
    rc, out, _ = cli(capsys, "verify", root, "--deep", "--json")
    assert rc == 0 and json.loads(out)["problems"] == []


# ------------------------------------------------------------------------------------ damage
def test_damage_to_format_1_segments_is_found() -> None:
    data = v1("run/" + SEG1)
    (step1, off1, _), (step2, off2, len2) = _blob_offsets(data)
    _, expected, _ = decode_segment(data)
    _, records, problem = decode_segment(_flip(data, off2 + len2 // 2), "seg")
    assert_same(records, expected[:1])
    assert problem is not None and f"step {step2} fails its checksum" in problem
    _, records, problem = decode_segment(_flip(data, off1 + 1), "seg")
    assert records == [] and problem is not None and f"step {step1}" in problem
    _, records, problem = decode_segment(_flip(data, len(data) - 1), "seg")  # the 32-byte trailer
    assert len(records) == 2 and problem is not None and "checksum does not match" in problem
    _, records, problem = decode_segment(data[:-16], "seg")  # a format-2 or 3-sized digest is short
    assert len(records) == 2 and problem is not None and "checksum" in problem


def test_damage_to_a_format_1_base_is_found(tmp_path: Path, capsys: Cap) -> None:
    root = _copy(tmp_path)
    state = root / BASE.state_path
    state.write_bytes(_flip(state.read_bytes(), 100))
    with pytest.raises(CorruptRecordError, match="fails its checksum"):
        RunStore(FsspecStorage(str(root))).load_base(BASE)
    rc, out, _ = cli(capsys, "verify", root)
    assert rc == 1 and "fails its checksum" in out


def test_cli_verify_names_a_damaged_format_1_record(tmp_path: Path, capsys: Cap) -> None:
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


def test_a_format_1_marker_with_current_keys_or_the_reverse_is_damaged() -> None:
    old = json.loads(v1(f"run/{BASE.commit_path}"))
    new = json.loads((GOLDEN / "run" / BASE.commit_path).read_bytes())
    with pytest.raises(CorruptRecordError, match="state.safetensors has no size and sha256"):
        decode_commit(json.dumps({**new, "format": 1}).encode(), "COMMIT")
    with pytest.raises(CorruptRecordError, match="state.safetensors has no size and xxh3_128"):
        decode_commit(json.dumps({**old, "format": FORMAT_VERSION}).encode(), "COMMIT")
    data = v1("run/" + SEG1)
    with pytest.raises(CorruptRecordError, match="segment header is damaged"):  # sha256 entries in format 2
        decode_segment(data.replace(b'"format":1', b'"format":2', 1), "seg")


# ------------------------------------------------------------------------- unknown versions
@pytest.mark.parametrize("version", [0, 5, 17])
def test_a_commit_of_an_unknown_version_is_refused_naming_it(tmp_path: Path, version: int) -> None:
    info = json.loads(v1(f"run/{BASE.commit_path}"))
    data = json.dumps({**info, "format": version}, indent=1, sort_keys=True).encode()
    message = (f"COMMIT: COMMIT marker format {version} is not one this diffckpt reads "
               r"\(formats 1, 2, 3 and 4\); it was written by a newer diffckpt \(upgrade diffckpt to read it\)")
    with pytest.raises(CorruptRecordError, match=message):
        decode_commit(data, "COMMIT")
    root = _copy(tmp_path)
    (root / BASE.commit_path).write_bytes(data)
    with pytest.raises(CorruptRecordError, match=f"COMMIT marker format {version} is not one this diffckpt reads"):
        RunStore(FsspecStorage(str(root))).load_base(BASE)


def test_a_segment_of_an_unknown_version_is_refused_naming_it() -> None:
    data = v1("run/" + SEG1).replace(b'"format":1', b'"format":5', 1)
    with pytest.raises(CorruptRecordError, match=r"seg: segment format 5 is not one this diffckpt reads "
                       r"\(formats 1, 2, 3 and 4\); .*upgrade diffckpt"):
        decode_segment(data, "seg")


# ----------------------------------------------------------------- a root with both formats
def _module() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The golden run's model (``weight`` 2x3, ``bias``, buffers ``count`` and ``scale``) and SGD."""
    module = torch.nn.Linear(3, 2)
    module.register_buffer("count", torch.tensor(0))
    module.register_buffer("scale", torch.ones(2))
    return module, torch.optim.SGD(module.parameters(), **mg._hyper(0.5))


def resume_with_the_current_format(root: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Resume the golden run (of an older format) at step 4 as a new session, of the current
    format, train steps 5..8 on dyadic gradients (exact in float32), and return the parameters
    after each step."""
    module, opt = _module()
    assert CheckpointEngine(str(root)).restore(module, [opt], 4).step == 4
    engine = CheckpointEngine(str(root), CheckpointOptions(write_batch=2, base_every_n_steps=None,
                                                           fingerprint_every_n_steps=2, compression="none"))
    engine.start(module, [opt], 4)
    engine.write_base(4, module.state_dict(), [opt.state_dict()], {"loop": {"step": 4}})
    truth = {}
    for step in range(5, 9):
        module.weight.grad = torch.full((2, 3), step / 16)
        module.bias.grad = torch.tensor([0.25, -0.125 * step])
        opt.step()
        module.count += 1
        truth[step] = {"weight": module.weight.detach().clone(), "bias": module.bias.detach().clone()}
        engine.record_step(step, {"loop": {"step": step}} if step % 2 == 0 else None)
    assert engine.close() == 8
    return truth


def format_of(root: Path, rel: str) -> int:
    data = (root / rel).read_bytes()
    if rel.endswith("COMMIT"):
        return int(decode_commit(data, rel)["format"])
    return int(decode_segment(data, rel)[0]["format"])


def test_a_run_root_with_format_1_and_current_sessions(tmp_path: Path, capsys: Cap) -> None:
    root = _copy(tmp_path)
    truth = resume_with_the_current_format(root)
    sim = mg.simulate()
    formats = {rel: format_of(root, rel) for rel in
               [BASE.commit_path, SEG1, SEG2, BaseName(4, 2).commit_path,
                "diffs/000000000004-000000000006.g000002.seg", "diffs/000000000006-000000000008.g000002.seg"]}
    assert list(formats.values()) == [1, 1, 1, *[FORMAT_VERSION] * 3], formats
    assert json.loads((root / "run.json").read_text())["version"] == FORMAT_VERSION

    def check(step: int | None, expected: int, base: int) -> None:
        result = load_state(str(root), step)
        assert (result["step"], result["base_step"]) == (expected, base)
        want = truth[expected] if expected > 4 else sim[expected]
        for name in mg.PARAM_NAMES:
            assert torch.equal(result["model"][name], want[name]), (step, name)

    check(None, 8, 4)  # the session of the current format
    check(6, 6, 4)
    check(3, 3, 0)  # the format-1 session
    for deep in ([], ["--deep"]):
        rc, out, _ = cli(capsys, "verify", root, *deep)
        assert rc == 0 and "OK: every checksum matches" in out, out

    # Compaction of the format-1 chain writes a current base that format-1 segments continue.
    done = compact(str(root), to=2)
    assert done.written and done.verified_through == 2
    assert format_of(root, BaseName(2, 1).commit_path) == FORMAT_VERSION
    check(3, 3, 2)  # base 2 (current format) + segment 2-4 (format 1)
    rc, out, _ = cli(capsys, "verify", root, "--deep")
    assert rc == 0 and "OK: every checksum matches" in out, out

    # Retention over both: keep the two newest bases (one of each session), then only the newest.
    collect_garbage(str(root), RetentionPolicy(keep_last_bases=2), dry_run=False)
    assert not (root / BASE.commit_path).exists() and (root / SEG2).exists()
    check(3, 3, 2)
    check(None, 8, 4)
    collect_garbage(str(root), RetentionPolicy(keep_last_bases=1), dry_run=False)
    assert not (root / SEG2).exists()
    check(None, 8, 4)
    rc, out, _ = cli(capsys, "verify", root, "--deep")
    assert rc == 0 and "OK: every checksum matches" in out, out
