"""The background writer's counters: what it wrote, and where its time and training's waits went."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WriterStats"]


@dataclass
class WriterStats:
    """Counters for reports, metrics and benchmarks. The ``*_seconds`` of the writer thread's
    stages say which one holds a record back when training waits for the writer (``stall_seconds``)."""

    records: int = 0  # records committed to the run root (paced: fewer, when bases supersede segments)
    appended: int = 0  # records encoded and appended to their spools: every record handed over
    segments: int = 0
    bases: int = 0
    segment_bytes: int = 0
    base_bytes: int = 0
    raw_record_bytes: int = 0
    stall_seconds: float = 0.0  # training waiting for the writer: a full queue, the record before, its reads
    write_seconds: float = 0.0  # encoding and committing segments and bases (the run root's rate below)
    stage_seconds: float = 0.0  # the writer thread moving records' tensors to the host (and narrowing them)
    append_seconds: float = 0.0  # ... encoding, hashing and appending records to their spools
    lease_wait_seconds: float = 0.0  # ... waiting for training to let go of leased gradients
    outages: int = 0
    outage_seconds: float = 0.0
    peak_held_bytes: int = 0  # the most bytes the writer held at once (queued or being encoded)

    @property
    def durable_bps(self) -> float | None:
        """The run root's measured write rate: bytes written over the time their writes took."""
        written = self.base_bytes + self.segment_bytes
        return written / self.write_seconds if written and self.write_seconds > 0 else None
