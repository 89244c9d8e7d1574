"""Storage protocol and its fsspec implementation.

The engine talks to storage through :class:`Storage` only, so tests can wrap it to inject faults
and other backends can be added without touching the engine. Paths are relative to the run root
and use ``/``.
"""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .errors import CheckpointNotFoundError, DiffCkptError, StorageError

Buffer = bytes | memoryview
Data = bytes | Sequence[Buffer]

__all__ = ["FsspecStorage", "Storage", "open_storage"]


@runtime_checkable
class Storage(Protocol):
    """What the engine needs from a store: atomic whole-object writes and plain reads."""

    url: str

    def write(self, path: str, data: Data) -> None:
        """Write ``data`` (bytes, or buffers to concatenate) so that readers see the whole object
        or nothing."""

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
    elif code in (errno.ENOTDIR, errno.EEXIST):
        hint = "a part of the path is a file, not a directory: point dirpath at a directory"
    else:
        hint = "check that the location exists, is reachable and that credentials allow it"
    return StorageError(f"cannot {action} {where}: {exc} ({hint})")


def as_bytes(data: Data) -> bytes:
    """``data`` as one bytes object (joins a list of buffers)."""
    return data if isinstance(data, bytes) else b"".join(data)


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

    def write(self, path: str, data: Data) -> None:
        full = self._full(path)
        try:
            if self.local:
                self._write_local(full, [data] if isinstance(data, bytes) else data)
            else:
                self.fs.pipe_file(full, as_bytes(data))
        except StorageError:
            raise
        except Exception as exc:  # fsspec backends raise many types
            raise _explain(exc, "write", f"{self.url}/{path}") from exc

    @staticmethod
    def _write_local(full: str, parts: Sequence[Buffer]) -> None:
        directory = os.path.dirname(full)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(full)}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with open(tmp, "wb") as fh:
                fh.writelines(parts)  # buffers go to the file without being joined first
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


class _Explained:
    """A caller's :class:`Storage` whose bare ``OSError`` is turned into a :class:`StorageError`
    with the explanation :class:`FsspecStorage` gives (full disk, read-only, ...)."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url

    def _call(self, action: str, path: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(path, *args)
        except DiffCkptError:
            raise
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) and action == "read":
                raise CheckpointNotFoundError(f"{self.url}/{path} does not exist") from None
            raise _explain(exc, action, f"{self.url}/{path}") from exc

    def write(self, path: str, data: Data) -> None:
        self._call("write", path, self.inner.write, data)

    def read(self, path: str) -> bytes:
        return self._call("read", path, self.inner.read)  # type: ignore[no-any-return]

    def list(self, prefix: str) -> dict[str, int]:
        return self._call("list", prefix, self.inner.list)  # type: ignore[no-any-return]

    def delete(self, path: str) -> None:
        self._call("delete", path, self.inner.delete)

    def exists(self, path: str) -> bool:
        return self._call("reach", path, self.inner.exists)  # type: ignore[no-any-return]


def open_storage(url: str | os.PathLike[str] | Storage, **storage_options: Any) -> Storage:
    """Return an :class:`FsspecStorage` for a path or URL.

    A caller's :class:`Storage` is used as it is, except that a bare ``OSError`` it raises becomes
    a :class:`StorageError` that says what is wrong and how to fix it, as in :class:`FsspecStorage`.
    """
    if isinstance(url, (FsspecStorage, _Explained)):
        return url
    if isinstance(url, Storage) and not isinstance(url, (str, os.PathLike)):
        return _Explained(url)
    return FsspecStorage(os.fspath(url), **storage_options)
