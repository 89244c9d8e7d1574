"""The framework-free engine that adapters drive: capture, bases, flush, restore.

Call order in training: :meth:`CheckpointEngine.start` once the optimizers exist, then after each
training step :meth:`~CheckpointEngine.record_step` (and :meth:`~CheckpointEngine.write_base` when
:meth:`~CheckpointEngine.wants_base` says so), finally :meth:`~CheckpointEngine.close`. To resume,
:meth:`~CheckpointEngine.restore` replays onto the caller's model and optimizers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
from typing import Any

import torch

from .capture import StepCapture, clone_tree, group_hyperparams, tree_nbytes
from .compression import GradientCompressor
from .errors import DiffCkptError
from .options import CheckpointOptions
from .policies import IntervalPolicy, StepContext
from .replay import ReplayResult, replay
from .retry import unwrap
from .storage import Storage, open_storage
from .store import RunStore
from .writer import BackgroundWriter

__all__ = ["CheckpointEngine"]

log = logging.getLogger("diffckpt")


class CheckpointEngine:
    """Differential checkpointing of one model and its optimizers into one run root.

    Args:
        dirpath: local path, fsspec URL (``memory://``, ``s3://``, ...) or a :class:`Storage`.
        options: capture, batching and base settings.
        storage_options: passed to fsspec (credentials, endpoint, ...).
    """

    def __init__(self, dirpath: str | os.PathLike[str] | Storage, options: CheckpointOptions | None = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.options = options or CheckpointOptions()
        self.storage = open_storage(dirpath, retry=self.options.retry, **(storage_options or {}))
        self.store = RunStore(self.storage)
        self.policy = IntervalPolicy()
        self.writer: BackgroundWriter | None = None
        self.capture: StepCapture | None = None
        self.module: torch.nn.Module | None = None
        self._prev_step = 0
        self._last_base = 0
        self._buffer_names: list[str] = []
        self._durable: int | None = None

    @property
    def storage_is_local(self) -> bool:
        """Whether the run root is on a local file system."""
        return bool(getattr(unwrap(self.storage), "local", False))

    # ------------------------------------------------------------------ training
    @property
    def started(self) -> bool:
        return self.writer is not None

    def start(self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer], step: int,
              meta: dict[str, Any] | None = None, compressor: GradientCompressor | None = None) -> int:
        """Open a writer session continuing from ``step``; return its generation number.

        The caller writes the starting base right after (``write_base(step, ...)``). With a
        ``compressor`` (compressed training), steps are recorded as its payloads.
        """
        if self.writer is not None:
            raise DiffCkptError("CheckpointEngine.start() called twice; close() the running session first")
        self.capture = StepCapture(optimizers, compressor)
        params = dict(module.named_parameters())
        self._buffer_names = [k for k in module.state_dict() if k not in params]
        names = {id(p): n for n, p in params.items()}
        body = {"options": dataclasses.asdict(self.options), "host": socket.gethostname(), "pid": os.getpid(),
                "optimizer_params": [[[names.get(id(p), "") for p in g["params"]] for g in o.param_groups]
                                     for o in optimizers],
                "resumed_from": step,
                "optimizers": [f"{type(o).__module__}.{type(o).__qualname__}" for o in optimizers],
                "parameters": [[k, list(p.shape)] for k, p in params.items()],
                "codec": None if compressor is None else compressor.codec.config(), **(meta or {})}
        gen = self.store.start_session(body)
        self.module = module
        self.writer = BackgroundWriter(self.store, gen, self.options, after=step)
        self._prev_step = self._last_base = step
        return gen

    def _context(self, step: int) -> StepContext:
        o = self.options
        return StepContext(step, self._last_base, o.every_n_steps, o.base_every_n_steps,
                           o.fingerprint_every_n_steps)

    def wants_state(self, step: int) -> bool:
        """Whether ``step`` is a restorable point, so the caller should pass its state."""
        return self.policy.wants_state(self._context(step))

    def wants_base(self, step: int) -> bool:
        return self.policy.wants_base(self._context(step))

    def follow(self, step: int, base: bool) -> None:
        """Keep the step/base clock of a process that does not write (DDP ranks other than 0), so
        that its decisions match the writer's."""
        self._prev_step = step
        if base:
            self._last_base = step

    def record_step(self, step: int, state: Any | None) -> None:
        """Record what the optimizer steps since the previous call consumed.

        Args:
            step: the step counter after these optimizer steps (strictly increasing).
            state: framework state at this step (loops, schedulers, RNG...), or ``None`` if this
                step is not a restorable point. Copied here; tensors are cloned.
        """
        writer, capture, module = self._require()
        if step <= self._prev_step:
            raise DiffCkptError(f"step {step} recorded after step {self._prev_step}; steps must increase")
        events = capture.take()
        buffers = dict(module.named_buffers())
        record: dict[str, Any] = {
            "step": step,
            "prev": self._prev_step,
            "events": events,
            "param_groups": [group_hyperparams(o) for o in capture.optimizers],
            "buffers": {k: buffers[k].detach().clone() for k in self._buffer_names if k in buffers},
            "state": None if state is None else clone_tree(state),
        }
        if state is not None and self.policy.wants_fingerprint(self._context(step)):
            record["fingerprint_params"] = [p.detach().clone() for p in module.parameters()]
        nbytes = tree_nbytes(record)
        writer.put_record(record, nbytes)
        self._prev_step = step

    def write_base(self, step: int, model_state: dict[str, Any], optimizer_states: list[dict[str, Any]],
                   state: Any, codec_states: list[dict[str, torch.Tensor]] | None = None) -> None:
        """Queue a full snapshot at ``step`` (the step's record must already be recorded).

        ``codec_states`` is every rank's codec state (:meth:`GradientCompressor.state_dict`), in
        rank order, for a codec that keeps state.
        """
        writer, _, module = self._require()
        tree = clone_tree({"model": model_state, "optimizers": optimizer_states, "state": state})
        if codec_states and any(codec_states):
            tree["codec"] = clone_tree(list(codec_states))
        names = [n for n, _ in module.named_parameters()]
        missing = [n for n in names if n not in tree["model"]]
        if missing:
            raise DiffCkptError(f"model state for the base lacks parameters {missing[:3]}")
        writer.put_base(step, tree, [tree["model"][n] for n in names], tree_nbytes(tree))
        self._last_base = step

    def flush(self, timeout: float | None = None) -> int | None:
        """Block until everything captured is durable; return the durable step.

        Raises:
            TimeoutError: not durable within ``timeout`` seconds (writing goes on).
            StorageUnavailableError: storage is in an outage and ``on_storage_error="raise"``.
        """
        return self.writer.flush(timeout) if self.writer else None

    def check(self) -> None:
        """Raise a background error on the calling thread, if one happened."""
        if self.writer:
            self.writer.check()

    @property
    def durable_step(self) -> int | None:
        """Newest step the current (or last) session made durable; still valid after
        :meth:`close` and after a background write failed, when ``close()`` raised instead."""
        return self.writer.durable_step if self.writer else self._durable

    def close(self, timeout: float | None = None) -> int | None:
        """Flush, stop the writer and remove the capture hooks; return the durable step.

        A background error is raised here if it was not raised before, or again if it was; the
        session is closed either way and :attr:`durable_step` tells how far it got.

        Args:
            timeout: give up flushing after this many seconds, logging which steps are durable
                and which are lost (for preemption: see ``CheckpointOptions.flush_timeout_s``).
                ``None`` waits as ``on_storage_error`` says.
        """
        durable = None
        try:
            if self.writer:
                durable = self.writer.close(timeout)
        finally:
            if self.capture:
                self.capture.remove()
            if self.writer:
                self._durable = self.writer.durable_step
            self.writer = self.capture = None
        return durable

    def _require(self) -> tuple[BackgroundWriter, StepCapture, torch.nn.Module]:
        if self.writer is None or self.capture is None or self.module is None:
            raise DiffCkptError("CheckpointEngine.start() must be called before recording steps")
        return self.writer, self.capture, self.module

    # ------------------------------------------------------------------- restore
    def restore(self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                step: int | None = None, verify: bool = True, compressor: GradientCompressor | None = None,
                rank: int = 0) -> ReplayResult:
        """Load ``step`` (``None``: newest durable) into ``module`` and ``optimizers`` by replay.

        With a ``compressor``, its codec state is restored too: rank ``rank``'s state saved with
        the base when ``step`` is a base step (exact end to end), else the state the replayed
        payloads carry (error-feedback residuals restart from zero).

        For ``None``, damage (a missing or corrupt segment, an unusable base) makes it restore the
        newest step that can still be rebuilt, with a warning; for an explicit step it raises.
        Older bases of the same session stand in for a damaged one (see
        :meth:`RunStore.open_plan`).

        Raises:
            CheckpointNotFoundError: nothing durable under the run root, or ``step`` is not durable.
            CorruptRecordError: an explicit step cannot be rebuilt, or no base can be loaded.
            IncompatibleCheckpointError: the checkpoint was written for another model or optimizer;
                ``module`` and ``optimizers`` are then left untouched.
            ReplayMismatchError: replay diverged from the fingerprints recorded in training;
                ``module`` and ``optimizers`` are then partly replayed and must not be used.
        """
        plan, info, base = self.store.open_plan(step)
        ctx = self.capture.paused() if self.capture else contextlib.nullcontext()
        with ctx, compressor.paused() if compressor else contextlib.nullcontext():
            result = replay(self.store, plan, module, optimizers, verify=verify, loaded=(info, base))
        if compressor is not None:
            if result.codec_config != compressor.codec.config():  # another codec, or none, trained
                compressor.restore(None, {})
            else:
                states = result.codec_states if result.step == result.base_step else None
                compressor.restore(states[rank] if states and rank < len(states) else None,
                                   result.codec_payloads)
        return result

