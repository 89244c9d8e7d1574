"""Lightning's ModelParallelStrategy (FSDP2 through configure_model) on CPU, 2 processes (gloo).

Every rank records its own pieces; a ``kill -9`` and a resume with ``ckpt_path="last"`` or
``"<dirpath>/step=N"`` continue bit-exactly on every rank, and the run read in one process gives
the full tensors; so with tensor parallelism (4 processes). The strategies diffckpt cannot record
are refused at setup, saying why.
"""

from __future__ import annotations

import random
import re
import types

import pytest
import torch
from helpers import assert_bitwise_equal, run_script
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from test_exactness import SEED

import diffckpt
from diffckpt.errors import UnsupportedConfigurationError
from lightning_ckpt import DiffCheckpoint, DiffCheckpointIO
from lightning_ckpt.model_parallel import check_sharded, states_skipped
from lightning_ckpt.references import read_reference

SCRIPT = "tests/lightning/mp_script.py"
STEPS = 10  # 3 optimizer steps per epoch (2 batches accumulate, 6 batches per rank and epoch)


def _ranks(out) -> list[dict]:
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in (0, 1)]


def _same_on_every_rank(expected: list[dict], got: list[dict], what: str) -> None:
    # Each rank's pieces (to_local) of every parameter and optimizer state tensor, the
    # scheduler, the loop position and the RNG states.
    assert any(t.numel() == 0 for t in expected[1]["model"].values())  # rank 1 holds empty pieces
    for rank in (0, 1):
        try:
            assert_bitwise_equal(expected[rank], got[rank])
        except AssertionError as exc:
            raise AssertionError(f"rank {rank}, {what} (seed {SEED}): {exc}") from None


