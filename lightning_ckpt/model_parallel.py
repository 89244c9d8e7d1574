"""Which strategies ``DiffCheckpoint`` records, and its glue for ``ModelParallelStrategy`` (FSDP2).

``ModelParallelStrategy`` bypasses CheckpointIO: ``strategy.save_checkpoint`` writes a
``torch.distributed.checkpoint`` directory and ``strategy.load_checkpoint`` reads one, so
``DiffCheckpointIO`` never sees a save or a load (docs/notes/fsdp2.md section 7).
``DiffCheckpoint.setup`` therefore binds four methods on the strategy *instance*:

- ``load_checkpoint``: a path of ours (run root, ``run.json``, ``step=N``, a reference file) is
  replayed by diffckpt into the live module, already sharded by ``configure_model``, and into the
  optimizers the strategy built (each rank from its own stream). It returns Lightning's dict
  without model and optimizer states. Lightning restores the loops, schedulers, callbacks and
  precision plugin itself; on this strategy its model and optimizer loaders do nothing. Any other
  path goes to the strategy's own method (DCP).
- ``save_checkpoint`` (called on every rank): with ``DiffCheckpointIO`` as the plugin, a
  reference to the step, as under DDP; otherwise the strategy's own DCP save.
- ``lightning_module_state_dict`` and ``optimizer_state``: ``{}`` whenever no file will hold them
  (every save writes a reference, or the callback records a step's Lightning state), so that
  ``dump_checkpoint`` does not build sharded state dicts at every restorable step.

Why the instance, not a subclass: the user's strategy object stays theirs. Its class, its
arguments and every other method are unchanged, no strategy has to be swapped in the ``Trainer``,
and ``teardown`` removes the bindings again, so the object is exactly as it was after ``fit``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
)
from lightning.pytorch.trainer.states import TrainerFn

from diffckpt.errors import UnsupportedConfigurationError
from diffckpt.integration import is_sharded

from .references import resolve_target

# The callback's resume of (url, step) into the live module and optimizers: Lightning's part.
LoadLive = Callable[[str, "int | None", torch.nn.Module, list[torch.optim.Optimizer]], dict[str, Any]]

__all__ = ["check_sharded", "check_strategy", "install", "states_skipped", "uninstall"]

_BOUND = ("load_checkpoint", "save_checkpoint", "lightning_module_state_dict", "optimizer_state")
_ATTR = "_diffckpt_glue"
_INSTEAD = ("strategy=ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1) with "
            "fully_shard(module, mesh=self.device_mesh['data_parallel']) in configure_model")


def check_strategy(strategy: Strategy, codec: bool) -> bool:
    """Refuse a strategy (or a strategy with ``codec=``) that diffckpt cannot record; ``True``
    for ``ModelParallelStrategy``, which needs :func:`install`."""
    name = type(strategy).__name__
    if isinstance(strategy, ModelParallelStrategy):
        if codec:
            raise UnsupportedConfigurationError(
                "DiffCheckpoint(codec=...) is not supported with ModelParallelStrategy: FSDP2 reduce-scatters the "
                "gradients itself and has no communication hook for a codec, and a codec applied to one rank's "
                "shard cannot see the whole gradient. Drop codec= (each rank then records its exact gradient "
                "pieces), or use compressed training with strategy='ddp'")
        return True
    if isinstance(strategy, FSDPStrategy):
        raise UnsupportedConfigurationError(
            f"DiffCheckpoint does not support {name} (FSDP1): its flat parameters are not DTensors, and "
            "diffckpt records and replays each rank's FSDP2 pieces (DTensors sharded along dim 0). Use "
            f"{_INSTEAD}, or Lightning's own checkpointing (ModelCheckpoint, no DiffCheckpoint) for this run")
    if isinstance(strategy, DeepSpeedStrategy):
        raise UnsupportedConfigurationError(
            f"DiffCheckpoint does not support {name}: ZeRO partitions parameters and optimizer states in "
            "DeepSpeed's own flat buffers, not DTensors, and diffckpt records and replays FSDP2 pieces. Use "
            f"{_INSTEAD}, or DeepSpeed's checkpointing through Lightning (ModelCheckpoint) for this run")
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
        raise UnsupportedConfigurationError(
            f"DiffCheckpoint does not support {name}. Use a single device, strategy='ddp' or {_INSTEAD}, or "
            "Lightning's ModelCheckpoint for this run")
    return False


def install(trainer: pl.Trainer, load_live: LoadLive, storage_options: dict[str, Any]) -> None:
    """Bind the overrides on ``trainer.strategy`` (a ``ModelParallelStrategy``); a second
    ``setup`` (another ``fit``) keeps the bindings and points them to the new callback.

    ``load_live(url, step, module, optimizers)`` is the callback's resume of a step into the live
    module and optimizers, returning Lightning's part of the checkpoint; ``storage_options``
    its fsspec options (to read references)."""
    strategy = trainer.strategy
    glue = strategy.__dict__.get(_ATTR)
    if glue is not None:
        glue.trainer, glue.load_live, glue.storage_options = trainer, load_live, storage_options
        return
    glue = _Glue(strategy, trainer, load_live, storage_options)
    for name in _BOUND:
        setattr(strategy, name, getattr(glue, name))
    setattr(strategy, _ATTR, glue)


def uninstall(strategy: Strategy) -> None:
    """Remove what :func:`install` bound; the strategy's own methods show through again."""
    glue = strategy.__dict__.pop(_ATTR, None)
    if glue is None:
        return
    for name in _BOUND:
        strategy.__dict__.pop(name, None)
        if name in glue.instance:  # the user had bound one of their own: it comes back
            strategy.__dict__[name] = glue.instance[name]


