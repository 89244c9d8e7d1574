"""What an adapter hands the engine and gets back for each step, and the framework saves that
wait for a step's data (:class:`FrameworkSaves`), apart from :mod:`diffckpt.engine` so that the
engine reads as the order of its calls."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .deprecation import warn_renamed
from .errors import DiffCkptError
from .recorder import Recorder
from .tuning.model import AUTO

__all__ = ["Clock", "Committed", "FrameworkSaves", "FrameworkState", "after_queued", "saved_as"]

log = logging.getLogger("diffckpt")


class FrameworkState(Protocol):
    """What a framework adds to a restorable step, built only when the engine asks for it."""

    def rank_state(self) -> Any:
        """This process's own part: its RNG states and data position (called on every rank)."""

    def state(self, ranks: list[Any]) -> Any:
        """The step's framework state (loops, schedulers, scaler...), holding ``ranks``, every
        rank's :meth:`rank_state` in rank order (called on the process that writes)."""


@dataclass(frozen=True)
class Committed:
    """What :meth:`CheckpointEngine.commit` did with a step."""

    step: int
    restorable: bool  # recorded with its state: a step training can resume from
    base: bool  # a full base was written at it
    tuning: dict[str, float] = field(default_factory=dict)  # a tuner decision's metrics, to log


@dataclass
class Clock:
    """The steps a coordinated session has reached, the same on every rank."""

    recorded: int = -1
    restorable: int = -1
    base: int = -1

    def at(self, step: int, restorable: bool, base: bool) -> None:
        self.recorded = step
        if restorable:
            self.restorable = step
        if base:
            self.base = step


def saved_as(name: str) -> str:
    """Why a step is kept for the framework's save ``name`` (its kept marker's ``why``)."""
    return f"saved as {name}"


def after_queued(engine: Any, fn: Callable[[], Any]) -> None:
    """``CheckpointEngine.after_queued(fn)``, deprecated: a removal of a framework's save is
    :meth:`~diffckpt.CheckpointEngine.when_removed` now, which also ends the keep of its step."""
    warn_renamed("CheckpointEngine.after_queued(fn)", "CheckpointEngine.when_removed(fn, name=...)")
    if engine.is_main_process:
        engine.recorder.after_written(fn)


class FrameworkSaves:
    """A framework's saves of steps (a reference file, an ``output_dir`` marker...) run on the
    main process after the step's own data, in order, and only for steps training can resume
    from (:meth:`diffckpt.CheckpointEngine.when_restorable`)."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.waiting: list[tuple[int, Callable[[], Any], str]] = []  # until their step is committed

    def add(self, step: int, fn: Callable[[], Any], name: str, *, wait: bool, recorded: int,
            restorable: int) -> None:
        """``fn`` for a save of ``step``; ``recorded``/``restorable``: the session's newest
        committed and restorable steps."""
        if wait or step > recorded:
            self.waiting.append((step, fn, name))
            return
        if step > restorable:
            raise DiffCkptError(
                f"cannot save {name}: step {step} is not a restorable step with every_n_steps="
                f"{self.every_n()}; save checkpoints only at multiples of every_n_steps")
        self._after_durable_data(step, fn, name)

    def committed(self, step: int, restorable: bool) -> None:
        """Step ``step`` was committed: run what waited for it (and for earlier steps)."""
        waiting, self.waiting = self.waiting, []
        for saved, fn, name in waiting:
            if saved == step and not restorable:
                raise DiffCkptError(
                    f"a checkpoint was saved at step {step} ({name}), which is not a restorable step "
                    f"with every_n_steps={self.every_n()}; save checkpoints only at multiples of "
                    "every_n_steps")
            self._after_durable_data(saved, fn, name)

    def ended(self, started: bool, durable: int | None) -> None:
        """The session ended: what still waits runs if its step became durable."""
        waiting, self.waiting = self.waiting, []
        for saved, fn, name in waiting:
            if started and durable is not None and saved <= durable:
                self._after_durable_data(saved, fn, name)
            else:
                log.warning("diffckpt: %s was not written: step %d %s", name, saved,
                            "never became durable" if started else "was never recorded (save while training)")

    def _after_durable_data(self, step: int, fn: Callable[[], Any], name: str) -> None:
        rec = self.recorder
        if not rec.started:
            durable = rec.durable_step
            if durable is None or step > durable:
                raise DiffCkptError(f"cannot save {name}: step {step} is not durable in {rec.storage.url} "
                                    f"(durable up to {durable}); save while checkpointing runs")
        rec.keep(step, saved_as(name))  # retention must not delete what the save names (its marker first)
        rec.after_written(fn)

    def removed(self, fn: Callable[[], Any], name: str) -> None:
        """``fn()`` removes the save ``name`` once everything queued before is written; then its
        step is no longer kept for it (the marker goes after the save: never a save without its step)."""
        self.recorder.after_written(fn)
        self.recorder.release(saved_as(name))

    def every_n(self) -> str:
        """``every_n_steps`` as an error message names it."""
        n = self.recorder.settings.every_n_steps
        if self.recorder.options.every_n_steps == AUTO:
            return (f"'auto' (now {n}; with checkpoints saved at fixed steps, give every_n_steps a "
                    "divisor of their interval instead of 'auto')")
        return str(n)