def _same_as_full(loaded: dict, full: dict) -> None:
    """``diffckpt.load_state`` of the 2-rank run against ``full_tensor()`` gathered in training."""
    assert_bitwise_equal(full["model"], loaded["model"])
    assert_bitwise_equal(full["optimizer"], loaded["optimizers"][0]["state"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Plain Lightning, no diffckpt: every rank's final pieces and every step's full tensors."""
    out = tmp_path_factory.mktemp("mp_ref") / "ref"
    rc, log = run_script(SCRIPT, [str(out), "--steps", str(STEPS), "--full"])
    assert rc == 0, log[-3000:]
    return _ranks(out), torch.load(f"{out}.full", weights_only=False)


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """A run killed with SIGKILL at a random step, read once, then resumed with "last"."""
    d = tmp_path_factory.mktemp("mp_run")
    run, mc = d / "run", d / "mc"
    kill_at = random.Random(f"{SEED}-model-parallel").randrange(6, 9)  # step 3 is durable by then
    rc, log = run_script(SCRIPT, [str(d / "x"), "--steps", str(STEPS), "--dirpath", str(run),
                                  "--model-checkpoint", str(mc)], kill_at_step=kill_at)
    assert rc == -9, log[-2000:]
    after_kill = diffckpt.load_state(str(run))
    rc, log = run_script(SCRIPT, [str(d / "resumed"), "--steps", str(STEPS), "--dirpath", str(run), "--resume"])
    assert rc == 0, log[-3000:]
    return types.SimpleNamespace(run=run, mc=mc, kill_at=kill_at, after_kill=after_kill, log=log,
                                 resumed=_ranks(d / "resumed"))


def test_kill9_then_resume_last_is_bitwise_identical_on_every_rank(killed_and_resumed, reference):
    k = killed_and_resumed
    assert "Restoring states from the checkpoint path" in k.log
    restored = [line for line in k.log.splitlines() if "diffckpt: restored step" in line]
    assert len(restored) == 2, k.log[-3000:]  # each rank replayed its own stream
    # the run root held after_kill on every rank; each rank's journal (the node-local tier) may
    # add the steps its stream had not committed yet, and a step counts once every rank has it
    step = int(re.search(r"restored step (\d+) ", restored[0])[1])  # type: ignore[index]
    assert f"restored step {step} " in restored[1] and k.after_kill["step"] <= step <= k.kill_at, (restored, k.kill_at)
    _same_on_every_rank(reference[0], k.resumed, f"killed at step {k.kill_at}, resumed from {step}")
    # ModelCheckpoint's saves became references (on every rank's call, rank 0 wrote), no DCP.
    refs = sorted(p.name for p in k.mc.iterdir())
    assert refs and all(p.is_file() for p in k.mc.iterdir()), refs
    assert all(read_reference(str(k.mc / n))["format"] == "diffckpt-ref" for n in refs)


def test_load_state_of_the_sharded_run_equals_the_full_tensors(killed_and_resumed, reference):
    full = reference[1]
    after_kill = killed_and_resumed.after_kill  # the newest step durable on both ranks at the kill
    assert 3 <= after_kill["step"] <= killed_and_resumed.kill_at, after_kill["step"]
    _same_as_full(after_kill, full[after_kill["step"]])
    newest = diffckpt.load_state(str(killed_and_resumed.run))  # after the resumed session ended
    assert newest["step"] == STEPS
    _same_as_full(newest, full[STEPS])


def test_resume_from_an_explicit_step_is_bitwise_identical(killed_and_resumed, reference, tmp_path):
    """Step 3 (an epoch end) lies in the killed session only: base 0 plus 3 replayed steps per
    rank; the resumed training writes into a new run root."""
    out = tmp_path / "resumed"
    rc, log = run_script(SCRIPT, [str(out), "--steps", str(STEPS), "--dirpath", str(tmp_path / "run2"),
                                  "--ckpt-path", f"{killed_and_resumed.run}/step=3"])
    assert rc == 0, log[-3000:]
    assert "restored step 3 " in log and "3 replayed steps" in log, log[-3000:]
    _same_on_every_rank(reference[0], _ranks(out), "resumed from step=3")


def test_fsdp_x_tensor_parallel_kill9_then_resume_is_bitwise_on_every_rank(tmp_path):
    """``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)``, 4 processes: the MLP
    tensor-parallel, the last layer replicated over the tensor-parallel ranks (recorded once)."""
    args = ["--steps", "8", "--tp", "2"]
    rc, log = run_script(SCRIPT, [str(tmp_path / "ref"), *args, "--full"])
    assert rc == 0, log[-3000:]
    run = tmp_path / "run"
    kill_at = random.Random(f"{SEED}-tensor-parallel").randrange(4, 7)  # step 3 is durable by then
    rc, log = run_script(SCRIPT, [str(tmp_path / "x"), *args, "--dirpath", str(run)], kill_at_step=kill_at)
    assert rc == -9, log[-2000:]
    rc, log = run_script(SCRIPT, [str(tmp_path / "resumed"), *args, "--dirpath", str(run), "--resume"])
    assert rc == 0, log[-3000:]
    assert len([line for line in log.splitlines() if "diffckpt: restored step" in line]) == 4, log[-3000:]
    for rank in range(4):
        expected, got = (torch.load(f"{tmp_path / n}.rank{rank}", weights_only=False) for n in ("ref", "resumed"))
        try:
            assert_bitwise_equal(expected, got)
        except AssertionError as exc:
            raise AssertionError(f"rank {rank}, killed at step {kill_at} (seed {SEED}): {exc}") from None
    _same_as_full(diffckpt.load_state(str(run)), torch.load(f"{tmp_path / 'ref'}.full", weights_only=False)[8])


def _setup(strategy, **kwargs) -> DiffCheckpoint:
    """``DiffCheckpoint.setup`` as the Trainer calls it, after the processes are set up."""
    callback = DiffCheckpoint("unused", **kwargs)
    trainer = types.SimpleNamespace(strategy=strategy, world_size=2, callbacks=[callback])
    callback.setup(trainer, None, "fit")  # type: ignore[arg-type]
    return callback


def test_codec_with_model_parallel_is_refused_at_setup():
    from diffckpt.codecs import TopK

    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    with pytest.raises(UnsupportedConfigurationError, match=r"codec=\.\.\.\) is not supported with ModelParallelStrategy"):
        _setup(strategy, codec=TopK(0.1))
    assert "load_checkpoint" not in vars(strategy)  # refused before anything was bound


def test_bound_methods_fall_back_to_the_strategy_and_are_removed_at_teardown(tmp_path):
    """Paths that are not diffckpt's load through the strategy's own method; without
    DiffCheckpointIO saves stay DCP; teardown leaves the object as it was (here: with a method
    the user had bound on it themselves)."""
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    calls = []
    strategy.load_checkpoint = lambda path, weights_only=None: calls.append(path) or {"theirs": True}
    strategy.lightning_module_state_dict = lambda: {"w": "sharded"}
    before = dict(vars(strategy))
    callback = _setup(strategy)
    assert strategy.load_checkpoint(str(tmp_path / "dcp_dir")) == {"theirs": True}
    assert calls == [str(tmp_path / "dcp_dir")]
    assert strategy.lightning_module_state_dict() == {"w": "sharded"}  # a DCP save needs it
    with states_skipped(strategy):  # the callback records a step: no state dicts to build
        assert strategy.lightning_module_state_dict() == {}
    strategy.checkpoint_io = DiffCheckpointIO()  # every save is a reference: never needed
    assert strategy.lightning_module_state_dict() == {}
    with pytest.raises(UnsupportedConfigurationError, match="configure_model left them unsharded"):
        check_sharded(types.SimpleNamespace(strategy=strategy, world_size=2), torch.nn.Linear(2, 2))  # type: ignore[arg-type]
    callback.teardown(types.SimpleNamespace(strategy=strategy), None, "fit")  # type: ignore[arg-type]
    after = dict(vars(strategy))
    assert after.pop("_checkpoint_io") is not None and before.pop("_checkpoint_io", None) is None
    assert after == before


@pytest.mark.parametrize("make", [FSDPStrategy, lambda: object.__new__(DeepSpeedStrategy)], ids=["fsdp1", "deepspeed"])
def test_fsdp1_and_deepspeed_are_refused_saying_why_and_what_instead(make):
    # Neither runs on a CPU-only machine (FSDPStrategy needs a GPU accelerator, DeepSpeed is not
    # installed), so the callback's setup is called as the Trainer would call it.
    with pytest.raises(UnsupportedConfigurationError) as info:
        _setup(make())
    message = str(info.value)
    assert "not DTensors" in message and "FSDP2 pieces" in message
    assert "ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)" in message
    assert "fully_shard" in message and "configure_model" in message
    assert ("(FSDP1)" in message) == (make is FSDPStrategy)
