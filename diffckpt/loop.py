"""``LoopCheckpointer``: what a checkpointer for a hand-written training loop does whatever the
framework (Accelerate's ``DiffCheckpointer``, Fabric's ``FabricCheckpointer``).

Users of those frameworks write their own loop, so the adapter decides where a step ends (a
boundary: the next batch request, the last scheduler's or optimizer's step) and calls
:meth:`LoopCheckpointer._boundary` there. From that point on a :class:`~diffckpt.driver.StepDriver`
does what every framework shares (SIGTERM agreed by every rank, the session started at the first
boundary, each later step committed, the flush at :meth:`close`); here the engine's metrics are
handed to the loop's logger, and :meth:`close` also runs as a context manager, also on
exceptions. A subclass says how its framework starts a session, what a step's state is and where
metrics go.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import TracebackType
from typing import Any, TypeVar

from .dataorder import epoch_start_state
from .driver import StepDriver, check_log_every, step_metrics
from .engine import CheckpointEngine
from .options import CheckpointOptions
from .rng import set_rng_state
from .session import FrameworkState

__all__ = ["END", "LoopCheckpointer", "TrackedLoader"]

log = logging.getLogger("diffckpt")

_Self = TypeVar("_Self", bound="LoopCheckpointer")


class LoopCheckpointer:
    """The life cycle shared by the checkpointers of hand-written loops (see the module doc).

    A subclass calls ``super().__init__`` last in its own ``__init__`` (it installs the SIGTERM
    handler, which nothing after it should leave behind on an error) and implements
    :meth:`_start`, :meth:`_state`, :meth:`_has_loggers` and :meth:`_log` (and
    :meth:`_on_close` if it hooked into its framework).
    """

    def __init__(self, url: str, options: CheckpointOptions, storage_options: dict[str, Any],
                 log_every_n_steps: int) -> None:
        self.url = url
        self.options = options
        self.storage_options = storage_options
        self.log_every_n_steps = check_log_every(log_every_n_steps)
        self.engine = CheckpointEngine(url, options, storage_options)
        self.step = 0  # optimizer steps taken
        self._resume: dict[str, Any] | None = None  # this rank's RNG and data position to continue from
        self.driver = StepDriver(self.engine, options, on_close=self._on_close)
        self.driver.arm()  # SIGTERM acted on at the next boundary: see _boundary

    # ------------------------------------------------------------- for subclasses
    def _start(self) -> None:
        """Start checkpointing at the current step: ``engine.begin`` with the framework's meta
        (every rank calls this); set ``self.driver.started`` (it is called outside
        :meth:`_boundary` too) and clear ``_resume``."""
        raise NotImplementedError

    def _state(self) -> FrameworkState:
        """The engine's view of the loop at the current step."""
        raise NotImplementedError

    def _has_loggers(self) -> bool:
        """Whether the loop has loggers (metrics are gathered only then)."""
        raise NotImplementedError

    def _log(self, metrics: dict[str, float], step: int) -> None:
        """Hand ``metrics`` to the loop's loggers."""
        raise NotImplementedError

    def _on_close(self) -> None:
        """Undo what the subclass hooked into its framework (after the last step is recorded)."""

    # ------------------------------------------------------------------ boundary
    @property
    def received_sigterm(self) -> bool:
        """Whether this process got SIGTERM (it stops at the next boundary, with every rank)."""
        return self.driver.received_sigterm

    @property
    def durable_step(self) -> int | None:
        """The durable step :meth:`close` reported (``None`` before)."""
        return self.driver.durable_step

    def _begin(self) -> bool:
        self._start()
        return True

    def _boundary(self) -> None:
        """Everything the last step changed is in place: commit it, and stop if told to (every
        rank calls this)."""
        if self.driver.closed:
            return
        done = self.driver.boundary(self.step, self._begin, self._state)
        if done is not None and self._has_loggers():
            metrics = step_metrics(self.engine, done, self.step, self.log_every_n_steps)
            if metrics:
                self._log(metrics, self.step)
        self.engine.check()

    # ---------------------------------------------------------------- shutdown
    def close(self, reason: str = "end of training", timeout: float | None = None,
              record: bool = True) -> int | None:
        """Record the current step as a restorable one, flush and stop writing; return the
        durable step. Every process must call it (recording gathers their state).

        Args:
            reason: said in the log line that reports how far durability got.
            timeout: give up the flush after this many seconds (``None``: wait as
                ``on_storage_error`` says); the log then says which steps were lost.
            record: ``False`` flushes only what is already recorded (after an exception: the
                step in progress may be half done, and other processes may not get here).
        """
        return self.driver.close(self.step, self._state, reason, timeout, record)

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close(reason=f"interrupted by {type(exc).__name__}", timeout=self.options.flush_timeout_s,
                       record=False)
        except Exception:  # the original exception is what the user must see
            log.exception("diffckpt: flushing after %s failed too", type(exc).__name__)


