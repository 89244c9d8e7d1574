"""Setups ``DiffCheckpointer`` refuses, with the fix in the message, before anything is written;
and what ``restore`` does on an empty run root or for a step that is not there."""

from __future__ import annotations

import os

import pytest
import torch
from accelerate import Accelerator
from accelerate.data_loader import BatchSamplerShard
from accelerate.state import AcceleratorState
from accelerate.utils import (
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
    ProjectConfiguration,
)
from helpers import run_script, torchrun
from test_accelerate_training import SCRIPT
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

from accelerate_ckpt import DiffCheckpointer, GradientCompression
from diffckpt import CheckpointNotFoundError, DiffCkptError, UnsupportedConfigurationError
from diffckpt.cli import main
from diffckpt.codecs import TopK
from diffckpt.integration import Remainder


@pytest.fixture
def accelerator_factory():
    made = []

    def make(cls=Accelerator, **kwargs):
        acc = cls(cpu=True, **kwargs)
        made.append(acc)
        return acc
    yield make
    AcceleratorState._reset_state(True)


def _prepare(acc):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 2)), batch_size=4, shuffle=True)
    return acc.prepare(model, opt, dl)


class _Sharded(Accelerator):
    """FSDP and DeepSpeed cannot run on this CPU-only machine (``cpu=True`` turns them into
    MULTI_CPU); only the reported type is changed, the rest is a real Accelerator."""

    kind = None  # set after prepare(), which would try to shard for real

    @property
    def distributed_type(self):
        return self.kind or super().distributed_type


@pytest.mark.parametrize("kind", [DistributedType.FSDP, DistributedType.DEEPSPEED])
def test_sharded_strategies_are_refused(kind, accelerator_factory, tmp_path):
    acc = accelerator_factory(_Sharded)
    _prepare(acc)
    acc.kind = kind
    match = ("does not support Accelerate's FSDP plugin.*ModelParallelStrategy" if kind == DistributedType.FSDP
             else "does not support DeepSpeed.*DDP or a single")
    with pytest.raises(UnsupportedConfigurationError, match=match):
        DiffCheckpointer(acc, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("version", [1, 2])
def test_an_fsdp_plugin_that_cpu_true_ignores_is_refused(version, accelerator_factory, tmp_path, monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")  # the constructor sets it; restored after the test
    acc = accelerator_factory(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=version))
    _prepare(acc)
    assert acc.distributed_type != DistributedType.FSDP  # really ignored: the model is not sharded
    with pytest.raises(UnsupportedConfigurationError, match="FSDP plugin was given.*Accelerate ignored it"):
        DiffCheckpointer(acc, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_processes_that_did_not_join_are_refused(accelerator_factory, tmp_path, monkeypatch):
    acc = accelerator_factory()
    _prepare(acc)
    monkeypatch.setenv("WORLD_SIZE", "2")  # launched as 2 processes, but Accelerate runs each alone
    with pytest.raises(UnsupportedConfigurationError, match="cpu=True.*ACCELERATE_USE_CPU"):
        DiffCheckpointer(acc, tmp_path / "run")


def test_run_root_inside_accelerates_rotated_checkpoints_is_refused(accelerator_factory, tmp_path):
    acc = accelerator_factory(project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2))
    _prepare(acc)
    with pytest.raises(UnsupportedConfigurationError, match="total_limit.*elsewhere"):
        DiffCheckpointer(acc, tmp_path / "checkpoints" / "diffs")
    DiffCheckpointer(acc, tmp_path / "diffckpt").close()  # next to it is fine


def test_codec_with_an_accelerate_comm_hook_is_refused(accelerator_factory, tmp_path):
    acc = accelerator_factory(kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)])
    _prepare(acc)
    with pytest.raises(UnsupportedConfigurationError, match="comm_hook='fp16'.*drop comm_hook"):
        DiffCheckpointer(acc, tmp_path / "run", codec=TopK(0.01))
    with pytest.raises(TypeError, match="diffckpt codec"):
        GradientCompression(acc, "topk")


