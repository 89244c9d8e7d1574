"""A storage outage as the background writer lives through it: since when it lasts, the last
error, what is logged (once at the start, then at most once a minute, and when storage is back),
and the error training gets with ``on_storage_error="raise"``."""

from __future__ import annotations

import logging
import time
from typing import Any

from .errors import StorageUnavailableError
from .options import CheckpointOptions
from .units import format_bytes

__all__ = ["Outage"]

log = logging.getLogger("diffckpt")


class Outage:
    """The outage state of one writer of the run root at ``url``; ``stats`` is the writer's
    :class:`~diffckpt.writer.WriterStats` (outages and their seconds are counted there)."""

    def __init__(self, url: str, options: CheckpointOptions, stats: Any) -> None:
        self.url, self.options, self.stats = url, options, stats
        self.since: float | None = None  # monotonic start of the outage under way, if any
        self.error = ""
        self._logged = 0.0

    def note(self, path: str, exc: StorageUnavailableError, durable_step: int | None, queued_bytes: int) -> None:
        """Committing ``path`` failed past the retry budget: an outage starts, or goes on."""
        self.error = str(exc.__cause__ or exc)
        now = time.monotonic()
        if self.since is None:
            self.since = self._logged = now
            self.stats.outages += 1
            log.warning("diffckpt: storage outage while committing %s: %s. Durable up to step %s; training goes "
                        "on while buffered steps fit in max_pending_bytes (%s), then %s. Retrying until "
                        "storage is back.", path, exc, durable_step, format_bytes(self.options.max_pending_bytes),
                        "waits" if self.options.on_storage_error == "block" else "raises")
        elif now - self._logged >= 60:
            self._logged = now
            log.warning("diffckpt: storage still failing after %.0fs (%s); durable up to step %s, %s buffered",
                        now - self.since, self.error, durable_step, format_bytes(queued_bytes))

    def over(self, queued_bytes: int) -> None:
        """A commit succeeded: the outage under way, if any, is over."""
        if self.since is None:
            return
        lasted = time.monotonic() - self.since
        self.stats.outage_seconds += lasted
        log.warning("diffckpt: storage at %s is back after %.1fs; %s of buffered steps drain now",
                    self.url, lasted, format_bytes(queued_bytes))
        self.since = None

    def cause(self, now: float, durable_step: int | None) -> str | None:
        """Why training waits, when an outage is under way (``None`` otherwise)."""
        if self.since is None:
            return None
        return f"storage has been failing for {now - self.since:.0f}s ({self.error}); durable up to step {durable_step}"

    def raise_if(self, situation: str, durable_step: int | None) -> None:
        """Raise :class:`StorageUnavailableError` in an outage with ``on_storage_error="raise"``."""
        since = self.since
        if since is None or self.options.on_storage_error != "raise":
            return
        raise StorageUnavailableError(
            f"storage at {self.url} has been failing for {time.monotonic() - since:.0f}s "
            f"({self.error}) and {situation}: durable up to step {durable_step}, steps after "
            "it are in memory only. Raised because on_storage_error='raise'; use 'block' to make training "
            "wait for storage instead, or raise max_pending_bytes to ride out longer outages")
