"""What the tuner's chosen settings risk per failure, as the log, ``sessions/g<gen>.tuning.json``
and ``diffckpt ls`` state it. Apart from the cost model so that ``ls`` reads it without numpy."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .model import Estimate, Measurements

__all__ = ["risk", "say_risk"]


def risk(e: Estimate, m: Measurements) -> dict[str, Any]:
    """The work a failure loses with these settings, on average and at most, in steps and
    seconds, and since which step: the newest restorable one journaled on the node (the
    node-local tier on) or the newest durable one."""
    return {"steps": round(e.lost_steps, 1), "seconds": round(e.lost_work_s, 3),
            "worst_steps": math.ceil(e.worst_lost_steps - 1e-6), "worst_seconds": round(e.worst_lost_s, 3),
            "since": "restorable" if m.local_tier else "durable"}


def say_risk(r: dict[str, Any]) -> str:
    """:func:`risk` in words."""
    since = ("the newest restorable step journaled on this node" if r.get("since") == "restorable"
             else "the newest durable step")
    return (f"risks {r['steps']:g} steps ({r['seconds']:.2g}s) per failure, at most {r['worst_steps']} "
            f"({r['worst_seconds']:.2g}s), since {since}")
