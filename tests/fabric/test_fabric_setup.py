"""What ``FabricCheckpointer`` refuses, before anything is written, with a message naming the fix;
and ``DiffCheckpointIO`` given to Fabric, which is not a supported path."""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import Logger
from lightning.fabric.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, TensorDataset

from diffckpt import CheckpointOptions, TuningOptions
from diffckpt.errors import DiffCkptError, UnsupportedConfigurationError
from lightning_ckpt import DiffCheckpointIO, FabricCheckpointer


def _setup(fabric: Fabric):
    model = torch.nn.Linear(4, 2)
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
    return model, opt, loader


def test_model_parallel_strategy_is_refused_at_construction(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1, strategy=ModelParallelStrategy(lambda m, _: m))
    with pytest.raises(UnsupportedConfigurationError, match="does not support ModelParallelStrategy.*strategy='ddp'"):
        FabricCheckpointer(fabric, tmp_path / "run", model=None, optimizers=None)
    assert not (tmp_path / "run").exists()


def test_diffcheckpointio_plugin_is_refused_by_the_checkpointer(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[DiffCheckpointIO()])
    model, opt, _ = _setup(fabric)
    with pytest.raises(UnsupportedConfigurationError, match=r"Fabric\(plugins=\[DiffCheckpointIO\(\)\]\) is not "
                                                            r"supported.*FabricCheckpointer"):
        FabricCheckpointer(fabric, tmp_path / "run", model=model, optimizers=opt)


def test_fabric_save_through_diffcheckpointio_names_the_fabric_path(tmp_path):
    """Lightning gives a CheckpointIO plugin no call when Fabric is built, so the plugin alone can
    refuse only at its first use: ``fabric.save``/``fabric.load``."""
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[DiffCheckpointIO()])
    model, opt, _ = _setup(fabric)
    with pytest.raises(DiffCkptError, match="with Fabric remove DiffCheckpointIO.*FabricCheckpointer"):
        fabric.save(tmp_path / "x.ckpt", {"model": model, "optimizer": opt})
    plain = Fabric(accelerator="cpu", devices=1)
    m, o, loader = _setup(plain)
    with FabricCheckpointer(plain, tmp_path / "run", model=m, optimizers=o) as ckpt:
        for _ in ckpt.dataloader(loader):
            pass
    with pytest.raises(DiffCkptError, match="with Fabric remove DiffCheckpointIO.*FabricCheckpointer"):
        fabric.load(tmp_path / "run", {"model": model})


def test_objects_not_from_fabric_setup_are_refused(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    model, opt, _ = _setup(fabric)
    with pytest.raises(UnsupportedConfigurationError, match="model= must be the module fabric.setup"):
        FabricCheckpointer(fabric, tmp_path / "run", model=model.module, optimizers=opt)
    with pytest.raises(UnsupportedConfigurationError, match="optimizers= must be the optimizer"):
        FabricCheckpointer(fabric, tmp_path / "run", model=model, optimizers=opt.optimizer)


def test_loop_misuse_is_refused(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    model, opt, loader = _setup(fabric)
    with FabricCheckpointer(fabric, tmp_path / "run", model=model, optimizers=opt) as ckpt:
        with pytest.raises(DiffCkptError, match="track one training loader"):
            ckpt.dataloader(loader._dataloader)  # the loader before fabric.setup_dataloaders
        tracked = ckpt.dataloader(loader)
        assert ckpt.dataloader(loader) is tracked and ckpt.dataloader(tracked) is tracked
        with pytest.raises(DiffCkptError, match="another loader is already tracked"):
            ckpt.dataloader(fabric.setup_dataloaders(DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)))
        with pytest.raises(DiffCkptError, match="optimizer stepped before the first batch"):
            opt.step()
        for (x,) in tracked:
            fabric.backward(model(x).sum())
            opt.step()
            opt.zero_grad()
        with pytest.raises(DiffCkptError, match="restore\\(\\) must be called before training starts"):
            ckpt.restore("last")
    assert ckpt.durable_step == 2 and ckpt.step == 2 and ckpt.epoch == 1


def test_restore_of_another_set_of_schedulers_is_refused(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    model, opt, loader = _setup(fabric)
    with FabricCheckpointer(fabric, tmp_path / "run", model=model, optimizers=opt) as ckpt:
        for (x,) in ckpt.dataloader(loader):
            fabric.backward(model(x).sum())
            opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, 1)
    again = FabricCheckpointer(fabric, tmp_path / "run", model=model, optimizers=opt, schedulers=sched)
    with pytest.raises(DiffCkptError, match="has 0 schedulers, this run passed 1"):
        again.restore("last")
    again.close()


class _Metrics(Logger):
    """A Fabric logger that keeps what it is given."""

    def __init__(self) -> None:
        self.logged: list[tuple[dict, int | None]] = []

    name = "keep"
    version = 0

    def log_metrics(self, metrics, step=None) -> None:
        self.logged.append((dict(metrics), step))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def test_metrics_and_tuning_decisions_reach_fabric_loggers(tmp_path):
    logger = _Metrics()
    fabric = Fabric(accelerator="cpu", devices=1, loggers=[logger])
    model, opt, loader = _setup(fabric)
    tuning = TuningOptions(mtbf_s=30, max_overhead=0.5, retune_every_n_steps=5)
    with pytest.raises(ValueError, match="log_every_n_steps must be a positive number"):
        FabricCheckpointer(fabric, tmp_path / "run", model=model, optimizers=opt, log_every_n_steps=0)
    with FabricCheckpointer(fabric, tmp_path / "run", model=model, optimizers=opt, every_n_steps="auto",
                            write_batch="auto", base_every_n_steps="auto", log_every_n_steps=4,
                            options=CheckpointOptions(tuning=tuning)) as ckpt:
        for _ in range(15):
            for (x,) in ckpt.dataloader(loader):
                fabric.backward(model(x).sum())
                opt.step()
                opt.zero_grad()
    assert all(k.startswith("diffckpt/") for m, _ in logger.logged for k in m), logger.logged
    progress = [(step, m) for m, step in logger.logged if "diffckpt/queue_fill" in m]
    assert [step for step, _ in progress] == list(range(4, 30, 4))
    for step, m in progress:  # the durable step is there once the writer made a step durable
        if "diffckpt/durable_step" in m:
            assert m["diffckpt/durability_lag_steps"] == step - m["diffckpt/durable_step"]
    # The tuner's decisions share the call; how many reviews fit its time budget depends on the
    # step time, but none comes before its first review at step 10.
    watched = {k for _, m in progress for k in m}
    assert all(step >= 10 for m, step in logger.logged if any(k not in watched for k in m)), logger.logged


def test_closure_optimizers_are_refused_at_construction(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    model = torch.nn.Linear(4, 2)
    model, opt = fabric.setup(model, torch.optim.LBFGS(model.parameters()))
    with pytest.raises(UnsupportedConfigurationError, match="LBFGS"):
        FabricCheckpointer(fabric, tmp_path / "run", model=model, optimizers=opt)


def test_a_fresh_start_on_a_used_run_root_warns_how_to_resume(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    model, opt, loader = _setup(fabric)
    for warns in (False, True):
        with FabricCheckpointer(fabric, tmp_path / "run", model=model, optimizers=opt) as ckpt:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for (x,) in ckpt.dataloader(loader):
                    fabric.backward(model(x).sum())
                    opt.step()
        said = [str(w.message) for w in caught if "already holds a run" in str(w.message)]
        assert bool(said) == warns, said
    assert "newest durable step 2" in said[0] and "call ckpt.restore('last') before training" in said[0]
