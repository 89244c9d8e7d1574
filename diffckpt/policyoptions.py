"""The policy settings :class:`~diffckpt.CheckpointOptions` holds: retries of storage operations,
what retention keeps, and what the auto-tuner is told. Plain frozen dataclasses that import
nothing from the read or write side, so that importing the options costs nothing; the code that
acts on them is in ``storage/retry.py``, ``lifecycle/retention.py`` and ``tuning/``."""

from __future__ import annotations

import random
from dataclasses import InitVar, dataclass
from typing import TYPE_CHECKING, Final

__all__ = ["AUTO", "BY_BYTES", "RetentionPolicy", "RetryPolicy", "TuningOptions"]

# Retry waits draw from a generator of our own: the global ``random`` state belongs to
# training, which checkpoints it.
_JITTER = random.Random()

AUTO = "auto"  # a setting the auto-tuner chooses (every_n_steps, write_batch, base_every_n_steps)
BY_BYTES: Final = "bytes"  # base_every_n_steps sized from the bytes recorded (see CheckpointOptions)


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How long to keep retrying one storage operation that fails transiently.

    Attributes:
        budget_s: give up on one operation after retrying it for this long (and at least twice,
            however long one attempt takes). In the background
            writer that starts an *outage*: the writer keeps retrying at ``max_backoff_s`` while
            training goes on and buffers (see ``CheckpointOptions.on_storage_error``).
        initial_backoff_s: first wait; each retry doubles the ceiling.
        max_backoff_s: ceiling of one wait. Waits are drawn uniformly below the ceiling (full
            jitter), so many writers do not retry in lockstep.
        budget_setting: how the error raised when the budget is spent names the setting that
            changes it, e.g. ``"--retry-budget"`` where the budget came from a command line.

    ``budget_setting`` says only how the budget is named to a user, so it is an init-only
    variable kept on the instance: equality, ``repr`` and :func:`dataclasses.asdict` (the
    options a session records on storage) see the three numbers only, as before.
    """

    budget_s: float = 60.0
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 10.0
    if TYPE_CHECKING:  # to type checkers an ordinary str field; at run time init-only (see above)
        budget_setting: str = "RetryPolicy.budget_s"
    else:
        budget_setting: InitVar[str] = "RetryPolicy.budget_s"

    # The InitVar is hidden from type checkers (above), which then expect no argument here.
    def __post_init__(self, budget_setting: str) -> None:  # type: ignore[override]
        for name in ("budget_s", "initial_backoff_s", "max_backoff_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"RetryPolicy.{name} must be a non-negative number, got {value!r}")
        if not isinstance(budget_setting, str) or not budget_setting:
            raise ValueError(f"RetryPolicy.budget_setting must be a non-empty string, got {budget_setting!r}")
        # Frozen: set like the generated __init__ sets fields. The instance attribute shadows the
        # class default that dataclasses leaves for an InitVar, and is pickled and copied with it.
        object.__setattr__(self, "budget_setting", budget_setting)

    def delay(self, attempt: int) -> float:
        """Wait before retry number ``attempt`` (1-based)."""
        return _JITTER.uniform(0, min(self.max_backoff_s, self.initial_backoff_s * 2 ** (attempt - 1)))


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """Which restorable steps a run keeps; any combination, each keeps what it names.

    Attributes:
        keep_last_bases: keep the ``N`` newest bases and every step from the oldest of them on
            (their chains), so everything in that window stays restorable.
        keep_every_n_steps: keep one restorable step per window of ``K`` steps (``[0, K)``,
            ``[K, 2K)``, ...) for later analysis: a base in the window if there is one, else the
            first durable step in it with the base and diffs it needs.
        keep_newer_than_s: keep everything written in the last ``T`` seconds (and the bases and
            diffs those steps need).
        min_age_s: leftovers of interrupted writes are removed once this old (a writer that is
            still at work is never disturbed).

    With none of the ``keep_*`` set, every step stays restorable and only unneeded objects
    (leftovers, diffs nothing can reach any more) are removed.
    """

    keep_last_bases: int | None = None
    keep_every_n_steps: int | None = None
    keep_newer_than_s: float | None = None
    min_age_s: float = 3600.0

    def __post_init__(self) -> None:
        for name in ("keep_last_bases", "keep_every_n_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        for name in ("keep_newer_than_s", "min_age_s"):
            value = getattr(self, name)
            if value is None and name == "keep_newer_than_s":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")

    @property
    def keeps_everything(self) -> bool:
        return self.keep_last_bases is None and self.keep_every_n_steps is None and self.keep_newer_than_s is None


@dataclass(frozen=True, kw_only=True)
class TuningOptions:
    """What the user tells the tuner; everything else is measured.

    Attributes:
        mtbf_s: mean time between failures of the job, in seconds (a crash, a preemption without
            notice, a lost node). The default, one a day, suits a small job on reliable machines;
            large multi-node jobs and spot instances fail far more often: set it.
        max_overhead: the largest share of step time checkpointing may take from the training
            thread (capture, copies of bases, waiting for the writer).
        rto_s: recovery-time objective: the longest a restore (base load plus replay) may take,
            in seconds; ``None`` for no bound.
        retune_every_n_steps: how often measurements are reviewed (the first review comes after
            a short warm-up).
    """

    mtbf_s: float = 24 * 3600.0
    max_overhead: float = 0.03
    rto_s: float | None = None
    retune_every_n_steps: int = 50

    def __post_init__(self) -> None:
        if not isinstance(self.mtbf_s, (int, float)) or self.mtbf_s <= 0:
            raise ValueError(f"mtbf_s must be a positive number of seconds, got {self.mtbf_s!r}")
        if not isinstance(self.max_overhead, (int, float)) or not 0 < self.max_overhead < 1:
            raise ValueError(f"max_overhead must be a fraction of step time in (0, 1), got {self.max_overhead!r}")
        if self.rto_s is not None and (not isinstance(self.rto_s, (int, float)) or self.rto_s <= 0):
            raise ValueError(f"rto_s must be a positive number of seconds or None, got {self.rto_s!r}")
        if not isinstance(self.retune_every_n_steps, int) or self.retune_every_n_steps < 1:
            raise ValueError(f"retune_every_n_steps must be a positive integer, got {self.retune_every_n_steps!r}")
