"""``FabricCheckpointer``: differential checkpoints for a Lightning Fabric training loop.

Fabric users write their own loop, as Accelerate users do, so this is the counterpart of
``accelerate_ckpt.DiffCheckpointer`` rather than a ``CheckpointIO`` plugin: ``fabric.save`` hands
a plugin state dicts at the moments the user chooses, while a differential checkpoint must see
every optimizer step. Each step is captured by the core's hooks on the optimizer inside each
``_FabricOptimizer``, where the gradients are already all-reduced and clipped. A step's record is
committed at the next batch request of the tracked loader (:meth:`FabricCheckpointer.dataloader`)
or at :meth:`FabricCheckpointer.close`, when the scheduler and whatever else runs between batches
has run. It then holds the schedulers, the precision plugin's state, the step counter, and every
rank's RNG and data position. The engine (``diffckpt.engine``) decides who writes and does every
exchange between ranks; this adapter only translates Fabric's objects and events.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import lightning
from lightning.fabric import Fabric

from diffckpt.errors import DiffCkptError, IncompatibleCheckpointError
from diffckpt.integration import (
    NOT_GIVEN_BASE_EVERY_N_STEPS,
    NOT_GIVEN_EVERY_N_STEPS,
    NOT_GIVEN_WRITE_BATCH,
    Auto,
    ByBytes,
    CheckpointOptions,
    LoopCheckpointer,
    NotGiven,
    check_log_every,
    check_replayable,
    get_rng_state,
    merge_options,
)

from .fabric_loader import TrackedFabricLoader
from .fabric_support import check_supported, is_fabric_loader, setup_objects

__all__ = ["FabricCheckpointer"]

class FabricCheckpointer(LoopCheckpointer):
    """Differential checkpoints of a Fabric training loop.

    Create it after ``fabric.setup(...)`` on every process; it captures every optimizer step from
    then on. Iterate the training loader through :meth:`dataloader`: each batch request is a step
    boundary.

    Args:
        fabric: the launched ``Fabric`` (one device, or ``strategy="ddp"``).
        dirpath: run root: a local path or any fsspec URL (``s3://``...). With several processes
            every process reads it on restore, so it must be shared storage.
        model: the module ``fabric.setup`` returned.
        optimizers: the optimizer, or list of optimizers, ``fabric.setup`` returned.
        schedulers: LR schedulers (or other objects with ``state_dict``/``load_state_dict``)
            stepped in the loop; their state goes into every restorable step.
        every_n_steps, write_batch, base_every_n_steps: as for ``DiffCheckpoint`` (each may be
            ``"auto"``; tuner decisions go to ``fabric.log_dict`` as ``diffckpt/*``).
        log_every_n_steps: with ``Fabric(loggers=...)``, the checkpointing metrics (durable step,
            lag, bytes per step, writer stall, queue fill) go to ``fabric.log_dict`` every this
            many steps.
        options: every other setting (:class:`diffckpt.CheckpointOptions`).
        storage_options: fsspec options (credentials, endpoint).
        **legacy: :class:`diffckpt.CheckpointOptions` fields as keywords (deprecated).

    Use it as a context manager (or call :meth:`close`) so that the last steps are flushed, also
    on exceptions; on SIGTERM every rank records the current step at the next batch request,
    flushes and exits with status 143.

    Raises:
        UnsupportedConfigurationError: a strategy other than one device or DDP, ``DiffCheckpointIO``
            among Fabric's plugins, or objects that did not come from ``fabric.setup``.
    """

    def __init__(self, fabric: Fabric, dirpath: str | os.PathLike[str], *, model: Any, optimizers: Any,
                 schedulers: Any = (), every_n_steps: int | Auto | NotGiven = NOT_GIVEN_EVERY_N_STEPS,
                 write_batch: int | Auto | NotGiven = NOT_GIVEN_WRITE_BATCH,
                 base_every_n_steps: int | Auto | ByBytes | NotGiven | None = NOT_GIVEN_BASE_EVERY_N_STEPS,
                 options: CheckpointOptions | None = None, storage_options: dict[str, Any] | None = None,
                 log_every_n_steps: int = 50, **legacy: Any) -> None:
        check_supported(fabric)
        check_log_every(log_every_n_steps)
        self.fabric = fabric
        model, prepared, self.schedulers = setup_objects(model, optimizers, schedulers)
        self.module = model.module  # the user's module, as its state_dict names it (not DDP's)
        self.optimizers = [po.optimizer for po in prepared]
        for opt in self.optimizers:  # on every process, before anything is written
            check_replayable(opt)
        merged = merge_options(options, legacy, every_n_steps=every_n_steps, write_batch=write_batch,
                               base_every_n_steps=base_every_n_steps)
        self._loader: TrackedFabricLoader | None = None
        for po in prepared:
            self._wrap_optimizer(po)
        super().__init__(os.fspath(dirpath), merged, dict(storage_options or {}), log_every_n_steps)

    @property
    def epoch(self) -> int:
        """The epoch to continue in: after :meth:`restore`, the interrupted one (0 on a fresh run)."""
        if self._loader is not None:
            return self._loader.epoch
        return 0 if self._resume is None else int(self._resume["position"]["iteration"])

    def dataloader(self, dataloader: Any) -> TrackedFabricLoader:
        """Track the training loader ``fabric.setup_dataloaders`` returned: its position goes into
        every checkpoint and, after :meth:`restore`, its next epoch resumes where the restored step
        left off. Iterate the returned object instead of ``dataloader``."""
        if self._loader is not None and dataloader in (self._loader, self._loader.dataloader):
            return self._loader
        if self._loader is not None or not is_fabric_loader(dataloader):
            raise DiffCkptError(
                "track one training loader, the one fabric.setup_dataloaders(...) returned: its epoch "
                "counter and generators are what a resume restores" + (
                    " (another loader is already tracked)" if self._loader is not None else ""))
        self._loader = TrackedFabricLoader(self, dataloader)
        self._loader.resume = self._resume
        return self._loader

    # ------------------------------------------------------------------ capture
    def _wrap_optimizer(self, po: Any) -> None:
        step = po.step

        def checkpointed_step(*args: Any, **kwargs: Any) -> Any:
            if not self.driver.closed and not self.driver.started:
                raise DiffCkptError(
                    "the optimizer stepped before the first batch of a tracked loader: iterate "
                    "`for batch in ckpt.dataloader(train_loader)`, whose batch requests are where "
                    "FabricCheckpointer commits each step")
            result = step(*args, **kwargs)
            if not self.driver.closed:
                self.step += 1
            return result

        po.step = checkpointed_step

    def _start(self) -> None:
        self.driver.started = True
        self._resume = None
        self.engine.begin(self.module, self.optimizers, self.step, _StepState(self),
                          meta={"framework": f"lightning.fabric {lightning.__version__}",
                                "strategy": type(self.fabric.strategy).__name__,
                                "precision": type(self.fabric.strategy.precision).__name__},
                          resume_hint="call ckpt.restore('last') before training")

    def _state(self) -> _StepState:
        return _StepState(self)

    def _has_loggers(self) -> bool:
        return bool(self.fabric.loggers)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        self.fabric.log_dict(metrics, step=step)

    # ------------------------------------------------------------------ restore
    def restore(self, step: int | Literal["last"] | None = "last") -> int:
        """Rebuild model, optimizers, schedulers, precision state and the step counter at ``step``
        (``"last"``: the newest durable one) and arm each rank's RNG and data position for the
        loop; return the optimizer step to continue from (0 when there is nothing to restore).

        Call it on every process, after creating the checkpointer and before training.

        Raises:
            CheckpointNotFoundError: an explicit ``step`` is not durable.
            IncompatibleCheckpointError: the checkpoint was written for another model, optimizer
                or set of schedulers, or not by FabricCheckpointer.
        """
        if self.driver.started:
            raise DiffCkptError("restore() must be called before training starts (before the first "
                                "batch of the tracked loader)")
        result = self.engine.resume(self.module, self.optimizers, step, missing_ok=True)
        if result is None:
            return 0
        state = result.state
        ours = state.get("fabric") if isinstance(state, dict) else None
        if ours is None or len(ours["schedulers"]) != len(self.schedulers):
            raise IncompatibleCheckpointError(
                f"step {result.step} under {self.url} " + (
                    "was not written by FabricCheckpointer; restore it with the integration that wrote it"
                    if ours is None else
                    f"has {len(ours['schedulers'])} schedulers, this run passed {len(self.schedulers)}; "
                    "pass the same schedulers as the checkpointed run") +
                " (the model and optimizers were already replayed and must be restored again)")
        for sched, sd in zip(self.schedulers, ours["schedulers"]):
            sched.load_state_dict(sd)
        self.fabric.strategy.precision.load_state_dict(ours["precision"])
        # On another process count the data positions differ: rank 0's is used (the engine warns).
        self._resume = self.engine.own(state["ranks"]) or state["ranks"][0]
        if self._loader is not None:
            self._loader.resume = self._resume
        self.step = result.step
        return result.step


class _StepState:
    """The engine's view of a Fabric loop at a step (see ``diffckpt.engine.FrameworkState``)."""

    def __init__(self, owner: FabricCheckpointer) -> None:
        self.owner = owner

    def rank_state(self) -> dict[str, Any]:
        loader = self.owner._loader
        assert loader is not None  # steps start at a tracked loader's first batch request
        return {"rng": get_rng_state(), "position": loader.position()}

    def state(self, ranks: list[Any]) -> dict[str, Any]:
        owner = self.owner
        return {"fabric": {"step": owner.step, "schedulers": [s.state_dict() for s in owner.schedulers],
                           "precision": owner.fabric.strategy.precision.state_dict()},
                "ranks": ranks, "world_size": owner.fabric.world_size}
