"""Compressed training (``DiffCheckpoint(codec=...)``) in real Lightning runs, single process and
DDP over gloo: ``kill -9`` mid-training, resume with ``ckpt_path="last"``, and compare bitwise with
an uninterrupted run that trained with the same codec and no checkpointing.

TopK without error feedback and LowPrecision keep no state, so every resume is exact end to end.
PowerSGD keeps per-rank error-feedback residuals: a resume at a base step is exact end to end; a
resume between bases restores parameters and optimizer exactly and restarts the residuals.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers import assert_bitwise_equal, load_ranks, run_script
from test_exactness import SCRIPT, SEED

from diffckpt.planning import plan
from diffckpt.runstore import RunStore
from diffckpt.storage import open_storage

STEPS = 30  # the "adamw" config: clipping, gradient accumulation 2, validation every 5 batches
DDP = ["--devices", "2"]
EXACT = ["topk:0.05", "bf16"]  # stateless: exact end to end from any step


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final state (every rank) and per-step model/optimizer dumps of uninterrupted compressed
    training without diffckpt, per (codec, processes)."""
    cache: dict[tuple[str, int], tuple[list[dict], Path]] = {}

    def get(codec: str, ranks: int) -> tuple[list[dict], Path]:
        if (codec, ranks) not in cache:
            d = tmp_path_factory.mktemp("ref")
            (d / "steps").mkdir()
            rc, log = run_script(SCRIPT, ["adamw", str(d / "ref.pt"), "--no-lib", "--codec", codec,
                                          "--dump-steps", str(d / "steps"), *(DDP if ranks > 1 else [])])
            assert rc == 0, log[-3000:]
            cache[codec, ranks] = load_ranks(d / "ref.pt", ranks), d / "steps"
        return cache[codec, ranks]

    return get


def _kill_and_resume(tmp_path: Path, codec: str, ranks: int, trial: str) -> tuple[int, int, list[dict], Path]:
    kill_at = random.Random(f"{SEED}-{codec}-{ranks}-{trial}").randrange(3, STEPS - 3)
    run = str(tmp_path / "run")
    par = DDP if ranks > 1 else []
    rc, log = run_script(SCRIPT, ["adamw", str(tmp_path / "x.pt"), "--dirpath", run, "--codec", codec, *par],
                         kill_at_step=kill_at)
    assert rc == -9, log[-2000:]
    assert "recorded with dense gradients" not in log  # every step was recorded as payloads
    (tmp_path / "steps").mkdir()
    out = tmp_path / "resumed.pt"
    rc, log = run_script(SCRIPT, ["adamw", str(out), "--dirpath", run, "--codec", codec, "--resume",
                                  "--dump-steps", str(tmp_path / "steps"), *par])
    assert rc == 0, log[-3000:]
    assert "Restoring states from the checkpoint path" in log
    # The first dump is written at on_train_start, at the restored step.
    resumed_from = min(int(p.stem[4:]) for p in (tmp_path / "steps").iterdir())
    assert resumed_from <= kill_at + 1
    return kill_at, resumed_from, load_ranks(out, ranks), tmp_path / "steps"


def _first_event(run: Path) -> dict:
    store = RunStore(open_storage(str(run)))
    return next(r["events"][0] for r, _ in store.read_records(plan(store, 1)) if r and r["events"])


def _same_step(a: Path, b: Path, step: int) -> None:
    assert_bitwise_equal(torch.load(a / f"step{step}.pt", weights_only=False),
                         torch.load(b / f"step{step}.pt", weights_only=False))


# All in make soak: a codec's payloads replay exactly under DDP in tests/core/test_compressed_ddp.py,
# top-k is killed and resumed bitwise under Accelerate's DDP by default, and Lightning's capture of a
# codec's payloads is killed and resumed with PowerSGD below.
@pytest.mark.parametrize(("codec", "ranks"), [
    pytest.param(c, r, id=f"{c}-{name}", marks=[pytest.mark.slow])
    for c in EXACT for r, name in ((1, "single"), (2, "ddp"))])
def test_stateless_codec_kill9_resume_is_bitwise_identical(codec, ranks, reference, tmp_path):
    ref, _ = reference(codec, ranks)
    kill_at, resumed_from, resumed, _ = _kill_and_resume(tmp_path, codec, ranks, "exact")
    payload = _first_event(tmp_path / "run")["payloads"][0][0]  # what the ranks exchanged
    if codec.startswith("topk"):
        assert payload["values"].shape[0] == ranks
    else:
        assert payload["values"].dtype == torch.bfloat16
    for rank in range(ranks):
        try:
            assert_bitwise_equal(ref[rank], resumed[rank])
        except AssertionError as exc:
            raise AssertionError(f"{codec} rank {rank}: killed at {kill_at}, resumed from {resumed_from} "
                                 f"(seed {SEED}): {exc}") from None


# Two ranks in make soak: PowerSGD through DDP's hook replays exactly in tests/core/test_compressed_ddp.py
# and a compressed DDP run resumes after kill -9 in the Accelerate tests; one process here by default.
@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["single", "ddp"])
def test_powersgd_kill9_resume_is_exact_for_parameters_and_optimizer(ranks, reference, tmp_path):
    codec = "powersgd:2"
    ref, ref_steps = reference(codec, ranks)
    _, resumed_from, resumed, steps = _kill_and_resume(tmp_path, codec, ranks, "ef")
    # The restored step is exactly the uninterrupted run's: model and optimizer, every tensor.
    _same_step(ref_steps, steps, resumed_from)
    if resumed_from % 10:  # between bases: error feedback restarts, so training goes on differently
        assert not torch.equal(ref[0]["model"]["net.head.weight"], resumed[0]["model"]["net.head.weight"])


