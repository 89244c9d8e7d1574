"""What a run will take on storage, projected from its first recorded step: the bytes written per
1,000 steps and the disk the retention in force keeps. The recorder logs it once per session
(:meth:`~diffckpt.recorder.Recorder.record_step`), so that the cost of a configuration on a large
model shows in the first seconds of training rather than when the disk fills.

A projection, not a bound: it assumes every step records what the first one did (restorable
points carry the framework state, fingerprinted steps a copy of the parameters, codec payloads
may vary), and bytes as handed to the writer, before compression.
"""

from __future__ import annotations

from ..options import CheckpointOptions
from ..policies import bytes_interval
from ..policyoptions import BY_BYTES, RetentionPolicy
from ..units import format_bytes

__all__ = ["STEPS", "projection", "retained_bytes", "session_projection"]

STEPS = 1000  # the projection's horizon, in steps


def retained_bytes(policy: RetentionPolicy | None, step_bytes: float, base_bytes: float,
                   interval: int | None) -> float | None:
    """The most ``policy`` keeps on disk with a base of ``base_bytes`` every ``interval`` steps of
    ``step_bytes``; ``None`` where it keeps more than chains bound (everything, one chain that
    never ends, windows of steps or of time).

    ``keep_last_bases=N`` keeps N chains (a base and the diffs up to the next); old ones go only
    once a newer base is durable, so at the peak the next chain is complete too: N + 1.
    """
    if policy is None or policy.keep_last_bases is None or interval is None:
        return None
    if policy.keep_every_n_steps is not None or policy.keep_newer_than_s is not None:
        return None
    return (policy.keep_last_bases + 1) * (base_bytes + interval * step_bytes)


def projection(step_bytes: float, base_bytes: float, interval: int | None, policy: RetentionPolicy | None,
               *, streams: int = 1, bases: str = "base") -> str:
    """One line: bytes per :data:`STEPS` steps (records, plus a base every ``interval`` steps) and
    the disk ``policy`` needs. ``streams``: rank streams of a sharded run, each writing as much as
    this one; ``bases``: what makes the bases (``"compacted base"`` with compaction)."""
    per_run = STEPS * step_bytes + (STEPS / interval * base_bytes if interval else 0.0)
    every = f"a {format_bytes(base_bytes)} {bases} every {interval} steps" if interval else "no periodic bases"
    ranks = f", in each of {streams} rank streams" if streams > 1 else ""
    line = (f"projected storage: {format_bytes(streams * per_run)} per {STEPS:,} steps "
            f"({format_bytes(step_bytes)} recorded per step, {every}{ranks})")
    kept = retained_bytes(policy, step_bytes, base_bytes, interval)
    if kept is not None and policy is not None and policy.keep_last_bases is not None:
        n = policy.keep_last_bases
        return (f"{line}; retention keeps the chains of the {n} newest base{'s' if n > 1 else ''}: about "
                f"{format_bytes(streams * kept)} on disk at most")
    if policy is None or policy.keeps_everything:
        return f"{line}; no retention{' (retention=None)' if policy is None else ''}: storage grows by that much"
    if interval is None and policy.keep_last_bases is not None:
        return (f"{line}; without periodic bases or compaction the newest chain never ends and retention "
                "cannot trim it: storage grows by that much")
    return f"{line}; retention keeps windows of steps or of time as well: storage grows with them"


def session_projection(options: CheckpointOptions, interval: int | None, step_bytes: float, base_bytes: float,
                       streams: int = 1) -> str:
    """:func:`projection` for a session that starts with these ``options`` and a base interval of
    ``interval`` steps in force: a byte-sized interval is what its first sizing will choose from
    ``step_bytes``; without periodic bases, compaction makes them."""
    bases = "base"
    if options.base_every_n_steps == BY_BYTES:
        interval = bytes_interval(options.base_every_diff_bytes_ratio, base_bytes, step_bytes)
    if interval is None and options.compact_every_n_steps is not None:
        interval, bases = options.compact_every_n_steps, "compacted base"
    return projection(step_bytes, base_bytes, interval, options.retention, streams=streams, bases=bases)