def check_sharded(trainer: pl.Trainer, module: torch.nn.Module) -> None:
    """Under the glue with several processes, the parameters must be sharded by now: unsharded,
    each process would train on its own and no single record would hold what they did."""
    if _ATTR in trainer.strategy.__dict__ and trainer.world_size > 1 and not is_sharded(module):
        raise UnsupportedConfigurationError(
            "under ModelParallelStrategy, DiffCheckpoint records FSDP2 parameters, but configure_model left "
            "them unsharded (plain tensors): apply fully_shard(module, mesh=self.device_mesh['data_parallel']) "
            "to the layers and to the root module in configure_model")


@contextmanager
def states_skipped(strategy: Strategy) -> Iterator[None]:
    """Within: the bound state-dict methods return ``{}`` (the callback records Lightning's part
    of a step, which replay completes with the model and optimizer states)."""
    glue = strategy.__dict__.get(_ATTR)
    if glue is None:
        yield
        return
    before, glue.dumping = glue.dumping, True
    try:
        yield
    finally:
        glue.dumping = before


class _Glue:
    """The methods bound on one strategy object, and the strategy's own ones they fall back to."""

    def __init__(self, strategy: Strategy, trainer: pl.Trainer, load_live: LoadLive,
                 storage_options: dict[str, Any]) -> None:
        self.strategy, self.trainer, self.load_live, self.storage_options = strategy, trainer, load_live, storage_options
        self.instance = {n: strategy.__dict__[n] for n in _BOUND if n in strategy.__dict__}
        self.original = {n: getattr(strategy, n) for n in _BOUND}  # bound before we bind ours
        self.dumping = False

    def _ours(self) -> bool:
        from .checkpoint_io import DiffCheckpointIO

        return isinstance(self.strategy.checkpoint_io, DiffCheckpointIO)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # Rank 0 decides whether the path is ours, as the strategy broadcasts rank 0's path: the
        # ranks must all take the same branch, both of which run collectives.
        target = resolve_target(os.fspath(checkpoint_path), self.storage_options) \
            if self.strategy.is_global_zero else None
        target = self.strategy.broadcast(target)
        if target is None:
            return self.original["load_checkpoint"](checkpoint_path, weights_only=weights_only)
        url, step = target
        trainer = self.trainer
        module = trainer.lightning_module
        optimizers = list(self.strategy.optimizers)
        if trainer.state.fn != TrainerFn.FITTING and not optimizers:
            # Validating or testing: the strategy built no optimizers; replay needs some.
            optimizers = _init_optimizers_and_lr_schedulers(module)[0]
        # Into the live module (sharded, converted, on its device) and the strategy's own
        # optimizers: nothing is rebuilt, so nothing Lightning holds goes stale.
        return self.load_live(url, step, module, optimizers)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self._ours():  # every rank calls; the engine lets rank 0 write the reference
            self.strategy.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options)
        else:
            self.original["save_checkpoint"](checkpoint, filepath, storage_options=storage_options)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {} if self.dumping or self._ours() else self.original["lightning_module_state_dict"]()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {} if self.dumping or self._ours() else self.original["optimizer_state"](optimizer)
