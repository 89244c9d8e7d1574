"""The numbers a user watches while training: how far durability got and what it costs.

One place computes them, from the writing process's :class:`~diffckpt.writer.BackgroundWriter`,
as flat ``diffckpt/<name>`` keys that the adapters only forward to their loggers and trackers
(the table of names, meanings and units is in ``docs/lightning.md``, section "Metrics").
"""

from __future__ import annotations

from dataclasses import dataclass

from .lossbound import LossBound
from .writer import BackgroundWriter

__all__ = ["CheckpointMetrics"]


@dataclass(frozen=True)
class CheckpointMetrics:
    """A snapshot of one writing session, taken on the training thread."""

    recorded_step: int  # newest step handed to the writer
    durable_step: int | None  # newest step committed to storage (None: not even the starting base yet)
    segment_bytes: int  # bytes of step records written (segments), this session
    records: int  # step records written in those segments
    bytes_written: int  # everything written, segments and bases
    stall_seconds: float  # time training waited on a full queue
    queued_bytes: int  # bytes queued or pending in the writer, not durable yet
    max_pending_bytes: int  # the queue's bound
    local_step: int | None = None  # newest step in the node-local tier (None: no journal, or none yet)
    loss: LossBound | None = None  # what each failure loses at most, stated at the session's first record

    @classmethod
    def of(cls, writer: BackgroundWriter, recorded_step: int) -> CheckpointMetrics:
        s = writer.stats
        return cls(recorded_step, writer.durable_step, s.segment_bytes, s.records, s.segment_bytes + s.base_bytes,
                   s.stall_seconds, writer.queued_bytes, writer.options.max_pending_bytes, writer.journaled_step,
                   writer.loss)

    @property
    def bytes_per_step(self) -> float:
        """Stored bytes per recorded step (segments only: bases are counted in ``bytes_written``)."""
        return self.segment_bytes / self.records if self.records else 0.0

    def as_dict(self) -> dict[str, float]:
        """Flat ``diffckpt/*`` metrics for experiment loggers; the durable step and the lag are
        left out until the session's first write is durable (a logger wants numbers). The lag of
        each tier: ``durability_lag_steps`` (the run root: what a node loss loses) and
        ``local_lag_steps`` (the node-local tier: what a process crash loses). What each failure
        loses at most, as stated at the first record: ``crash_loss_bound_steps`` and
        ``node_loss_bound_steps`` (left out where there is no bound, or none measured yet)."""
        out = {"diffckpt/bytes_per_step": self.bytes_per_step,
               "diffckpt/bytes_written": float(self.bytes_written),
               "diffckpt/writer_stall_s": self.stall_seconds,
               "diffckpt/queue_fill": self.queued_bytes / max(1, self.max_pending_bytes)}
        if self.durable_step is not None:
            out["diffckpt/durable_step"] = float(self.durable_step)
            out["diffckpt/durability_lag_steps"] = float(max(0, self.recorded_step - self.durable_step))
        local = max(self.local_step or 0, self.durable_step or 0) if self.local_step is not None else None
        if local is not None:
            out["diffckpt/local_step"] = float(local)
            out["diffckpt/local_lag_steps"] = float(max(0, self.recorded_step - local))
        if self.loss is not None and self.loss.crash_steps is not None:
            out["diffckpt/crash_loss_bound_steps"] = float(self.loss.crash_steps)
        if self.loss is not None and self.loss.node_steps is not None:
            out["diffckpt/node_loss_bound_steps"] = float(self.loss.node_steps)
        return out
