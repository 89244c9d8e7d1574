"""``DiffCheckpointer`` in real Accelerate loops on CPU: ``kill -9`` mid-run and resume, compared
bitwise (``torch.equal`` on every tensor of model, optimizer, scheduler and RNG, on every rank)
with an uninterrupted run of the same loop that never imported diffckpt.

Configurations: one process with gradient accumulation, clipping and a scheduler; bf16 mixed
precision; two processes under ``torch.distributed.run`` (DDP over gloo); compressed training.
"""

from __future__ import annotations

import os
import random
import signal
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_bitwise_equal,
    free_port,
    last_step,
    load_ranks,
    reference_states,
    run_script,
    run_training,
    samples_seen,
    terminate_at_step,
    torchrun,
)

from diffckpt.planning import plan
from diffckpt.runstore import RunStore
from diffckpt.storage import open_storage

SCRIPT = "tests/accelerate/accel_script.py"
SEED = int(os.environ.get("DIFFCKPT_TEST_SEED", "20261122"))


def accelerate_launch() -> list[str]:
    """``accelerate launch`` with two processes on CPU (``--cpu`` would start only one; the
    script creates ``Accelerator(cpu=True)``)."""
    return [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--multi_gpu",
            "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--main_process_port", str(free_port())]


# name: (script arguments, processes, optimizer steps in the run); two processes are launched
# with torchrun, except "ddp_topk", which goes through `accelerate launch`
CONFIGS = {
    "accum_clip": (["--accum", "2", "--clip", "1.0"], 1, 18),
    "bf16": (["--mp", "bf16", "--clip", "0.5"], 1, 36),
    "ddp": (["--accum", "2", "--clip", "1.0", "--epochs", "4"], 2, 12),
    "stateful": (["--accum", "2", "--stateful"], 1, 18),  # use_stateful_dataloader=True
    "fp16_scaler": (["--mp", "fp16", "--scaler", "--clip", "1.0"], 1, 36),  # a GradScaler that skips
    "topk": (["--codec", "topk", "--clip", "1.0"], 1, 36),
    "powersgd": (["--codec", "powersgd", "--clip", "1.0"], 1, 36),
    "ddp_topk": (["--codec", "topk", "--clip", "1.0", "--epochs", "4"], 2, 24),
    "ddp_powersgd": (["--codec", "powersgd", "--accum", "2", "--epochs", "4"], 2, 12),
    # every_n_steps, write_batch and base_every_n_steps on "auto" (ignored by the reference run)
    "auto": (["--accum", "2", "--clip", "1.0", "--epochs", "6", "--auto"], 1, 36),
    "ddp_auto": (["--accum", "2", "--clip", "1.0", "--epochs", "8", "--auto"], 2, 24),
    # no bases from training: background compaction and retention (ignored by the reference run)
    "compacted": (["--accum", "2", "--clip", "1.0", "--epochs", "6", "--compact"], 1, 36),
    "ddp_compacted": (["--accum", "2", "--clip", "1.0", "--epochs", "8", "--compact"], 2, 24),
}


