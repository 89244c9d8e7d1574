"""What each failure loses, stated from measurements: at a session's first step (the log), in the
metrics, and in ``docs/storage.md``'s terms; stated again as the measurements settle
(:class:`Restating`) whenever what it says changes.

Two tiers hold a run's steps: the node-local tier (every step journaled as it is recorded: a
process crash loses at most the step being journaled) and the run root, the durable tier (a node
loss loses what it does not hold yet). How far the run root lags is physics: the bytes a step
records against the bandwidth the run root was measured at. Paced (``durability="paced"``), while
the run root keeps up it takes every segment and lags by about a segment; when it does not, it
takes bases, and lags by a base interval plus the time the next base takes to write and, before
it, what was being written when it was handed over: a base, or a segment already started (on
2 cores, a run that stated 16 steps from two base writes lost 18 with a segment of 8 records in
flight: 807 MiB against a 202 MiB base; a segment holds ``write_batch`` records, or fewer once they
reach ``SEGMENT_BYTES``). With ``durability="every_step"`` the lag is bounded by the writer's
queue, and training pays for it: it waits at least ``record bytes / bandwidth`` a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .options import CheckpointOptions, segment_records
from .policies import bytes_interval
from .units import format_bytes, format_duration

__all__ = ["LossBound", "Restating", "loss_bound"]

_QUEUED_SEGMENTS = 3  # every_step: the one being committed and WAITING (committer.py) behind it


@dataclass(frozen=True)
class LossBound:
    """At most how much work each failure loses (``None``: no bound: what is stated in ``text``).

    Attributes:
        crash_steps: a process crash (``kill -9``, the OOM killer), resumed on the same node.
        node_steps, node_seconds: the loss of the node (its local tier with it).
        keeps_up: whether the run root takes every segment at the measured bandwidth.
        floor_s: with every step durable, the least time training waits for storage a step.
        text: all of it in words, for the log.
    """

    crash_steps: int | None
    node_steps: int | None
    node_seconds: float | None
    keeps_up: bool
    floor_s: float
    text: str

    def same_steps(self, other: LossBound) -> bool:
        """Whether ``other`` states the same losses in steps (its figures may differ)."""
        return (self.crash_steps, self.node_steps, self.keeps_up) == (other.crash_steps, other.node_steps, other.keeps_up)


def loss_bound(options: CheckpointOptions, journal: bool, write_batch: int, durable_bps: float | None, url: str, *,
               step_s: float, record_bytes: float, base_bytes: float, base_every: Any) -> LossBound:
    """The bound for these measurements: ``step_s`` a step, ``record_bytes`` recorded a step,
    bases of ``base_bytes`` every ``base_every`` steps (the setting in force: ``"bytes"`` is sized
    here as the recorder sizes it), and the run root at ``url`` writing ``durable_bps`` bytes a
    second (``None``: not measured yet); ``journal``: whether the node-local tier is on."""
    paced = options.durability == "paced"
    if base_every is not None and not isinstance(base_every, int):  # "bytes" (or "auto" before a review)
        base_every = bytes_interval(options.base_every_diff_bytes_ratio, base_bytes, record_bytes)
    step_s = max(step_s, 1e-6)
    if durable_bps is None or durable_bps <= 0:
        crash = 1 if journal else None
        return LossBound(crash, None, None, True, 0.0,
                         f"a process crash loses at most {_steps(crash, write_batch)}; the bandwidth of {url} is not "
                         "measured yet, so what a node loss loses is not stated")
    need_bps = record_bytes / step_s
    keeps_up = durable_bps >= need_bps
    batch = segment_records(write_batch, record_bytes)  # large records: fewer a segment
    segment_steps = math.ceil(batch * record_bytes / durable_bps / step_s)
    floor_s = 0.0
    if not paced:
        node: int | None = batch * _QUEUED_SEGMENTS + segment_steps
        floor_s = max(0.0, record_bytes / durable_bps - step_s)
    elif keeps_up:
        node = batch + segment_steps
    elif base_every is None:
        node = None
    else:
        in_flight = max(base_bytes, batch * record_bytes)  # a base, or a segment started before it
        node = base_every + math.ceil((in_flight + base_bytes) / durable_bps / step_s)
    crash = 1 if journal else node
    seconds = None if node is None else node * step_s
    where = (f"{url} writes {format_bytes(durable_bps)}/s (measured) and a step records {format_bytes(record_bytes)} "
             f"every {format_duration(step_s)} ({format_bytes(need_bps)}/s)")
    if node is None:
        node_text = ("a node loss loses every step since the newest durable one, without bound: the run root is "
                     "slower than the records and no base comes to replace them (set base_every_n_steps)")
    else:
        node_text = f"a node loss loses at most {node} steps (~{format_duration(seconds or 0.0)})"
    if not paced:
        mode = ("every step durable (durability='every_step'): " + (
            f"training waits about {format_duration(floor_s)} a step for storage" if floor_s > 0
            else "storage keeps up"))
    elif keeps_up:
        mode = "paced: the run root keeps up and takes every step"
    else:
        mode = (f"paced: the run root is slower than the records and takes bases ({format_bytes(base_bytes)}) "
                "instead of the steps between them; training does not wait for it")
    return LossBound(crash, node, seconds, keeps_up, floor_s,
                     f"a process crash loses at most {_steps(crash, write_batch)}; {node_text}. {where}; {mode}")


def _steps(n: int | None, write_batch: int) -> str:
    if n is None:
        return f"the steps no segment committed yet (up to write_batch={write_batch} and what is queued)"
    return "1 step" if n == 1 else f"{n} steps"


class Restating:
    """When a session states its loss bound, and from what: at its first record, from the time
    since the session's first base; then at its 2nd, 4th, 8th, ... record and every
    :data:`EVERY` records after, from the steps and bytes recorded since the statement before.

    The first step of a session is slow (allocation, warm-up, the first base made durable), and
    its time alone stated too little lost: on 2 cores, 1.83 s for a first step of steps that then
    took 0.2 s stated that the run root kept up and a node loss lost 2 steps, and a node loss at
    step 18 lost 10 (``bench/fast_steps.py --kill``)."""

    EVERY = 1024

    def __init__(self) -> None:
        self.records = self._steps = 0
        self._bytes = 0.0
        self._since: float | None = None

    def record(self, steps: int, nbytes: float, now: float, first_base_at: float) -> tuple[float, float] | None:
        """A record of ``steps`` steps and ``nbytes`` handed over at ``now``: the bytes and seconds
        a step to state the bound from when a statement is due, else ``None``."""
        self.records += 1
        self._steps += steps
        self._bytes += nbytes
        n = self.records
        if n & (n - 1) and n % self.EVERY:
            return None
        since = first_base_at if self._since is None else self._since
        rates = (self._bytes / self._steps, (now - since) / self._steps)
        self._since, self._steps, self._bytes = now, 0, 0.0
        return rates
