"""Online measurements for the auto-tuner (:class:`Meter`).

The engine (training thread) and the writer (its own thread) report what they time; a
:class:`Meter` keeps moving averages and turns them into the tuner's
:class:`~diffckpt.tuning.model.Measurements` on demand. Writes are fitted as ``latency + bytes /
bandwidth`` over a window of recent requests of different sizes (segments, bases and their small
COMMIT markers), seeded by a probe of the storage when the session starts (:mod:`.probe`).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

from .model import Measurements
from .probe import fit_write_cost

__all__ = ["SKIPPED_STEPS", "Ewma", "Meter"]

SKIPPED_STEPS = 2  # the first step timings of a session, left out of the estimates


class Ewma:
    """Exponentially weighted moving average; ``None`` until the first sample."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.value: float | None = None
        self.count = 0

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)
        self.count += 1

    def get(self, default: float = 0.0) -> float:
        return default if self.value is None else self.value


class Meter:
    """Collects what the engine and its writer time, for :meth:`snapshot`.

    Thread-safe: the training thread and the writer thread both report.
    """

    def __init__(self, memory_bytes: int, window: int = 32, local_tier: bool = False) -> None:
        self.memory_bytes = memory_bytes
        self.local_tier = local_tier  # records journaled on the node (CheckpointOptions.local_dir)
        self._lock = threading.Lock()
        self._writes: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        self._bandwidth: float | None = None
        self.step_s = Ewma()
        self._steps_seen = 0
        self.record_s = Ewma()
        self.state_s = Ewma()
        self.plain_record = Ewma()  # encoded bytes of a record without state, and of one with it
        self.state_record = Ewma()
        self.record_bytes = Ewma()
        self.diff_ratio = Ewma()  # encoded / raw bytes of segments
        self.encode_s_per_byte = Ewma()
        self.update_s = Ewma()  # optimizer update time of a step (what replay repeats)
        self.base_bytes = Ewma(alpha=0.5)
        self.base_capture_s = Ewma(alpha=0.5)
        self.base_encode_s = Ewma(alpha=0.5)
        self.restore_load_s: float | None = None  # measured by a restore in this process
        self.restore_step_s: float | None = None

    # ------------------------------------------------------------- training side
    def add_step(self, step_s: float, record_s: float, record_bytes: int) -> None:
        with self._lock:
            self._steps_seen += 1
            if self._steps_seen <= SKIPPED_STEPS:  # a session's first steps warm up caches and allocators
                return
            self.step_s.add(max(step_s, 0.0))
            self.record_s.add(record_s)
            self.record_bytes.add(record_bytes)

    def add_state(self, seconds: float) -> None:
        with self._lock:
            self.state_s.add(seconds)

    def add_update(self, seconds: float) -> None:
        with self._lock:
            self.update_s.add(seconds)

    def add_base_capture(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self.base_capture_s.add(seconds)
            if self.base_bytes.count == 0:  # until the writer has serialized one
                self.base_bytes.value = float(nbytes)

    def add_restore(self, load_s: float, replay_step_s: float | None) -> None:
        with self._lock:
            self.restore_load_s = load_s
            if replay_step_s is not None:
                self.restore_step_s = replay_step_s

    # --------------------------------------------------------------- writer side
    def add_write(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._writes.append((nbytes, seconds))

    def add_probe(self, samples: Sequence[tuple[int, float]]) -> None:
        """Seed the bandwidth from a storage probe (its writes were added one by one)."""
        with self._lock:
            if samples:
                self._bandwidth = fit_write_cost(samples)[1]

    def add_encoded(self, raw_bytes: int, restorable: bool) -> None:
        """The writer encoded a record of ``raw_bytes``, with its framework state if
        ``restorable``: the difference is what a restorable point adds to storage and memory."""
        with self._lock:
            (self.state_record if restorable else self.plain_record).add(raw_bytes)

    def add_segment(self, raw_bytes: int, encoded_bytes: int, encode_s: float) -> None:
        with self._lock:
            if raw_bytes > 0:
                self.diff_ratio.add(encoded_bytes / raw_bytes)
                self.encode_s_per_byte.add(encode_s / raw_bytes)

    def add_base(self, nbytes: int, encode_s: float) -> None:
        with self._lock:
            self.base_bytes.add(nbytes)
            self.base_encode_s.add(encode_s)

    # ------------------------------------------------------------------- reading
    @property
    def ready(self) -> bool:
        """Whether enough was seen to decide: steps, a write and a base."""
        return self.step_s.count >= 3 and bool(self._writes) and self.base_bytes.value is not None

    def snapshot(self, steps: int = 0, base_bytes_now: int | None = None) -> Measurements | None:
        """The current estimates, or ``None`` before :attr:`ready`.

        ``base_bytes_now`` is what a base would hold now (model plus optimizer state). The base a
        fresh run starts with has no optimizer state yet, so it is far smaller than the next
        ones: its size and its copy and encode times are scaled to this size.
        """
        with self._lock:
            if not self.ready:
                return None
            latency, bandwidth = fit_write_cost(list(self._writes), self._bandwidth)
            if bandwidth != self._bandwidth and len(self._writes) >= 4:
                self._bandwidth = bandwidth
            record_bytes = self.record_bytes.get()
            diff_bytes = record_bytes * self.diff_ratio.get(1.0)
            encode = self.encode_s_per_byte.get()
            base_bytes = self.base_bytes.get()
            base_encode, base_capture = self.base_encode_s.get(), self.base_capture_s.get()
            if base_bytes_now and base_bytes > 0 and base_bytes_now > base_bytes:
                scale = base_bytes_now / base_bytes
                base_bytes, base_encode, base_capture = base_bytes_now, base_encode * scale, base_capture * scale
            # Replay repeats the optimizer update on gradients read back and decoded; loading a
            # base reads and unpacks it. Measured by a restore when one ran in this process.
            replay = self.restore_step_s if self.restore_step_s is not None else (
                self.update_s.get() + diff_bytes / bandwidth + encode * record_bytes)
            load = self.restore_load_s if self.restore_load_s is not None else (
                latency + base_bytes / bandwidth + base_encode)
            return Measurements(
                step_s=self.step_s.get(), record_s=self.record_s.get(), state_s=self.state_s.get(),
                diff_bytes=diff_bytes, record_bytes=record_bytes, encode_s_per_byte=encode,
                latency_s=latency, bandwidth_bps=bandwidth, base_bytes=base_bytes,
                base_capture_s=base_capture, base_encode_s=base_encode,
                replay_step_s=replay, base_load_s=load, memory_bytes=float(self.memory_bytes), steps=steps,
                state_bytes=self._state_bytes(), local_tier=self.local_tier)

    def _state_bytes(self) -> float:
        """What a restorable point adds to its record: against the encoded records without state,
        or, while every record has it (every_n_steps=1), against the step's own bytes."""
        if self.state_record.value is None:
            return 0.0
        plain = self.plain_record.value if self.plain_record.value is not None else self.record_bytes.get()
        return max(0.0, self.state_record.value - plain)