def _run(config: str, out: Path, extra: list[str] = (), **kw) -> str:
    args, ranks, _ = CONFIGS[config]
    prefix = None if ranks == 1 else accelerate_launch() if config == "ddp_topk" else torchrun()
    return run_training(SCRIPT, [str(out), *args, *extra], prefix, **kw)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final state of every rank of the uninterrupted loop without diffckpt, per configuration."""
    return reference_states(tmp_path_factory, _run, lambda config: CONFIGS[config][1])


def _resumed_from(log: str) -> int:
    return int(next(line for line in log.splitlines() if line.startswith("RESUMED")).split()[1])


def _kill_and_resume(config: str, tmp_path: Path, reference, kill_at: int | None = None) -> tuple[int, int, str]:
    _, ranks, steps = CONFIGS[config]
    kill_at = kill_at or random.Random(f"{SEED}-{config}").randrange(4, steps - 1)
    run = tmp_path / "run"
    killed = _run(config, tmp_path / "killed.pt", ["--dirpath", str(run)], kill_at_step=kill_at, drain=True)
    log = _run(config, tmp_path / "resumed.pt", ["--dirpath", str(run), "--resume", "last"])
    resumed_from = _resumed_from(log)
    # not past the step the run had reached: printed last, or journaled just before its line
    assert 0 <= resumed_from <= last_step(killed) + 1, (resumed_from, kill_at, last_step(killed))
    assert "recorded with dense gradients" not in log
    try:
        for r, (want, got) in enumerate(zip(reference(config), load_ranks(tmp_path / "resumed.pt", ranks))):
            assert_bitwise_equal(want, got, f"rank{r}")
    except AssertionError as exc:
        raise AssertionError(f"killed at step {kill_at}, resumed from {resumed_from} (seed {SEED}): {exc}") from None
    return kill_at, resumed_from, log


# bf16 kill -9 and restore("last") also runs in make gpu-check's dry run (tests/test_gpu_check.py).
# stateful in make soak: the stateful loader resumes exactly at and after an epoch's end below;
# ddp too: a DDP run launched by `accelerate launch` is killed and resumed bitwise below (ddp_topk).
@pytest.mark.parametrize("config", ["accum_clip", pytest.param("bf16", marks=pytest.mark.slow),
                                    pytest.param("ddp", marks=pytest.mark.slow),
                                    pytest.param("stateful", marks=pytest.mark.slow)])
def test_kill9_then_restore_last_is_bitwise_identical(config, reference, tmp_path):
    kill_at, resumed_from, _ = _kill_and_resume(config, tmp_path, reference)
    # The node-local tier (on by default): STEP n is printed before step n is committed (at the
    # next batch request), so the kill loses at most that step and the one before it in flight.
    assert resumed_from >= kill_at - 2, (resumed_from, kill_at, SEED)


# Under DDP in make soak: rank 0's tuned settings on every DDP rank are covered by
# tests/core/test_base_by_bytes.py (every DDP rank bases at the steps rank 0 sized); one process runs
# the tuner through Accelerate by default.
@pytest.mark.parametrize("config", ["auto", pytest.param("ddp_auto", marks=pytest.mark.slow)])
def test_auto_tuned_settings_kill9_then_restore_last_is_bitwise_identical(config, reference, tmp_path):
    """All three knobs on "auto": the tuner reviews from step 10 on (under DDP process 0 decides and
    both adopt it, or the gathers at restorable steps would hang) and the resume is exact."""
    _kill_and_resume(config, tmp_path, reference, kill_at=CONFIGS[config][2] - 4)
    store = RunStore(open_storage(str(tmp_path / "run")))
    first = store.tuning_log(1)
    assert first and first[0]["step"] % 5 == 0, first
    assert first[0]["settings"]["every_n_steps"] >= 1 and first[0]["measurements"]["step_s"] > 0


# make soak: background compaction is killed and resumed under Lightning by default.
@pytest.mark.parametrize("config", [pytest.param("compacted", marks=pytest.mark.slow),
                                    pytest.param("ddp_compacted", marks=pytest.mark.slow)])
def test_background_compaction_kill9_then_restore_last_is_bitwise_identical(config, reference, tmp_path):
    """base_every_n_steps=None: after the starting base, every base is compacted in a background
    thread of process 0, retention keeps the last two, and the resume is exact on every rank."""
    _kill_and_resume(config, tmp_path, reference, kill_at=CONFIGS[config][2] - 4)
    store = RunStore(open_storage(str(tmp_path / "run")))
    bases = store.inventory().bases
    assert bases and len(bases) <= 3  # the last 2 (and one that landed after the last collection)
    # A session writes only its starting base; the resumed one's starting base is newest here.
    started = {b.gen: store.session_meta(b.gen)["resumed_from"] for b in bases}
    assert all(store.load_base(b)[0].get("compacted") for b in bases if b.step != started[b.gen])


def test_fp16_loss_scaling_with_skipped_steps(reference, tmp_path):
    """A real GradScaler whose scale overflows skips steps (no optimizer update, scale halved);
    they are recorded as skips, and a kill -9 resume is bitwise equal to the reference."""
    _kill_and_resume("fp16_scaler", tmp_path, reference)
    full = tmp_path / "full"  # an uninterrupted run: every step's record from one base
    _run("fp16_scaler", tmp_path / "full.pt", ["--dirpath", str(full), "--base-every", "100"])
    assert_bitwise_equal(reference("fp16_scaler")[0], load_ranks(tmp_path / "full.pt", 1)[0])
    store = RunStore(open_storage(str(full)))
    records = [r for r, _ in store.read_records(plan(store)) if r]
    assert len(records) == CONFIGS["fp16_scaler"][2]
    skipped = [r["step"] for r in records if not r["events"]]
    assert skipped and len(skipped) < len(records), skipped  # some steps skipped, some updated
    scales = [r["state"]["accelerate"]["scaler"]["scale"] for r in records if r["state"]]
    assert len(set(scales)) > 1  # the scale the skips halved travels with the records


def test_stateful_loader_resumes_exactly_at_an_epoch_end_and_in_a_later_epoch(reference, tmp_path):
    """A stateful loader's first epoch reuses the iterator prepare() made, later ones draw anew:
    resuming at the end of epoch 0 (step 6) and inside epoch 1 (step 8) must both match."""
    run = tmp_path / "run"
    _run("stateful", tmp_path / "full.pt", ["--dirpath", str(run)])
    for step in (6, 8):
        _run("stateful", tmp_path / f"from{step}.pt", ["--dirpath", str(run), "--resume", str(step)])
        assert_bitwise_equal(reference("stateful")[0], load_ranks(tmp_path / f"from{step}.pt", 1)[0], f"from {step}")


# Each codec and each layout once by default (powersgd alone, topk under DDP); the other two in make soak.
@pytest.mark.parametrize("config", [pytest.param(c, marks=pytest.mark.slow) if c in ("topk", "ddp_powersgd") else c
                                    for c in ["topk", "powersgd", "ddp_topk", "ddp_powersgd"]])
def test_compressed_kill9_then_restore_last_is_bitwise_identical(config, reference, tmp_path):
    """The reference trains with accelerate_ckpt.GradientCompression and no checkpoints."""
    _kill_and_resume(config, tmp_path, reference)
    store = RunStore(open_storage(str(tmp_path / "run")))
    event = next(r["events"][0] for r, _ in store.read_records(plan(store, 1)) if r and r["events"])
    assert "grads" not in event  # recorded as the payloads training exchanged
    assert event["codec"]["codec"] == ("topk" if "topk" in config else "powersgd")
    if "topk" in config:  # one row of entries per rank
        assert event["payloads"][0][0]["values"].shape[0] == CONFIGS[config][1]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """An uninterrupted checkpointed run of ``accum_clip`` with a dump of every step."""
    d = tmp_path_factory.mktemp("full")
    (d / "dumps").mkdir()
    _run("accum_clip", d / "final.pt", ["--dirpath", str(d / "run"), "--dump-steps", str(d / "dumps")])
    return d


def test_checkpointing_does_not_perturb_training(full_run, reference):
    assert_bitwise_equal(reference("accum_clip")[0], load_ranks(full_run / "final.pt", 1)[0])


# mid-epoch, the end of an epoch (6 steps each), mid-epoch; 4 in make soak: 13 is mid-epoch too
@pytest.mark.parametrize("step", [pytest.param(4, marks=pytest.mark.slow), 6, 13])
def test_restore_explicit_step_is_that_step_and_continues_exactly(step, full_run, reference, tmp_path):
    log = _run("accum_clip", tmp_path / "at.pt", ["--dirpath", str(full_run / "run"), "--resume", str(step),
                                                   "--epochs", "0"])
    assert _resumed_from(log) == step
    restored = load_ranks(tmp_path / "at.pt", 1)[0]
    dumped = torch.load(full_run / "dumps" / f"step{step}.pt", weights_only=False)
    for key in ("model", "optimizer", "scheduler", "accelerator_step"):
        assert_bitwise_equal(dumped[key], restored[key], key)
    _run("accum_clip", tmp_path / "end.pt", ["--dirpath", str(full_run / "run"), "--resume", str(step)])
    assert_bitwise_equal(reference("accum_clip")[0], load_ranks(tmp_path / "end.pt", 1)[0])


def test_save_state_and_load_state_restore_through_replay(reference, tmp_path):
    """save_state at step 5 writes a base and references it instead of the weights; load_state of
    that directory replays, and training continues bitwise as if never stopped."""
    run, saved = tmp_path / "run", tmp_path / "saved"
    _run("accum_clip", tmp_path / "x.pt", ["--dirpath", str(run), "--save-state-at", "5", "--save-dir",
                                           str(saved), "--stop-at", "8"])
    files = sorted(os.listdir(saved))
    assert "custom_checkpoint_0.pkl" in files and "optimizer.bin" in files
    assert not [f for f in files if f.startswith(("model", "pytorch_model"))], files
    assert f"step 5 of the diffckpt run {run}" in (saved / "DIFFCKPT.txt").read_text()
    assert any(b.step == 5 for b in RunStore(open_storage(str(run))).inventory().bases)
    log = _run("accum_clip", tmp_path / "loaded.pt", ["--dirpath", str(run), "--load-state", str(saved)])
    assert _resumed_from(log) == 5
    assert_bitwise_equal(reference("accum_clip")[0], load_ranks(tmp_path / "loaded.pt", 1)[0])


# ddp in make soak: a SIGTERM under DDP flushes every rank under Fabric and the Trainer by default.
@pytest.mark.parametrize("config", ["accum_clip", pytest.param("ddp", marks=pytest.mark.slow)])
def test_sigterm_flushes_every_step_and_exits(config, reference, tmp_path):
    """SIGTERM to the process (or to torchrun, which forwards it to both workers): the processes
    agree on a step, record it, flush, log how far durability got and exit; the resume is exact."""
    run = tmp_path / "run"
    args, ranks, _ = CONFIGS[config]
    launch = None if ranks == 1 else torchrun()
    rc, log, sent_after, last = terminate_at_step(SCRIPT, [str(tmp_path / "x.pt"), *args, "--dirpath", str(run)],
                                                  5, prefix=launch)
    assert rc == 128 + signal.SIGTERM if ranks == 1 else rc != 0, log[-2000:]
    assert sent_after is not None and last <= sent_after + 1
    assert f"stopped by SIGTERM; durable up to step {last} in" in log, log[-2000:]
    log = _run(config, tmp_path / "resumed.pt", ["--dirpath", str(run), "--resume", "last"])
    assert _resumed_from(log) == last
    for r, (want, got) in enumerate(zip(reference(config), load_ranks(tmp_path / "resumed.pt", ranks))):
        assert_bitwise_equal(want, got, f"rank{r}")


def test_different_model_is_refused_and_the_run_is_untouched(full_run, tmp_path):
    before = sorted(p.name for p in (full_run / "run").rglob("*"))
    rc, log = run_script(SCRIPT, [str(tmp_path / "x.pt"), "--accum", "2", "--dirpath", str(full_run / "run"),
                                  "--resume", "last", "--width", "48"])
    assert rc != 0 and "IncompatibleCheckpointError" in log, log[-2000:]
    assert sorted(p.name for p in (full_run / "run").rglob("*")) == before


# make soak: the kill -9 tests above run the same DiffCheckpointer calls as the example, bitwise.
@pytest.mark.slow
def test_example_is_bit_exact(tmp_path):
    """examples/accelerate_train.py (one epoch): reference, SIGKILL, restore("last"), compare."""
    rc, log = run_script("examples/accelerate_train.py", ["--epochs", "1", "--seed", "3"])
    assert rc == 0 and "bit-exact: yes" in log, log[-3000:]


def test_corrupt_newest_segment_falls_back_to_an_intact_step(tmp_path):
    """A flipped byte in the newest segment: restore("last") warns, naming it, and restores the
    newest step that can still be rebuilt, bitwise as it was trained."""
    run, dumps = tmp_path / "run", tmp_path / "dumps"
    dumps.mkdir()
    _run("accum_clip", tmp_path / "full.pt", ["--dirpath", str(run), "--dump-steps", str(dumps)])
    newest = max((run / "diffs").iterdir(), key=lambda p: int(p.name.split("-")[1].split(".")[0]))
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    log = _run("accum_clip", tmp_path / "at.pt", ["--dirpath", str(run), "--resume", "last", "--epochs", "0"])
    step = _resumed_from(log)
    assert 0 < step < 18 and newest.name in log, log[-2000:]
    restored = load_ranks(tmp_path / "at.pt", 1)[0]
    dumped = torch.load(dumps / f"step{step}.pt", weights_only=False)
    for key in ("model", "optimizer", "scheduler", "accelerator_step"):
        assert_bitwise_equal(dumped[key], restored[key], key)


def test_untracked_loop_records_after_the_scheduler_steps(tmp_path):
    """A loop iterating the prepared loader directly commits each step once the scheduler has
    stepped; restore(N) then gives that step's model, optimizer, scheduler and counter."""
    run, dumps = tmp_path / "run", tmp_path / "dumps"
    dumps.mkdir()
    _run("accum_clip", tmp_path / "full.pt", ["--dirpath", str(run), "--no-track", "--dump-steps", str(dumps)])
    for step in (5, 18):
        log = _run("accum_clip", tmp_path / f"at{step}.pt",
                   ["--dirpath", str(run), "--no-track", "--resume", str(step), "--epochs", "0"])
        assert _resumed_from(log) == step
        restored = load_ranks(tmp_path / f"at{step}.pt", 1)[0]
        dumped = torch.load(dumps / f"step{step}.pt", weights_only=False)
        for key in ("model", "optimizer", "scheduler", "accelerator_step"):
            assert_bitwise_equal(dumped[key], restored[key], f"step {step} {key}")


