"""User-facing settings of the checkpoint engine, grouped by concern."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from .policyoptions import AUTO, BY_BYTES, RetentionPolicy, RetryPolicy, TuningOptions

__all__ = ["BY_BYTES", "DEFAULT_BASE_EVERY_DIFF_BYTES_RATIO", "DEFAULT_BASE_EVERY_N_STEPS",
           "DEFAULT_EVERY_N_STEPS", "DEFAULT_FINGERPRINT_EVERY_N_STEPS", "DEFAULT_RETENTION",
           "DEFAULT_WRITE_BATCH", "NOT_GIVEN_BASE_EVERY_N_STEPS", "NOT_GIVEN_EVERY_N_STEPS",
           "NOT_GIVEN_WRITE_BATCH", "SEGMENT_BYTES", "Auto", "BaseEvery", "ByBytes", "CheckpointOptions",
           "NotGiven", "merge_options", "segment_records"]

Auto = Literal["auto"]
"""A knob left to the auto-tuner."""

ByBytes = Literal["bytes"]
"""``base_every_n_steps`` sized from the bytes recorded since the last base."""

BaseEvery = int | Auto | ByBytes | None
"""What ``base_every_n_steps`` takes."""

# The one place these defaults are written: the options below, the adapters' keywords and the
# tuner's starting point all read them from here.
DEFAULT_EVERY_N_STEPS = 1
DEFAULT_WRITE_BATCH = 8
# A segment is also cut once its records hold this many bytes, whatever ``write_batch``: at GPT-2
# 124M a record is ~240 MiB, and 8 of them a segment left the run root idle until 2 GB were
# appended, then held the last 2 GB back at a flush, and let a node loss take 8 steps while the
# run root kept up. Segments this size still make few objects (the per-object cost, a request and
# an fsync, is small beside 64 MiB), and small records still batch by ``write_batch``.
SEGMENT_BYTES = 64 << 20


def segment_records(write_batch: int, record_bytes: float) -> int:
    """The records a segment holds when each records ``record_bytes``: ``write_batch``, or fewer
    once they reach :data:`SEGMENT_BYTES` (the writer cuts after the record that reaches it)."""
    if record_bytes <= 0:
        return write_batch
    return max(1, min(write_batch, math.ceil(SEGMENT_BYTES / record_bytes)))

# A fixed step count cannot suit every model: 500 steps of dense GPT-2-small gradients are about
# 170 full checkpoints to replay. Sized by bytes, a restore reads at most about this many bases'
# worth of diffs, and the extra bases cost 1/ratio of the diff bytes written.
DEFAULT_BASE_EVERY_N_STEPS: ByBytes = BY_BYTES
DEFAULT_BASE_EVERY_DIFF_BYTES_RATIO = 4.0
DEFAULT_FINGERPRINT_EVERY_N_STEPS = 50
# The newest base's chain and the one before it: storage stays bounded, and a restore that finds
# the newest chain damaged still has the previous one to fall back on.
DEFAULT_RETENTION = RetentionPolicy(keep_last_bases=2)


@dataclass(frozen=True)
class NotGiven:
    """The value of an adapter's keyword its caller left out: ``options=`` decides, else the
    default. It shows as the default in signatures and ``help()``."""

    default: int | str

    def __repr__(self) -> str:
        return repr(self.default)


# The adapters' keyword defaults: told apart from the same value given explicitly, which wins.
NOT_GIVEN_EVERY_N_STEPS = NotGiven(DEFAULT_EVERY_N_STEPS)
NOT_GIVEN_WRITE_BATCH = NotGiven(DEFAULT_WRITE_BATCH)
NOT_GIVEN_BASE_EVERY_N_STEPS = NotGiven(DEFAULT_BASE_EVERY_N_STEPS)


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """How often to capture, batch, base and verify.

    Attributes:
        every_n_steps: a restorable point every this many optimizer steps. Gradients are recorded
            at every step regardless, since replay needs all of them.
        write_batch: consecutive step records written to storage as one segment, at most: a
            segment is also cut once its records hold 64 MiB (``SEGMENT_BYTES``), so that large
            models' steps reach the run root one or two at a time.
        base_every_n_steps: ``"bytes"`` (the default): a full base once the step records written
            since the last base add up to ``base_every_diff_bytes_ratio`` times a base's size, so
            that a restore never reads much more than that many full checkpoints of diffs
            whatever the model and codec. An integer: a full base every this many steps. ``None``:
            only the starting base (with ``compact_every_n_steps``, bases come from compaction).
            Every session also writes a base when it starts.

            Each of these three may be ``"auto"``: the auto-tuner measures the run online and
            picks the value that minimises the expected time lost for ``tuning`` (MTBF, overhead
            budget, recovery-time objective); see ``docs/tuning.md``.
        base_every_diff_bytes_ratio: with ``base_every_n_steps="bytes"``, the diff bytes between
            two bases, as a multiple of a base's size (the bytes handed to the writer, before
            compression). The interval is sized in steps right after each base, from the bytes
            per step recorded so far in the session; every rank of a job takes rank 0's interval.
        tuning: what the auto-tuner is told (only used when a knob is ``"auto"``).
        fingerprint_every_n_steps: record a hash of the parameters every this many steps (and at
            every base); replay checks it. ``None`` fingerprints bases only.
        max_pending_bytes: memory the queue to the background writer may hold; when full, the
            training thread waits (and warns) rather than dropping anything.
        compression: ``"auto"`` (zstd when a sample of the segment's first record shrinks by at
            least 10%, as dense float32 gradients usually do not and RNG states and compressed
            payloads do, *and* compressing it took less time than writing the bytes it saves:
            never slower than the spool it writes to, where each record's path ends with training
            waiting for the record before it (the rate measured on the spool's file system; the
            upload or copy to the run root after it is paced by ``durability``, off that path),
            ``"zstd"`` (compressed by up to 8 worker threads, half the cores, on 4 cores or more)
            or ``"none"``.
        compression_level: zstd level (1 is fast and keeps up with training on few cores).
        retry: how transient storage failures (timeouts, 5xx, throttling, resets) are retried.
        on_storage_error: what happens when storage has been failing for longer than
            ``retry.budget_s`` *and* the buffered steps fill ``max_pending_bytes``: ``"block"``
            makes training wait (with a warning) until storage is back, ``"raise"`` raises
            :class:`~diffckpt.StorageUnavailableError` on the training thread. Until the buffer is
            full, training goes on either way; nothing is ever dropped.
        retention: which steps to keep restorable (:class:`~diffckpt.RetentionPolicy`); the rest
            is deleted in the background once a newer base is durable. The default keeps the two
            newest bases and every step from the older of them on
            (``RetentionPolicy(keep_last_bases=2)``); the newest durable step, and on a sharded
            run the newest step durable on every rank, always stay. ``None`` deletes nothing
            (every step stays restorable, and storage grows with training).
        compact_every_n_steps: roll a base forward in a background thread (replaying the stored
            diffs, see :func:`diffckpt.compact`) once the durable step is this many steps past the
            newest base. With ``base_every_n_steps=None`` training never stalls for a full
            checkpoint. ``None``: no background compaction.
        compact_device: where background compaction replays. ``None`` (the default): the device
            the model's parameters are on when the session starts, since replay on the device type
            training runs on gives a bit-exact base (on another one the fingerprints recorded in
            training fail to match and nothing is compacted).
        copy_gradients: copy every gradient at each step. By default a step's gradients are
            taken without a copy once training lets them go (``zero_grad(set_to_none=True)``), and
            copied when training keeps them (``set_to_none=False``, accumulation across steps);
            set this when code changes gradients after ``optimizer.step()`` through ``.data``,
            numpy or a view kept past the step, which the guard cannot see
            (``docs/architecture.md``, Capture).
        local_dir: the node-local tier: where each open segment's records are journaled as they
            are written (no ``fsync``: it outlives a process, not the node), so that a resume on
            the same node after a process crash (``kill -9``, the OOM killer, an exception) loses
            at most the last step, whatever ``write_batch`` and storage. The training thread then
            waits at each step until the step before it is journaled. ``"auto"`` (the default):
            the folder named by the environment variable ``DIFFCKPT_LOCAL_DIR`` if set, else
            shared memory (``/dev/shm``, where records are written at memory speed) when it has
            at least 1 GiB free, else the system temporary folder (``TMPDIR``); a path: a folder
            of your own (e.g. a local NVMe disk); ``None``: no journal, and a crash loses what no
            segment committed yet (up to ``write_batch`` steps and what is queued). The open
            segments' spools live there too, except on a local run root when the folder is on
            disk (they then stay beside their segments, committed by a rename).
            ``docs/storage.md`` says what each failure loses.
        durability: ``"paced"`` (the default): training never waits for the durable tier (the
            run root). The per-step chain is kept in the node-local tier; the run root takes
            every segment while it keeps up, and when it falls behind, a base supersedes the
            segments waiting before it, so the run root takes bases at the pace of its bandwidth
            (a node loss then loses the steps since the newest durable base, which the first
            step's log, ``diffckpt ls`` and the metrics state). ``"every_step"``: every segment
            is made durable, and training waits for storage when it is slower than the records.
        local_max_bytes: with ``durability="paced"``, the bytes of finished segments that may
            wait in the node-local tier for the run root (or be parked there until the base after
            them is durable) before the writer, and so training, waits. ``None`` (the default):
            half the free space of the node-local tier's folder when the session starts.
        flush_timeout_s: how long the final flush may take when training is interrupted
            (SIGTERM, SIGINT, an exception) before giving up; it then logs how far durability
            got. A normal end of training waits for storage as ``on_storage_error`` says.
    """

    TUNABLE = ("every_n_steps", "write_batch", "base_every_n_steps")

    every_n_steps: int | Auto = DEFAULT_EVERY_N_STEPS
    write_batch: int | Auto = DEFAULT_WRITE_BATCH
    base_every_n_steps: BaseEvery = DEFAULT_BASE_EVERY_N_STEPS
    base_every_diff_bytes_ratio: float = DEFAULT_BASE_EVERY_DIFF_BYTES_RATIO
    fingerprint_every_n_steps: int | None = DEFAULT_FINGERPRINT_EVERY_N_STEPS
    max_pending_bytes: int = 256 << 20
    compression: Literal["auto", "zstd", "none"] = "auto"
    compression_level: int = 1
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    on_storage_error: Literal["block", "raise"] = "block"
    flush_timeout_s: float = 30.0
    copy_gradients: bool = False
    tuning: TuningOptions = field(default_factory=TuningOptions)
    retention: RetentionPolicy | None = DEFAULT_RETENTION
    compact_every_n_steps: int | None = None
    compact_device: str | None = None
    local_dir: str | None = "auto"
    durability: Literal["paced", "every_step"] = "paced"
    local_max_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("every_n_steps", "write_batch", "max_pending_bytes", "compression_level"):
            value = getattr(self, name)
            if value == AUTO and name in self.TUNABLE:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                also = " or 'auto'" if name in self.TUNABLE else ""
                raise ValueError(f"{name} must be a positive integer{also}, got {value!r}")
        for name in ("base_every_n_steps", "fingerprint_every_n_steps"):
            value = getattr(self, name)
            if value in (AUTO, BY_BYTES) and name in self.TUNABLE:
                continue
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                also = f", None, '{AUTO}' or '{BY_BYTES}'" if name in self.TUNABLE else " or None"
                raise ValueError(f"{name} must be a positive integer{also}, got {value!r}")
        ratio = self.base_every_diff_bytes_ratio
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 < ratio < math.inf:
            raise ValueError(f"base_every_diff_bytes_ratio must be a positive number, got {ratio!r}")
        n = self.compact_every_n_steps
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"compact_every_n_steps must be a positive integer or None, got {n!r}")
        if self.compact_device is not None and (not isinstance(self.compact_device, str) or not self.compact_device):
            raise ValueError(f"compact_device must be a device name or None, got {self.compact_device!r}")
        if self.retention is not None and not isinstance(self.retention, RetentionPolicy):
            raise ValueError(f"retention must be a diffckpt.RetentionPolicy or None, got {self.retention!r}")
        if not isinstance(self.tuning, TuningOptions):
            raise ValueError(f"tuning must be a diffckpt.TuningOptions, got {self.tuning!r}")
        if self.on_storage_error not in ("block", "raise"):
            raise ValueError(f"on_storage_error must be 'block' or 'raise', got {self.on_storage_error!r}")
        if not isinstance(self.retry, RetryPolicy):
            raise ValueError(f"retry must be a diffckpt.RetryPolicy, got {self.retry!r}")
        if not isinstance(self.flush_timeout_s, (int, float)) or self.flush_timeout_s < 0:
            raise ValueError(f"flush_timeout_s must be a non-negative number, got {self.flush_timeout_s!r}")
        if not isinstance(self.copy_gradients, bool):
            raise ValueError(f"copy_gradients must be True or False, got {self.copy_gradients!r}")
        if self.local_dir is not None and (not isinstance(self.local_dir, str) or not self.local_dir):
            raise ValueError(f"local_dir must be 'auto', a folder or None, got {self.local_dir!r}")
        if self.durability not in ("paced", "every_step"):
            raise ValueError(f"durability must be 'paced' or 'every_step', got {self.durability!r}")
        n = self.local_max_bytes
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"local_max_bytes must be a positive integer or None, got {n!r}")
        if self.compression not in ("auto", "zstd", "none"):
            raise ValueError(f"compression must be 'auto', 'zstd' or 'none', got {self.compression!r}")

    @property
    def auto(self) -> bool:
        """Whether any knob is left to the auto-tuner."""
        return any(getattr(self, name) == AUTO for name in self.TUNABLE)

    @property
    def codec_check_every(self) -> int:
        """How often compressed training checks its payloads bitwise against what the optimizer
        consumed: at the fingerprint interval, or the default one when fingerprints are off."""
        return self.fingerprint_every_n_steps or DEFAULT_FINGERPRINT_EVERY_N_STEPS


def merge_options(options: CheckpointOptions | None, legacy: dict[str, Any], *,
                  every_n_steps: int | Auto | NotGiven, write_batch: int | Auto | NotGiven,
                  base_every_n_steps: BaseEvery | NotGiven) -> CheckpointOptions:
    """The options of an adapter built with the three knobs as keywords and ``options``.

    A knob given as a keyword wins, whatever its value (the default's too); one left out
    (:class:`NotGiven`) takes the value in ``options``, else the default. ``legacy`` holds further
    :class:`CheckpointOptions` fields given as keyword arguments, the spelling before
    ``options=`` existed: still accepted, with a :class:`DeprecationWarning` naming the new one.
    """
    if legacy:
        fields = {f.name for f in dataclasses.fields(CheckpointOptions)}
        unknown = sorted(set(legacy) - fields)
        if unknown:
            raise TypeError(f"unexpected keyword arguments {unknown}; the options are the fields of "
                            "diffckpt.CheckpointOptions, passed as options=CheckpointOptions(...)")
        spelled = ", ".join(f"{k}={v!r}" for k, v in sorted(legacy.items()))
        warnings.warn(f"passing {', '.join(sorted(legacy))} as keyword arguments is deprecated and will be "
                      f"removed in the next release; pass options=diffckpt.CheckpointOptions({spelled})",
                      DeprecationWarning, stacklevel=3)
    base = dataclasses.replace(options, **legacy) if options is not None else CheckpointOptions(**legacy)
    knobs = {"every_n_steps": every_n_steps, "write_batch": write_batch, "base_every_n_steps": base_every_n_steps}
    given: dict[str, Any] = {k: v for k, v in knobs.items() if not isinstance(v, NotGiven)}
    return dataclasses.replace(base, **given) if given else base