def test_nothing_prepared_and_unprepared_loader_are_refused(accelerator_factory, tmp_path):
    acc = accelerator_factory()
    with pytest.raises(UnsupportedConfigurationError, match="no model was prepared"):
        DiffCheckpointer(acc, tmp_path / "run")
    _prepare(acc)
    ckpt = DiffCheckpointer(acc, tmp_path / "run")
    with pytest.raises(DiffCkptError, match="accelerator.prepare returned"):
        ckpt.dataloader(DataLoader(TensorDataset(torch.randn(4, 4)), batch_size=2))
    ckpt.close()


def test_restore_on_empty_root_starts_at_zero_and_a_missing_step_raises(accelerator_factory, tmp_path, capsys):
    acc = accelerator_factory()
    model, opt, dl = _prepare(acc)
    ckpt = DiffCheckpointer(acc, tmp_path / "run", write_batch=1)
    assert ckpt.restore("last") == 0
    with ckpt:
        for x, y in ckpt.dataloader(dl):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    assert ckpt.durable_step == 4
    again = DiffCheckpointer(acc, tmp_path / "run")
    with pytest.raises(CheckpointNotFoundError, match="9"):
        again.restore(9)
    with pytest.raises(ValueError, match="'last' or a step number"):
        again.restore("newest")
    assert again.restore(4) == 4
    again.close()
    assert main(["ls", str(tmp_path / "run")]) == 0  # `ls` says how to resume an Accelerate run
    assert f'DiffCheckpointer(accelerator, "{tmp_path / "run"}").restore("last")' in capsys.readouterr().out


def test_memory_storage_with_several_processes_is_refused(tmp_path):
    rc, log = run_script(SCRIPT, [str(tmp_path / "x.pt"), "--dirpath", "memory://run"], prefix=torchrun())
    assert rc != 0 and "memory:// is private to each process" in log, log[-2000:]



def _train(acc, model, opt, loader, steps):
    for i, (x, y) in enumerate(loader):
        if i == steps:
            break  # the request for this batch was a boundary: the last step is recorded
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()


def test_close_makes_the_last_step_restorable_with_every_n_steps(accelerator_factory, tmp_path):
    """Step 3 is recorded without state (every_n_steps=2) when the next batch is requested;
    close() then writes a base at it, so the last step is restorable."""
    acc = accelerator_factory()
    model, opt, dl = _prepare(acc)
    with DiffCheckpointer(acc, tmp_path / "run", every_n_steps=2, write_batch=1) as ckpt:
        _train(acc, model, opt, ckpt.dataloader(dl), 3)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    assert ckpt.durable_step == 3
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    again = DiffCheckpointer(acc, tmp_path / "run")
    assert again.restore("last") == 3
    assert all(torch.equal(trained[k], v) for k, v in model.state_dict().items())
    again.close()


def test_a_loader_with_a_batch_sampler_of_its_own_is_tracked_and_restored(accelerator_factory, tmp_path):
    """A batch sampler without a batch size: positions record no dealing (nothing to count samples
    by), and a resume on the same number of processes skips the consumed batches as always."""

    class Pairs:  # index pairs; no batch_size attribute
        def __iter__(self):
            return iter([[0, 1], [2, 3], [4, 5], [6, 7]])

        def __len__(self):
            return 4

    acc = accelerator_factory()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 2)), batch_sampler=Pairs())
    model, opt, dl = acc.prepare(model, opt, dl)
    with DiffCheckpointer(acc, tmp_path / "run", write_batch=1) as ckpt:
        _train(acc, model, opt, ckpt.dataloader(dl), 2)
        assert ckpt.dataloader(dl).position()["dealing"] is None
    again = DiffCheckpointer(acc, tmp_path / "run")
    assert again.restore("last") == 2
    rest = [x for x, _ in again.dataloader(dl)]
    assert len(rest) == 2
    again.close()