def test_epoch_continues_over_another_number_of_processes_every_sample_once(tmp_path):
    """2 processes stop 3 steps into epoch 1, 3 resume it and stop 2 steps later, 2 finish it:
    counting the samples each rank trained on, epoch 1 saw every sample exactly once (96 samples in
    global batches of 4 × processes, dealt evenly: no padding), and the next epoch is whole."""
    run, samples = tmp_path / "run", tmp_path / "samples"
    common = ["--dirpath", str(run), "--batch", "4", "--epochs", "3", "--log-samples"]
    run_training(SCRIPT, [str(tmp_path / "a.pt"), "--stop-at", "15", *common, f"{samples}.a"], torchrun())
    log_b = run_training(SCRIPT, [str(tmp_path / "b.pt"), "--resume", "last", "--stop-at", "17", *common,
                                  f"{samples}.b"], torchrun(processes=3))
    log_c = run_training(SCRIPT, [str(tmp_path / "c.pt"), "--resume", "last", *common, f"{samples}.c"], torchrun())
    assert "RESUMED 15 rank 0" in log_b and "RESUMED 17 rank 0" in log_c
    everything = list(range(96))
    assert samples_seen(f"{samples}.a", 2, 0) == everything  # 12 steps of 2 × 4
    b = samples_seen(f"{samples}.b", 3, 1, (15, 17))
    epoch1 = samples_seen(f"{samples}.a", 2, 1, (12, 15)) + b + samples_seen(f"{samples}.c", 2, 1)
    assert sorted(epoch1) == everything and len(b) == 24  # 2 steps of 3 × 4
    assert samples_seen(f"{samples}.c", 2, 2) == everything
    assert "trained on 2 processes and resumes on 3" in log_b and "cannot draw" not in log_b + log_c
