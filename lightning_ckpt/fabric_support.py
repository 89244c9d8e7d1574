"""What ``FabricCheckpointer`` supports, checked before anything is written.

Fabric runs the user's own loop, so the checkpointer needs the objects ``fabric.setup`` returned
and a strategy whose processes each hold the whole model and optimizer: one device, or DDP.
Every refusal names the problem and what to do instead.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.fabric.wrappers import _FabricDataLoader, _FabricModule, _FabricOptimizer

from diffckpt.errors import UnsupportedConfigurationError

from .checkpoint_io import DiffCheckpointIO

__all__ = ["check_supported", "setup_objects"]

# Exact types: subclasses (DeepSpeedStrategy and XLAStrategy derive from DDPStrategy) shard state
# or run on other devices, which replay from one rank's record cannot rebuild.
_SUPPORTED = (SingleDeviceStrategy, DDPStrategy)


def check_supported(fabric: Fabric) -> None:
    """Raise :class:`UnsupportedConfigurationError` for a Fabric setup diffckpt cannot checkpoint exactly."""
    strategy = fabric.strategy
    if type(strategy) not in _SUPPORTED:
        raise UnsupportedConfigurationError(
            f"FabricCheckpointer does not support {type(strategy).__name__} yet: it records one process's "
            "gradients and replays them on every rank, which needs every rank to hold the whole model and "
            "optimizer. Use Fabric(strategy='ddp') or a single device, or fabric.save() with Fabric's own "
            "checkpoint IO for this run (FSDP2 training is supported in a plain PyTorch loop through "
            "diffckpt.CheckpointEngine, see docs/sharded.md)")
    if isinstance(strategy.checkpoint_io, DiffCheckpointIO):
        raise UnsupportedConfigurationError(
            "Fabric(plugins=[DiffCheckpointIO()]) is not supported: DiffCheckpointIO is the Trainer's plugin "
            "and pairs with the DiffCheckpoint callback, which Fabric does not run. Remove it from "
            "Fabric(plugins=...): FabricCheckpointer writes the checkpoints and ckpt.restore('last') resumes "
            "(see docs/fabric.md)")


def setup_objects(model: Any, optimizers: Any, schedulers: Any) -> tuple[Any, list[Any], list[Any]]:
    """The module, optimizers and schedulers as lists, checked to come from ``fabric.setup``."""
    if not isinstance(model, _FabricModule):
        raise UnsupportedConfigurationError(
            f"model= must be the module fabric.setup(model, optimizer) returned, got {type(model).__name__}; "
            "create the FabricCheckpointer after fabric.setup(...)")
    optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    if not optimizers or not all(isinstance(o, _FabricOptimizer) for o in optimizers):
        raise UnsupportedConfigurationError(
            "optimizers= must be the optimizer(s) fabric.setup(model, optimizer) returned; create the "
            "FabricCheckpointer after fabric.setup(...)")
    schedulers = list(schedulers) if isinstance(schedulers, (list, tuple)) else [schedulers]
    return model, optimizers, [s for s in schedulers if s is not None]


def is_fabric_loader(dataloader: Any) -> bool:
    return isinstance(dataloader, _FabricDataLoader)
