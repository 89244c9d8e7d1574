"""Storage protocol and its fsspec implementation.

The engine talks to storage through :class:`Storage` only, so tests can wrap it to inject faults
and other backends can be added without touching the engine. Paths are relative to the run root
and use ``/``.
"""

from __future__ import annotations

import errno
import os
import uuid
from typing import Any, Protocol, runtime_checkable

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .errors import CheckpointNotFoundError, StorageError

__all__ = ["Storage", "FsspecStorage", "open_storage"]


@runtime_checkable
class Storage(Protocol):
    """What the engine needs from a store: atomic whole-object writes and plain reads."""

    url: str

    def write(self, path: str, data: bytes) -> None:
        """Write ``data`` so that readers see the whole object or nothing."""

    def read(self, path: str) -> bytes:
        """Return the whole object; raise :class:`CheckpointNotFoundError` if it is absent."""

    def list(self, prefix: str) -> dict[str, int]:
        """Return ``{relative path: size}`` for every committed object under ``prefix``."""

    def delete(self, path: str) -> None:
        """Remove an object; absent objects are ignored."""

    def exists(self, path: str) -> bool:
        """Whether an object is present."""


def _explain(exc: BaseException, action: str, where: str) -> StorageError:
    code = getattr(exc, "errno", None)
    if code == errno.ENOSPC:
        hint = "the disk is full: free space or point dirpath at a larger volume"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "permission denied or read-only file system: make it writable or choose another dirpath"
    else:
        hint = "check that the location exists, is reachable and that credentials allow it"
    return StorageError(f"cannot {action} {where}: {exc} ({hint})")


class FsspecStorage:
    """:class:`Storage` over any fsspec file system.

    Local disk commits with a temporary file in the same directory, ``fsync``, ``os.replace`` and
    an ``fsync`` of the directory. Object stores commit with a single PUT, which is atomic.
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        self.url = str(url)
        self.fs, root = fsspec.core.url_to_fs(self.url, **storage_options)
        self.root = root.rstrip("/") if root not in ("/", "") else root
        self.local = isinstance(self.fs, LocalFileSystem)

    def _full(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def write(self, path: str, data: bytes) -> None:
        full = self._full(path)
        try:
            if self.local:
                self._write_local(full, data)
            else:
                self.fs.pipe_file(full, data)
        except StorageError:
            raise
        except Exception as exc:  # fsspec backends raise many types
            raise _explain(exc, "write", f"{self.url}/{path}") from exc

    @staticmethod
    def _write_local(full: str, data: bytes) -> None:
        directory = os.path.dirname(full)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(full)}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, full)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, path: str) -> bytes:
        try:
            return self.fs.cat_file(self._full(path))
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.url}/{path} does not exist") from None
        except Exception as exc:
            raise _explain(exc, "read", f"{self.url}/{path}") from exc

    def list(self, prefix: str) -> dict[str, int]:
        base = self._full(prefix)
        try:
            if not self.fs.exists(base):
                return {}
            found = self.fs.find(base, detail=True)
        except Exception as exc:
            raise _explain(exc, "list", f"{self.url}/{prefix}") from exc
        cut = len(self.root.rstrip("/")) + 1 if self.root not in ("", "/") else len(self.root)
        out: dict[str, int] = {}
        for full, info in found.items():
            rel = full[cut:].lstrip("/") if self.root else full
            if info.get("type", "file") == "file" and not rel.rsplit("/", 1)[-1].startswith("."):
                out[rel] = int(info.get("size") or 0)
        return out

    def delete(self, path: str) -> None:
        try:
            self.fs.rm_file(self._full(path))
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise _explain(exc, "delete", f"{self.url}/{path}") from exc

    def exists(self, path: str) -> bool:
        try:
            return bool(self.fs.exists(self._full(path)))
        except Exception as exc:
            raise _explain(exc, "reach", f"{self.url}/{path}") from exc


def open_storage(url: str | os.PathLike[str] | Storage, **storage_options: Any) -> Storage:
    """Return ``url`` if it already is a :class:`Storage`, else an :class:`FsspecStorage`."""
    if isinstance(url, Storage) and not isinstance(url, (str, os.PathLike)):
        return url
    return FsspecStorage(os.fspath(url), **storage_options)
