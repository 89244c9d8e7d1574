"""Decisions as one-method policies over a small context, so they are testable without I/O."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["IntervalPolicy", "StepContext", "bytes_interval"]


@dataclass(frozen=True)
class StepContext:
    """What a policy may look at after an optimizer step."""

    step: int
    last_base_step: int
    every_n_steps: int
    base_every_n_steps: int | None
    fingerprint_every_n_steps: int | None


class IntervalPolicy:
    """Fixed intervals: a restorable point every ``every_n_steps``, a base every
    ``base_every_n_steps`` since the last one, a fingerprint every ``fingerprint_every_n_steps``."""

    def wants_base(self, ctx: StepContext) -> bool:
        return ctx.base_every_n_steps is not None and ctx.step - ctx.last_base_step >= ctx.base_every_n_steps

    def wants_state(self, ctx: StepContext) -> bool:
        return ctx.step % ctx.every_n_steps == 0 or self.wants_base(ctx)

    def wants_fingerprint(self, ctx: StepContext) -> bool:
        n = ctx.fingerprint_every_n_steps
        return n is not None and ctx.step % n == 0 and self.wants_state(ctx)


def bytes_interval(ratio: float, base_bytes: float, bytes_per_step: float) -> int | None:
    """``base_every_n_steps="bytes"`` as a number of steps: how many steps of ``bytes_per_step``
    add up to ``ratio`` times ``base_bytes`` (``None`` while there is nothing to size it from).

    A step count rather than a running byte total, so that it is decided once, by the process
    that records, and every rank of a job follows the same steps (see ``tuning/online.py``)."""
    if bytes_per_step <= 0 or base_bytes <= 0:
        return None
    return max(1, math.ceil(ratio * base_bytes / bytes_per_step))
