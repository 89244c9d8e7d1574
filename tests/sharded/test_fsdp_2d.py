"""Sharded training over 2-D meshes (4 gloo processes): HSDP (``fully_shard`` over a
``(replicate, shard)`` mesh) and FSDP x tensor parallelism (the MLP ``ColwiseParallel`` /
``RowwiseParallel`` over ``tp``, then ``fully_shard`` over ``dp``), through the core engine.

Every run is a real multi-process job (``fsdp_loop.py``), killed with SIGKILL of the whole
process tree. A resumed run is compared on every rank, tensor by tensor with ``torch.equal``, with
a run that never used diffckpt; a run resumed on another layout with the full tensors
(``full_tensor()``) of the run before it at the restored step.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_runs import record_span
from helpers import assert_bitwise_equal, run_script

import diffckpt
from diffckpt.segment import decode_segment
from diffckpt.tree import unpack_tree

SCRIPT = "tests/sharded/fsdp_loop.py"
STEPS = 8
MESH = {"hsdp": ["--world", "4", "--layout", "hsdp", "--mesh", "2", "2"],
        "tp": ["--world", "4", "--layout", "tp", "--mesh", "2", "2"]}


def train(out: Path, steps: int, *extra: str, kill_at: int | None = None, ok: bool = True) -> str:
    rc, log = run_script(SCRIPT, [str(out), "--steps", str(steps), *extra], kill_at_step=kill_at, timeout=300)
    if kill_at is None and ok:
        assert rc == 0, log[-4000:]
    return log


def load(path: Path) -> Any:
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, Path]:
    """Each 2-D layout's uninterrupted run without diffckpt: every rank's pieces at the end, the
    full tensors at the last step."""
    out = {}
    for layout, args in MESH.items():
        out[layout] = tmp_path_factory.mktemp(layout)
        train(out[layout], STEPS, *args, "--full-at", str(STEPS))
    return out


def stream(root: Path, rank: int) -> Path:
    return root / f"ranks/r{rank:05d}"


@pytest.mark.parametrize("layout", ["hsdp", "tp"])
def test_kill_and_resume_bitwise_on_every_rank_with_replicas_written_once(references, layout, tmp_path):
    kill_at = random.Random(os.getpid()).randint(3, STEPS - 2)
    root = tmp_path / "run"
    train(tmp_path / "a", STEPS, *MESH[layout], "--root", str(root), kill_at=kill_at)
    log = train(tmp_path / "b", STEPS, *MESH[layout], "--root", str(root), "--resume")
    assert "STEP 1\n" not in log, f"killed at step {kill_at}, but the resumed run started over"
    for rank in range(4):  # parameters, AdamW's moments on sharded and replicated pieces, scheduler, RNG
        assert_bitwise_equal(load(references[layout] / f"rank{rank}.pt"), load(tmp_path / "b" / f"rank{rank}.pt"),
                             f"{layout} rank {rank}")
    # Consolidated in one process: the full tensors the live run gathered with full_tensor().
    state = diffckpt.load_state(root)
    assert state["step"] == STEPS
    full = load(references[layout] / f"full{STEPS}.pt")
    assert_bitwise_equal(full["model"], state["model"])
    assert_bitwise_equal(full["optimizer"], state["optimizers"][0]["state"])

    # A replicated block is recorded by the lowest rank holding it. HSDP 2x2: ranks 2 and 3 replicate
    # ranks 0 and 1 wholly; FSDP x TP: rank 1 holds the last layer's block of rank 0 (outside the plan).
    replica, empty = {"hsdp": (2, {"0.weight", "0.bias", "3.weight", "3.bias", "5.weight", "5.bias"}),
                      "tp": (1, {"3.bias", "5.weight", "5.bias"})}[layout]
    base = next(stream(root, replica).glob("bases/*/state.safetensors"))
    tree = unpack_tree(base.read_bytes())
    assert {k for k, v in tree["model"].items() if v.numel() == 0} == empty
    owner_base = unpack_tree(next(stream(root, 0).glob("bases/*/state.safetensors")).read_bytes())
    assert all(v.numel() > 0 for v in owner_base["model"].values())
    names = [n for group in tree_names(root, replica) for n in group]
    for seg in stream(root, replica).glob("diffs/*.seg"):
        for record in decode_segment(seg.read_bytes())[1]:
            for event in record["events"]:
                grads = [g for group in event["grads"] for g in group]
                assert {n for n, g in zip(names, grads) if g is None} == empty, seg


def tree_names(root: Path, rank: int) -> list[list[str]]:
    meta = json.loads(next(stream(root, rank).glob("sessions/g*.json")).read_text())
    return meta["optimizer_params"][0]


def test_resume_on_other_layouts_and_world_sizes_restores_the_state_exactly(tmp_path):
    """One process unsharded -> FSDP x TP 2x2 -> HSDP 4x1 -> TP 1x4 -> FSDP2 on 2 processes -> one
    process unsharded -> one process consolidating (``load_state``), all on one run root.

    The state restored is exact on every layout; the training after it is not bit-identical to
    the run that would have continued on the old layout, since the reductions change."""
    root = tmp_path / "run"
    runs = [("a", 2, ["--world", "1", "--unsharded", "--layout", "tp"]),
            ("b", 4, ["--world", "4", "--layout", "tp", "--mesh", "2", "2"]),
            ("c", 6, ["--world", "4", "--layout", "hsdp", "--mesh", "4", "1"]),
            ("d", 8, ["--world", "4", "--layout", "tp", "--mesh", "1", "4"]),
            ("e", 10, ["--world", "2", "--wide"]),
            ("f", 12, ["--world", "1", "--unsharded", "--layout", "tp"])]
    before = None
    for name, steps, args in runs:
        train(tmp_path / name, steps, *args, "--root", str(root), "--full-at", str(steps),
              *(["--resume", "--dump-restored"] if before else []))
        if before is not None:
            restored, (prev, at) = load(tmp_path / name / "restored.pt"), before
            assert restored["step"] == at, name
            expected = load(tmp_path / prev / f"full{at}.pt")
            assert_bitwise_equal(expected["model"], restored["model"], f"{prev} -> {name}")
            assert_bitwise_equal(expected["optimizer"], restored["optimizer"], f"{prev} -> {name}")
        before = (name, steps)
    state, expected = diffckpt.load_state(root), load(tmp_path / "f" / "full12.pt")
    assert state["step"] == 12
    assert_bitwise_equal(expected["model"], state["model"])
    assert_bitwise_equal(expected["optimizer"], state["optimizers"][0]["state"])


def test_a_divergent_replica_is_named_and_its_base_not_written(tmp_path):
    root = tmp_path / "run"
    # Rank 3 changes its piece of 0.weight after step 5; its replica is rank 1 (HSDP 2x2). Bases
    # come every 4 steps: the one at 8 finds it.
    log = train(tmp_path / "a", STEPS, *MESH["hsdp"], "--root", str(root), "--diverge", "5", ok=False)
    assert "ReplicaDivergenceError" in log and "'0.weight' (rank 1 against rank 3)" in log, log[-4000:]
    assert all(sorted(p.name for p in stream(root, r).glob("bases/*")) == ["000000000000.g000001",
                                                                           "000000000004.g000001"]
               for r in range(4))


def test_a_damaged_owner_record_sends_every_rank_back_a_step(references, tmp_path):
    """HSDP: rank 0 owns the blocks rank 2 replicates. A flipped byte in rank 0's base at the last
    step and one in its last record (neither visible in any listing) make rank 0 stop a step early;
    every rank goes back there (rank 2 takes its replicated blocks from rank 0's stream at that
    step), and training continues bitwise. A missing owner base and segment bound the durable step
    from the listings alone."""
    root = tmp_path / "run"
    train(tmp_path / "a", STEPS, *MESH["hsdp"], "--root", str(root))
    other = tmp_path / "run2"
    shutil.copytree(root, other)
    seg = max(stream(root, 0).glob("diffs/*.seg"))
    data = bytearray(seg.read_bytes())
    offset, length = record_span(bytes(data), STEPS)
    data[offset + length // 2] ^= 0xFF
    seg.write_bytes(bytes(data))
    base = next(stream(root, 0).glob(f"bases/*{STEPS}*/state.safetensors"))
    data = bytearray(base.read_bytes())
    data[len(data) // 2] ^= 0xFF
    base.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=f"restoring step {STEPS - 1}"):
        assert diffckpt.load_state(root)["step"] == STEPS - 1
    log = train(tmp_path / "b", STEPS, *MESH["hsdp"], "--root", str(root), "--resume")
    assert f"STEP {STEPS}" in log and f"STEP {STEPS - 1}\n" not in log
    for rank in range(4):
        assert_bitwise_equal(load(references["hsdp"] / f"rank{rank}.pt"), load(tmp_path / "b" / f"rank{rank}.pt"),
                             f"rank {rank}")
    # Rank 0's base at the last step and its last segment (steps 7 and 8) gone: 6 is the newest
    # step every rank holds, and its replicas' blocks come from rank 0's stream there.
    shutil.rmtree(next(stream(other, 0).glob(f"bases/*{STEPS}*")))
    max(stream(other, 0).glob("diffs/*.seg")).unlink()
    assert diffckpt.load_state(other)["step"] == STEPS - 2


# make soak: 8 processes on CI's 2 cores (about 95 s); the 2-D tests above run the same recording, replica
# and restore code by default. 3-D (HSDP x TP, torchtitan's dp_replicate x dp_shard x tp): the MLP
# tensor-parallel over "tp", fully_shard over the (replicate, shard) sub-mesh.
@pytest.mark.slow
def test_hsdp_x_tensor_parallel_3d_kill_and_resume_bitwise_on_every_rank(tmp_path):
    args = ["--world", "8", "--layout", "hsdp-tp", "--mesh", "2", "2", "2"]
    train(tmp_path / "ref", STEPS, *args, "--full-at", str(STEPS))
    root = tmp_path / "run"
    kill_at = random.Random(os.getpid()).randint(3, STEPS - 2)
    train(tmp_path / "a", STEPS, *args, "--root", str(root), kill_at=kill_at)
    log = train(tmp_path / "b", STEPS, *args, "--root", str(root), "--resume")
    assert "STEP 1\n" not in log, f"killed at step {kill_at}, but the resumed run started over"
    for rank in range(8):
        assert_bitwise_equal(load(tmp_path / "ref" / f"rank{rank}.pt"), load(tmp_path / "b" / f"rank{rank}.pt"),
                             f"rank {rank}")
    state = diffckpt.load_state(root)
    full = load(tmp_path / "ref" / f"full{STEPS}.pt")
    assert_bitwise_equal(full["model"], state["model"])
    assert_bitwise_equal(full["optimizer"], state["optimizers"][0]["state"])
    # The replicate dim's second half (ranks 4-7) holds ranks 0-3's blocks: its bases hold no parameter bytes.
    for rank in range(4, 8):
        tree = unpack_tree(next(stream(root, rank).glob("bases/*/state.safetensors")).read_bytes())
        assert all(v.numel() == 0 for v in tree["model"].values()), rank