def test_load_state_of_an_automatically_named_save_continues_the_numbering(accelerator_factory, tmp_path):
    """save_state writes checkpoints/checkpoint_0 without the weights; load_state replays them and
    sets the save counter, so the next automatic save_state is checkpoint_1."""
    config = {"project_config": ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)}
    acc = accelerator_factory(**config)
    model, opt, dl = _prepare(acc)
    with DiffCheckpointer(acc, tmp_path / "diffckpt", write_batch=1) as ckpt:
        _train(acc, model, opt, ckpt.dataloader(dl), 2)
        acc.save_state()
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        _train(acc, model, opt, ckpt.dataloader(dl), 1)
    checkpoint = tmp_path / "checkpoints" / "checkpoint_0"
    assert "DIFFCKPT.txt" in os.listdir(checkpoint) and "model.safetensors" not in os.listdir(checkpoint)
    AcceleratorState._reset_state(True)
    acc = accelerator_factory(**config)
    model, opt, dl = _prepare(acc)
    ckpt = DiffCheckpointer(acc, tmp_path / "diffckpt")
    acc.load_state(str(checkpoint))
    assert ckpt.step == 2 and acc.project_configuration.iteration == 1
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    acc.save_state()
    assert (tmp_path / "checkpoints" / "checkpoint_1").is_dir()
    ckpt.close()


def test_save_state_folders_keep_their_steps_until_total_limit_removes_them(accelerator_factory, tmp_path):
    """Each save_state folder keeps its step in the run root (a marker every later session and
    ``diffckpt gc`` read); Accelerate's ``total_limit`` removes the oldest folder, and with it the
    keep of its step, so that retention may reclaim it."""
    from diffckpt import CheckpointOptions, RetentionPolicy, collect_garbage, open_storage
    from diffckpt.keptsteps import KeptSteps
    from diffckpt.runstore import RunStore

    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=1)
    acc = accelerator_factory(project_config=config)
    model, opt, dl = _prepare(acc)
    run = tmp_path / "diffckpt"
    kept = KeptSteps(open_storage(str(run)), lambda fn: fn(), lambda: None)
    with DiffCheckpointer(acc, run, write_batch=1, options=CheckpointOptions(retention=None)) as ckpt:
        _train(acc, model, opt, ckpt.dataloader(dl), 2)
        acc.save_state()  # checkpoint_0: step 2
        ckpt.engine.flush()
        assert [(k.step, k.why) for k in kept.saved()] == [(2, f"save_state({tmp_path}/checkpoints/checkpoint_0)")]
        _train(acc, model, opt, ckpt.dataloader(dl), 2)
        acc.save_state()  # checkpoint_1 (step 4); total_limit=1 removed checkpoint_0
    assert not (tmp_path / "checkpoints" / "checkpoint_0").exists()
    assert [(k.step, k.why) for k in kept.saved()] == [(4, f"save_state({tmp_path}/checkpoints/checkpoint_1)")]
    collect_garbage(run, RetentionPolicy(keep_last_bases=1), dry_run=False)
    assert [b.step for b in RunStore(open_storage(str(run))).inventory().bases] == [4]


def test_accelerate_deals_the_remainder_of_its_global_sampler_in_whole_batches():
    """BatchSamplerShard over a Remainder: every rank's batches together are the sampler's order
    after the skipped prefix (even_batches pads from the start of what is left)."""
    base = list(RandomSampler(range(96)))
    for world, skip in [(2, 24), (3, 48), (3, 0), (2, 90)]:
        seen = []
        for rank in range(world):
            shard = BatchSamplerShard(BatchSampler(Remainder(base, skip), 4, drop_last=False), world, rank)
            seen += [i for b in shard for i in b]
        rest = base[skip:]
        assert sorted(set(seen)) == sorted(rest)
        assert len(seen) - len(rest) < 4 * world  # padding to whole rounds of batches only
