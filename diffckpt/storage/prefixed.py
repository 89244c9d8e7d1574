"""A storage seen from one of its folders: each rank of a sharded run writes its own stream
under ``ranks/r<rank>/`` of the run root, through the same :class:`Storage` calls as a whole run.

:func:`substorage` keeps the retry wrapper outermost, so that the writer's cancellation
(``RetryingStorage.with_cancel``) and ``unwrap`` work on a rank's storage as on the root's.
"""

from __future__ import annotations

from typing import Any

from .protocol import Data, InspectableStorage, Storage
from .retry import RetryingStorage
from .spool import Spool, open_spool, ranged, read_into, read_range

__all__ = ["Prefixed", "substorage"]


class Prefixed:
    """``inner`` restricted to the objects under ``prefix`` (which ends with ``/``); paths are
    relative to the prefix. Over an :class:`InspectableStorage`, it is one too."""

    def __new__(cls, inner: Any = None, prefix: str = "") -> Prefixed:
        capable = cls is Prefixed and isinstance(inner, InspectableStorage)
        return object.__new__(_PrefixedInspectable if capable else cls)

    def __init__(self, inner: Storage, prefix: str) -> None:
        self.inner = inner
        self.prefix = prefix.strip("/") + "/"
        self.url = inner.url.rstrip("/") + "/" + self.prefix.rstrip("/")
        self.local = bool(getattr(inner, "local", False))

    def _strip(self, listing: dict[str, Any]) -> dict[str, Any]:
        n = len(self.prefix)
        return {k[n:]: v for k, v in listing.items() if k.startswith(self.prefix)}

    def write(self, path: str, data: Data) -> None:
        self.inner.write(self.prefix + path, data)

    def create(self, path: str, data: bytes) -> bool:
        return self.inner.create(self.prefix + path, data)

    def read(self, path: str) -> bytes:
        return self.inner.read(self.prefix + path)

    def read_range(self, path: str, start: int, end: int) -> bytes:
        return read_range(self.inner, self.prefix + path, start, end)

    def read_into(self, path: str, start: int, out: memoryview) -> int:
        return read_into(self.inner, self.prefix + path, start, out)

    @property
    def ranged(self) -> bool:
        return ranged(self.inner)

    def spool(self, hint: str, folder: str | None = None) -> Spool:
        return open_spool(self.inner, self.prefix + hint, folder)

    def list(self, prefix: str) -> dict[str, int]:
        return self._strip(self.inner.list(self.prefix + prefix))

    def delete(self, path: str) -> None:
        self.inner.delete(self.prefix + path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(self.prefix + path)


class _PrefixedInspectable(Prefixed):
    inner: Any

    def details(self, prefix: str, hidden: bool = False) -> dict[str, tuple[int, float | None]]:
        return self._strip(self.inner.details(self.prefix + prefix, hidden=hidden))

    def stat(self, path: str) -> tuple[int, float | None]:
        return self.inner.stat(self.prefix + path)

    def incomplete_uploads(self) -> list[tuple[str, str, float | None]]:
        n = len(self.prefix)
        return [(k[n:], u, t) for k, u, t in self.inner.incomplete_uploads() if k.startswith(self.prefix)]

    def abort_upload(self, path: str, upload_id: str) -> None:
        self.inner.abort_upload(self.prefix + path, upload_id)


def substorage(storage: Storage, prefix: str) -> Storage:
    """``storage`` seen from its folder ``prefix``, retried as ``storage`` is."""
    if isinstance(storage, RetryingStorage):
        return RetryingStorage(Prefixed(storage.inner, prefix), storage.policy, storage.cancel)
    return Prefixed(storage, prefix)
