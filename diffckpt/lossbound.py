"""What each failure loses, stated from measurements: at a session's first step (the log), in the
metrics, and in ``docs/storage.md``'s terms.

Two tiers hold a run's steps: the node-local tier (every step journaled as it is recorded: a
process crash loses at most the step being journaled) and the run root, the durable tier (a node
loss loses what it does not hold yet). How far the run root lags is physics: the bytes a step
records against the bandwidth the run root was measured at. Paced (``durability="paced"``), while
the run root keeps up it takes every segment and lags by about a segment; when it does not, it
takes bases, and lags by a base interval plus the time the next base takes to write and, before
it, what was being written when it was handed over: a base, or a segment already started (on
2 cores, a run that stated 16 steps from two base writes lost 18 with a segment of 8 records in
flight: 807 MiB against a 202 MiB base). With ``durability="every_step"`` the lag is bounded by the writer's
queue, and training pays for it: it waits at least ``record bytes / bandwidth`` a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .options import CheckpointOptions
from .policies import bytes_interval
from .units import format_bytes, format_duration

__all__ = ["LossBound", "loss_bound"]

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
    segment_steps = math.ceil(write_batch * record_bytes / durable_bps / step_s)
    floor_s = 0.0
    if not paced:
        node: int | None = write_batch * _QUEUED_SEGMENTS + segment_steps
        floor_s = max(0.0, record_bytes / durable_bps - step_s)
    elif keeps_up:
        node = write_batch + segment_steps
    elif base_every is None:
        node = None
    else:
        in_flight = max(base_bytes, write_batch * record_bytes)  # a base, or a segment started before it
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
