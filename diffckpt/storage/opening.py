"""From a path, URL or caller's object to the storage diffckpt uses: :func:`open_storage`.

Whatever it is given ends up wrapped in a :class:`~diffckpt.storage.RetryingStorage`; a caller's
own :class:`Storage` is also wrapped so that its bare ``OSError`` says what is wrong, as
:class:`FsspecStorage`'s errors do. Each wrapper implements :class:`InspectableStorage` exactly
when the storage it wraps does, so garbage collection sees through them with ``isinstance``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..errors import CheckpointNotFoundError, DiffCkptError
from .fsspec_storage import FsspecStorage, explain
from .protocol import Data, InspectableStorage, Storage, is_storage
from .retry import RetryingStorage, RetryPolicy
from .spool import Spool, open_spool, ranged, read_into, read_range

__all__ = ["open_storage"]


class _Explained:
    """A caller's :class:`Storage` whose bare ``OSError`` is turned into a :class:`StorageError`
    with the explanation :class:`FsspecStorage` gives (full disk, read-only, ...).

    Constructing one over an :class:`InspectableStorage` gives an :class:`_ExplainedInspectable`.
    """

    def __new__(cls, inner: Any = None) -> _Explained:
        # A default: pickling and copying call ``__new__(cls)`` alone, with the class already right.
        capable = cls is _Explained and isinstance(inner, InspectableStorage)
        return object.__new__(_ExplainedInspectable if capable else cls)

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url

    def _call(self, action: str, path: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(path, *args)
        except DiffCkptError:
            raise
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) and action == "read":
                raise CheckpointNotFoundError(f"{self.url}/{path} does not exist") from None
            raise explain(exc, action, f"{self.url}/{path}") from exc

    def write(self, path: str, data: Data) -> None:
        self._call("write", path, self.inner.write, data)

    def create(self, path: str, data: bytes) -> bool:
        return self._call("create", path, self.inner.create, data)

    def read(self, path: str) -> bytes:
        return self._call("read", path, self.inner.read)

    def read_range(self, path: str, start: int, end: int) -> bytes:
        return self._call("read", path, lambda p: read_range(self.inner, p, start, end))

    def read_into(self, path: str, start: int, out: memoryview) -> int:
        return self._call("read", path, lambda p: read_into(self.inner, p, start, out))

    @property
    def ranged(self) -> bool:
        return ranged(self.inner)

    def spool(self, hint: str, folder: str | None = None) -> Spool:
        return self._call("write", hint, lambda p: open_spool(self.inner, p, folder))

    def list(self, prefix: str) -> dict[str, int]:
        return self._call("list", prefix, self.inner.list)

    def delete(self, path: str) -> None:
        self._call("delete", path, self.inner.delete)

    def exists(self, path: str) -> bool:
        return self._call("reach", path, self.inner.exists)


class _ExplainedInspectable(_Explained):
    """:class:`_Explained` over an :class:`InspectableStorage`, which it is too."""

    inner: Any

    def details(self, prefix: str, hidden: bool = False) -> dict[str, tuple[int, float | None]]:
        return self._call("list", prefix, self.inner.details, hidden)

    def stat(self, path: str) -> tuple[int, float | None]:
        return self._call("reach", path, self.inner.stat)

    def incomplete_uploads(self) -> list[tuple[str, str, float | None]]:
        return self._call("list the uploads of", "", lambda _root: self.inner.incomplete_uploads())

    def abort_upload(self, path: str, upload_id: str) -> None:
        self._call("abort the upload of", path, self.inner.abort_upload, upload_id)


def open_storage(url: str | os.PathLike[str] | Storage, *, retry: RetryPolicy | None = None,
                 **storage_options: Any) -> Storage:
    """Return the storage of a path or URL, retrying transient failures under ``retry``.

    A caller's :class:`Storage` is used as it is, except that a bare ``OSError`` it raises becomes
    a :class:`StorageError` that says what is wrong and how to fix it, as in :class:`FsspecStorage`.
    The storage returned implements :class:`InspectableStorage` when the one given does (an
    :class:`FsspecStorage` always does).
    """
    if isinstance(url, RetryingStorage):
        return url
    if isinstance(url, (FsspecStorage, _Explained)):
        inner: Any = url
    elif is_storage(url) and not isinstance(url, (str, os.PathLike)):
        inner = _Explained(url)
    elif isinstance(url, (str, os.PathLike)):
        inner = FsspecStorage(os.fspath(url), **storage_options)
    else:
        raise TypeError(f"cannot open a {type(url).__name__} as storage: give a path, a URL or a Storage (an object "
                        "with url, write, create, read, list, delete and exists)")
    return RetryingStorage(inner, retry)