# make soak: PowerSGD's per-rank residuals under DDP replay exactly in tests/core/test_compressed_ddp.py.
# PowerSGD's state across a kill is checked in one process above and under Accelerate by default.
@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)],
                         ids=["single", "ddp"])
def test_powersgd_resume_at_a_base_step_is_exact_to_the_end(ranks, reference, tmp_path):
    """Every rank's residuals are saved with each base (every 10 steps), so resuming there
    continues exactly as the uninterrupted run, to the last step, on every rank."""
    codec, par = "powersgd:2", DDP if ranks > 1 else []
    ref, _ = reference(codec, ranks)
    full = tmp_path / "full"
    rc, log = run_script(SCRIPT, ["adamw", str(tmp_path / "full.pt"), "--dirpath", str(full), "--codec", codec, *par,
                                  "--options", '{"durability": "every_step"}'])  # base 10 is asked for: no newer base may supersede it
    assert rc == 0, log[-3000:]
    for rank, state in enumerate(load_ranks(tmp_path / "full.pt", ranks)):  # checkpointing changes nothing
        assert_bitwise_equal(ref[rank], state)
    out = tmp_path / "from_base.pt"
    rc, log = run_script(SCRIPT, ["adamw", str(out), "--dirpath", str(tmp_path / "again"), "--codec", codec,
                                  "--ckpt-path", f"{full}/step=10", *par])
    assert rc == 0, log[-3000:]
    for rank, state in enumerate(load_ranks(out, ranks)):
        assert_bitwise_equal(ref[rank], state)


def test_topk_001_diffs_are_a_few_percent_of_a_full_checkpoint(tmp_path):
    """Bytes written per step for TopK(0.01) against a full model+optimizer checkpoint
    (torch.save of both state dicts) of the same model (a 0.28M-parameter GPT)."""
    (tmp_path / "steps").mkdir()
    run = tmp_path / "run"
    rc, log = run_script(SCRIPT, ["adamw", str(tmp_path / "out.pt"), "--dirpath", str(run), "--dim", "128",
                                  "--codec", "topk:0.01", "--dump-steps", str(tmp_path / "steps")])
    assert rc == 0, log[-3000:]
    full = (tmp_path / "steps" / f"step{STEPS}.pt").stat().st_size
    per_step = sum(f.stat().st_size for f in (run / "diffs").iterdir()) / STEPS
    print(f"TopK(0.01): {per_step / 1e3:.1f} kB per step, full checkpoint {full / 1e6:.2f} MB "
          f"({per_step / full:.2%})")
    assert full > 3e6
    assert per_step <= 0.03 * full


def test_fp16_loss_scaling_with_skipped_steps_single_process(tmp_path):
    """16-mixed: compression sees unscaled gradients (after GradScaler.unscale_); steps the scaler
    skips are recorded as skips. Killed and resumed, it ends bitwise where the reference does."""
    d = tmp_path / "ref"
    rc, log = run_script(SCRIPT, ["scaler_skip", str(d), "--no-lib", "--codec", "topk:0.05"])
    assert rc == 0, log[-3000:]
    run = str(tmp_path / "run")
    rc, log = run_script(SCRIPT, ["scaler_skip", str(tmp_path / "x.pt"), "--dirpath", run, "--codec", "topk:0.05"],
                         kill_at_step=random.Random(f"{SEED}-fp16").randrange(6, 16))
    assert rc == -9, log[-2000:]
    rc, log = run_script(SCRIPT, ["scaler_skip", str(tmp_path / "out.pt"), "--dirpath", run, "--codec",
                                  "topk:0.05", "--resume"])
    assert rc == 0, log[-3000:]
    assert_bitwise_equal(torch.load(d, weights_only=False), torch.load(tmp_path / "out.pt", weights_only=False))


def test_codec_under_ddp_with_fp16_loss_scaling_is_refused(tmp_path):
    run = tmp_path / "run"
    rc, log = run_script(SCRIPT, ["scaler_skip", str(tmp_path / "x.pt"), "--dirpath", str(run),
                                  "--codec", "topk:0.05", *DDP])
    assert rc != 0
    assert "UnsupportedConfigurationError: codec=... under DDP with precision='16-mixed'" in log
    assert "Use precision='bf16-mixed'" in log
    assert not run.exists()  # refused before anything was written


def test_clipping_in_configure_gradient_clipping_is_recorded(tmp_path):
    """A module that clips in its own ``configure_gradient_clipping`` (by value here): the clipping
    is recorded as applied, every step stays a payload, and the resume is bit-exact."""
    ref = tmp_path / "ref.pt"
    rc, log = run_script(SCRIPT, ["clip_hook", str(ref), "--no-lib", "--codec", "topk:0.05"])
    assert rc == 0, log[-3000:]
    run = tmp_path / "run"
    rc, log = run_script(SCRIPT, ["clip_hook", str(tmp_path / "x.pt"), "--dirpath", str(run), "--codec",
                                  "topk:0.05"], kill_at_step=random.Random(f"{SEED}-clip").randrange(5, 16))
    assert rc == -9, log[-2000:]
    assert "recorded with dense gradients" not in log
    assert _first_event(run)["clip"] == {"kind": "value", "clip_value": 0.02}
    rc, log = run_script(SCRIPT, ["clip_hook", str(tmp_path / "out.pt"), "--dirpath", str(run), "--codec",
                                  "topk:0.05", "--resume"])
    assert rc == 0, log[-3000:]
    assert_bitwise_equal(torch.load(ref, weights_only=False), torch.load(tmp_path / "out.pt", weights_only=False))