END = object()  # what ``next(iterator, END)`` returns at the end of an epoch


class TrackedLoader:
    """A training loader of a hand-written loop whose position is part of every checkpoint, and
    whose first epoch after a restore continues the interrupted one.

    Requesting a batch is a step boundary (``owner._boundary()``): the step the previous batch
    trained is committed then, once the scheduler and anything else between the batches has run.
    A subclass reads its framework's epoch counter (:meth:`_counter`), names the
    ``torch.utils.data.DataLoader`` that draws the order (:meth:`_order_source`) and opens an
    epoch (:meth:`_first`), which is where frameworks differ: how consumed batches are skipped.

    An epoch interrupted on one number of ranks and resumed on another continues with the rest of
    its order dealt over the new ranks (:mod:`diffckpt.dealing`), where the subclass can deal it
    (:meth:`_dealing`, :meth:`_deal`); elsewhere a warning says that the epoch's samples are not
    seen exactly once.
    """

    def __init__(self, owner: LoopCheckpointer, dataloader: Any) -> None:
        self.owner = owner
        self.dataloader = dataloader
        self.resume: dict[str, Any] | None = None  # {"position", "rng"} to continue from
        self._active = False
        self._iteration = 0
        self._consumed = 0
        self._epoch: dict[str, Any] | None = None
        self._dealt: dict[str, Any] | None = None  # how the current epoch is dealt (dealing.py)
        self._undo: Any = None  # puts the loader's own sampler back after a dealt epoch

    def __len__(self) -> int:
        return len(self.dataloader)

    # ------------------------------------------------------------- for subclasses
    def _counter(self) -> int:
        """The framework's count of the epochs this loader started."""
        raise NotImplementedError

    def _order_source(self) -> Any:
        """What draws the epoch's order (:func:`diffckpt.dataorder.epoch_start_state` reads it)."""
        raise NotImplementedError

    def _position_extra(self) -> dict[str, Any]:
        """More of the position the subclass needs on resume (which loader this is)."""
        return {}

    def _rewind(self, resume: dict[str, Any]) -> int:
        """Set the epoch counter and the generators back to the start of the interrupted epoch
        (and the RNG, where the framework draws the order from it); return the batches it had
        consumed."""
        raise NotImplementedError

    def _first(self, resume: dict[str, Any] | None, skip: int) -> tuple[Iterator[Any], Any]:
        """Open the epoch: an iterator and the first batch to train (:data:`END` if none), the
        ``skip`` consumed batches passed over, and the RNG where ``resume`` left it. Frameworks
        differ in how they pass batches over, and so in when the order is drawn."""
        raise NotImplementedError

    def _closed_epoch(self, skipped: int) -> None:
        """An epoch ended (``skipped`` batches were skipped at its start)."""

    def _dealing(self, epoch: int) -> dict[str, Any] | None:
        """How this loader deals ``epoch`` now: ``{"world", "samples", "order"}`` (ranks dealt
        over, global samples per batch, a recipe of :func:`diffckpt.dealing.distributed_dealing`
        or another the subclass's :meth:`_deal` reads, or ``None``), or ``None`` if the loader
        does not say."""
        return None

    def _deal(self, recorded: dict[str, Any], skip: int) -> bool:
        """Make the epoch about to start yield only this rank's share of the recorded order's
        rest after ``skip`` samples (set ``self._undo`` to put the loader back), or return
        ``False`` if that order cannot be drawn here."""
        return False

    # ------------------------------------------------------------------ shared
    @property
    def epoch(self) -> int:
        """The epoch this loader is in, or starts next."""
        if self.resume is not None:
            return int(self.resume["position"]["iteration"])
        return self._iteration if self._active else self._counter()

    def position(self) -> dict[str, Any]:
        """Where the next batch comes from: inside an epoch, or at the start of the next one."""
        if self._active:
            return {**self._position_extra(), "iteration": self._iteration, "consumed": self._consumed,
                    "epoch_start": self._epoch, "dealing": self._dealt}
        counter = self._counter()
        return {**self._position_extra(), "iteration": counter, "consumed": 0,
                "epoch_start": epoch_start_state(self._order_source()), "dealing": self._dealing_from(counter, 0)}

    def _dealing_from(self, epoch: int, skip: int) -> dict[str, Any] | None:
        live = self._dealing(epoch)
        return None if live is None else {**live, "skip": skip}

    def _dealt_skip(self, resume: dict[str, Any], consumed: int) -> int | None:
        """The samples of the interrupted epoch's order consumed before this resume, where its
        rest must be dealt anew (another number of ranks, or an epoch dealt so already); else
        ``None``: the consumed batches are skipped as they are."""
        recorded, live = resume["position"].get("dealing"), self._dealing(self._counter())
        world = None if live is None else live["world"]
        if recorded is None or (recorded["world"] == world and not recorded["skip"]):
            return None
        skip = int(recorded["skip"]) + consumed * int(recorded["samples"])
        if not skip:  # nothing of the epoch consumed: the loader deals all of it over the new ranks
            return None
        if self._deal(recorded, skip):
            return skip
        log.warning("diffckpt: the interrupted epoch was dealt over %d ranks and resumes over %s; this "
                    "loader cannot draw that epoch's order again here (see docs/sharded.md, 'Data order "
                    "on another number of processes'), so each rank skips %d batches of its own new order "
                    "and some samples of this epoch may be seen twice or not at all",
                    recorded["world"], "an unknown number" if world is None else world, consumed)
        return None

    def __iter__(self) -> Iterator[Any]:
        self._active = False  # an abandoned epoch (break) is over once another one starts
        self._put_back()
        self.owner._boundary()
        resume, self.resume = self.resume, None
        skip = 0 if resume is None else self._rewind(resume)
        dealt = None if resume is None else self._dealt_skip(resume, skip)
        counter = self._counter()
        self._dealt = self._dealing_from(counter, dealt or 0)
        if dealt is not None:
            skip = 0
            if self._dealt is not None:  # this epoch's order is the recorded one, whatever the loader's now
                self._dealt["order"] = resume["position"]["dealing"]["order"]  # type: ignore[index]
        # The epoch's start as its order will be drawn from: recorded before anything draws.
        self._iteration, self._consumed, self._epoch = counter, skip, epoch_start_state(self._order_source())
        self._active = True
        undo = self._undo  # this epoch's; a later epoch may have installed its own by the time this one is closed
        try:
            it, batch = self._first(resume, skip)
            if dealt is not None:  # the order is drawn: the RNG continues from the record
                set_rng_state(resume["rng"])  # type: ignore[index]
            while batch is not END:
                self._consumed += 1
                yield batch
                self.owner._boundary()
                batch = next(it, END)
            self._closed_epoch(skip)
        finally:  # also when the loop stops early (an exception, a break): the loader's own sampler back
            if undo is not None and self._undo is undo:
                self._put_back()
        self._active = False

    def _put_back(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None
