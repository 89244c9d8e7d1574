"""Leftovers of interrupted writes: what a run root holds that no commit made, and how old it is.

Uncommitted base files, local temporary files, incomplete multipart uploads and tuning probes
are removed by garbage collection once older than ``RetentionPolicy.min_age_s``, so a writer that
is still at work is never disturbed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..runstore import RunStore
from ..storage import InspectableStorage

__all__ = ["Leftover", "details_of", "hidden", "leftovers"]


@dataclass
class Leftover:
    """Something an interrupted write left: a file, or an incomplete upload (``upload_id``)."""

    path: str
    size: int
    kind: str
    upload_id: str | None = None



def hidden(path: str) -> bool:
    return path.rsplit("/", 1)[-1].startswith(".")


def details_of(store: RunStore) -> dict[str, tuple[int, float | None]]:
    """``{path: (size, mtime)}`` including temporary files where the storage can tell; a
    storage that cannot gives sizes with unknown times (then nothing counts as old)."""
    if isinstance(store.storage, InspectableStorage):
        return store.storage.details("", hidden=True)
    return {p: (size, None) for p, size in store.storage.list("").items()}


def leftovers(store: RunStore, details: dict[str, tuple[int, float | None]], committed: set[str],
               cutoff: float) -> list[Leftover]:
    out = []
    for path, (size, mtime) in sorted(details.items()):
        if mtime is None or mtime >= cutoff:
            continue
        name = path.rsplit("/", 1)[-1]
        if hidden(path) and name.endswith(".tmp"):
            out.append(Leftover(path, size, "temporary file of an interrupted write"))
        elif path.startswith("bases/") and path.count("/") >= 2 and path.rsplit("/", 1)[0] not in committed:
            out.append(Leftover(path, size, "file of a base that was never committed"))
        elif path.startswith("_probe/"):
            out.append(Leftover(path, size, "storage probe of an interrupted tuner"))
    if isinstance(store.storage, InspectableStorage):
        for key, upload_id, started in store.storage.incomplete_uploads():
            if started is not None and started < cutoff:
                out.append(Leftover(key, 0, "incomplete multipart upload", upload_id))
    return out
