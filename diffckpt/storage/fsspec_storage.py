"""The :class:`~diffckpt.storage.Storage` of diffckpt: any fsspec file system (local disk,
S3, GCS, Azure, ...), with atomic whole-object writes on each.

It also implements :class:`~diffckpt.storage.InspectableStorage` (modification times, hidden
temporary files, incomplete multipart uploads), which garbage collection uses.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import uuid
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFile
from fsspec.spec import AbstractBufferedFile

from ..errors import CheckpointNotFoundError, StorageError, UnsupportedConfigurationError
from .localread import read_file_into
from .localwrite import write_file
from .protocol import Buffer, Data, as_bytes, data_size
from .retry import is_transient
from .spool import Spool, temporary_spool

__all__ = ["FsspecStorage", "explain"]

T = TypeVar("T")


def explain(exc: BaseException, action: str, where: str) -> StorageError:
    """A :class:`StorageError` for ``exc`` that says what is wrong and how to fix it."""
    code = getattr(exc, "errno", None)
    remote = "://" in where and not where.startswith(("file://", "local://"))
    if remote and isinstance(exc, FileNotFoundError):
        hint = "the bucket or container does not exist: create it or fix dirpath"
    elif remote and isinstance(exc, PermissionError):
        hint = ("access denied: check the credentials (storage_options or the usual environment "
                "variables and config files of the backend) and the permissions on the bucket")
    elif remote and is_transient(exc):
        hint = "the endpoint is unreachable or failing: check the endpoint URL, the network and the service"
    elif code == errno.ENOSPC:
        hint = "the disk is full: free space or point dirpath at a larger volume"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "permission denied or read-only file system: make it writable or choose another dirpath"
    elif code in (errno.ENOTDIR, errno.EEXIST):
        hint = "a part of the path is a file, not a directory: point dirpath at a directory"
    else:
        hint = "check that the location exists, is reachable and that credentials allow it"
    return StorageError(f"cannot {action} {where}: {exc} ({hint})")


def _precondition_failed(exc: BaseException | None) -> bool:
    while exc is not None:
        response = getattr(exc, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code") == "PreconditionFailed":
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _fsync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mtime(info: dict[str, Any]) -> float | None:
    """Modification time from a listing entry, whatever the backend calls it."""
    for key in ("mtime", "LastModified", "Initiated", "last_modified", "created"):
        value = info.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return None


class FsspecStorage:
    """:class:`Storage` and :class:`InspectableStorage` over any fsspec file system.

    Local disk commits with a temporary file in the same directory, ``fsync``, ``os.replace`` and
    an ``fsync`` of the directory. Object stores have no rename: a single PUT is atomic, and so is
    a multipart upload, whose object appears only when the upload completes. Objects larger than
    ``multipart_threshold`` are streamed in ``part_size`` parts rather than joined into a second
    copy in memory.

    :meth:`spool` gives the file to append an object's bytes to before writing it: on local disk
    it is that temporary file already (committing renames it), elsewhere one in the system
    temporary folder (committing uploads it, a part at a time). Ranges of objects are read with
    :meth:`read_range` (``ranged`` is true).

    Args:
        url: local path or fsspec URL of the run root.
        part_size: bytes per part of a streamed (multipart) upload; S3 needs at least 5 MiB.
        multipart_threshold: objects at least this large are streamed.
        **storage_options: passed to fsspec (credentials, endpoint, ...).
    """

    ranged = True
    """:meth:`read_range` reads only the bytes asked for, on every fsspec file system."""

    def __init__(self, url: str, *, part_size: int = 32 << 20, multipart_threshold: int = 64 << 20,
                 **storage_options: Any) -> None:
        self.url = str(url)
        try:
            self.fs, root = fsspec.core.url_to_fs(self.url, **storage_options)
        except ImportError as exc:  # the file system's own package (s3fs, gcsfs, adlfs...) is missing
            extra = " (pip install 'diffckpt[s3]')" if self.url.startswith(("s3://", "s3a://")) else ""
            raise UnsupportedConfigurationError(f"cannot open {self.url}: {exc}{extra}") from exc
        self.root = root.rstrip("/") if root not in ("/", "") else root
        self.local = isinstance(self.fs, LocalFileSystem)
        self.part_size = part_size
        self.multipart_threshold = multipart_threshold

    def _full(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def spool(self, hint: str, folder: str | None = None) -> Spool:
        """A spool for an object to be written at a path like ``hint``. On local disk it is a
        hidden ``.tmp`` file in the target's directory, so that :meth:`write` commits it with a
        rename, and a writer killed before that leaves a temporary file that garbage collection
        recognises. Elsewhere it is in ``folder`` (a journal's), else in the system temporary
        folder (:func:`temporary_spool`)."""
        if not self.local:
            return temporary_spool(hint, folder)
        full = self._full(hint)
        directory = os.path.dirname(full)
        try:
            os.makedirs(directory, exist_ok=True)
            return Spool(os.path.join(directory, f".{os.path.basename(full)}.{uuid.uuid4().hex[:8]}.tmp"))
        except Exception as exc:
            raise explain(exc, "write", f"{self.url}/{hint}") from exc

    def write(self, path: str, data: Data) -> None:
        self._guarded("write", path, lambda: self._write(self._full(path), data))

    def _write(self, full: str, data: Data) -> None:
        if isinstance(data, Spool):
            self._write_spool(full, data)
            return
        parts = [data] if isinstance(data, (bytes, memoryview)) else data
        if self.local:
            self._write_local(full, parts)
        elif data_size(parts) >= self.multipart_threshold:
            self._stream(full, parts)
        else:
            self.fs.pipe_file(full, as_bytes(parts))

    def _guarded(self, action: str, path: str, fn: Callable[[], T]) -> T:
        """``fn()``, its failures turned into a :class:`StorageError` that explains them, and a
        missing object that is read into :class:`CheckpointNotFoundError`."""
        try:
            return fn()
        except StorageError:
            raise
        except Exception as exc:  # fsspec backends raise many types
            if action == "read" and isinstance(exc, FileNotFoundError):
                raise CheckpointNotFoundError(f"{self.url}/{path} does not exist") from None
            raise explain(exc, action, f"{self.url}/{path}") from exc

    def _write_spool(self, full: str, spool: Spool) -> None:
        if self.local:
            self._commit_local(full, spool)
        elif spool.size >= self.multipart_threshold:
            self._stream(full, spool.chunks(self.part_size))  # one part in memory at a time
        else:
            self.fs.pipe_file(full, as_bytes(spool))

    def _commit_local(self, full: str, spool: Spool) -> None:
        """Rename the spool's file to ``full``, with the durability of :meth:`_write_local`; copy
        it where a rename cannot do (another device, a temporary-folder spool, a file gone)."""
        if spool.temporary:  # owner-only: a copy gets the permissions of every other object
            self._write_local(full, spool)
            return
        directory = os.path.dirname(full)
        os.makedirs(directory, exist_ok=True)
        spool.sync()
        try:
            os.replace(spool.path, full)
        except OSError as exc:
            # EXDEV: the spool is on another file system. ENOENT: its name is gone (an earlier
            # attempt renamed it and failed after, or gc removed it): its open file still reads.
            if exc.errno not in (errno.EXDEV, errno.ENOENT):
                raise
            self._write_local(full, spool)
            return
        _fsync_directory(directory)

    def create(self, path: str, data: bytes) -> bool:
        full = self._full(path)
        try:
            if self.local:
                return self._write_local(full, [data], exclusive=True)
            try:
                self.fs.pipe_file(full, data, mode="create")  # S3: If-None-Match: *
            except (TypeError, NotImplementedError):  # a backend without conditional writes
                if self.fs.exists(full):
                    return False
                self.fs.pipe_file(full, data)
            return True
        except FileExistsError:
            return False
        except StorageError:
            raise
        except Exception as exc:
            if _precondition_failed(exc):  # S3-compatibles that omit the failed condition
                return False
            raise explain(exc, "create", f"{self.url}/{path}") from exc

    @staticmethod
    def _write_local(full: str, parts: Iterable[Buffer] | Spool, exclusive: bool = False) -> bool:
        directory = os.path.dirname(full)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(full)}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                write_file(fd, parts)  # buffers, never joined; a spool, copied by the kernel
                os.fsync(fd)
            finally:
                os.close(fd)
            if exclusive:
                try:
                    os.link(tmp, full)  # atomic, and fails if the name exists
                except FileExistsError:
                    return False
                finally:
                    os.unlink(tmp)
            else:
                os.replace(tmp, full)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        _fsync_directory(directory)
        return True

    def _stream(self, full: str, parts: Iterable[Buffer]) -> None:
        """Upload in parts of ``part_size``; on failure abort, so that no partial object appears."""
        fh = self.fs.open(full, "wb", block_size=self.part_size)
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                for start in range(0, len(view), self.part_size):
                    fh.write(view[start:start + self.part_size])
            fh.close()  # uploads the last part and completes the upload: the commit
        except BaseException:
            if isinstance(fh, AbstractBufferedFile):  # other files commit only on close
                fh.closed = True  # closing (also from __del__) would commit what was written so far
                with contextlib.suppress(Exception):
                    fh.discard()  # S3: abort the multipart upload (else a lifecycle rule must)
            elif isinstance(fh, MemoryFile):  # memory:// commits a file when it is opened
                with contextlib.suppress(Exception):
                    self.fs.rm_file(full)
            raise

    def read(self, path: str) -> bytes:
        return self._guarded("read", path, lambda: bytes(self.fs.cat_file(self._full(path))))

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object at ``path`` (fewer if it ends before ``end``);
        raise :class:`CheckpointNotFoundError` if it is absent."""
        if start < 0 or end < start:
            raise ValueError(f"invalid byte range [{start}, {end}) of {path}")
        return self._guarded("read", path, lambda: self._cat_range(self._full(path), start, end))

    def read_into(self, path: str, start: int, out: memoryview) -> int:
        """Read bytes ``[start, start + len(out))`` of the object at ``path`` into ``out``; return
        how many were read (fewer if it ends first). A local file is read straight into ``out``;
        elsewhere the range is fetched and copied in."""
        if start < 0:
            raise ValueError(f"invalid byte offset {start} of {path}")
        if self.local:
            return self._guarded("read", path, lambda: read_file_into(self._full(path), start, out))
        data = self.read_range(path, start, start + out.nbytes)
        out[: len(data)] = data
        return len(data)

    def _cat_range(self, full: str, start: int, end: int) -> bytes:
        if end == start:  # S3 answers an empty range with the whole object
            self._size(full)  # an absent object is still an error
            return b""
        try:
            return bytes(self.fs.cat_file(full, start=start, end=end))
        except OSError as exc:
            # S3 refuses (416, EINVAL) a range that starts at the end or past it, where a file
            # gives no bytes: give none too, unless that is not why
            if exc.errno != errno.EINVAL or self._size(full) > start:
                raise
            return b""

    def _size(self, full: str) -> int:
        self.fs.invalidate_cache(full)
        return int(self.fs.info(full).get("size") or 0)

    def list(self, prefix: str) -> dict[str, int]:
        return {rel: size for rel, (size, _) in self.details(prefix).items()
                if not rel.rsplit("/", 1)[-1].startswith(".")}

    def details(self, prefix: str, hidden: bool = False) -> dict[str, tuple[int, float | None]]:
        """``{relative path: (size, modification time or None)}`` under ``prefix``; with
        ``hidden``, also the dot-files that :meth:`list` leaves out (local temporary files)."""
        base = self._full(prefix)
        try:
            self.fs.invalidate_cache(base)  # listings cached by s3fs & co. miss other writers' objects
            if not self.fs.exists(base):
                return {}
            found = self.fs.find(base, detail=True)
        except Exception as exc:
            raise explain(exc, "list", f"{self.url}/{prefix}") from exc
        cut = len(self.root.rstrip("/")) + 1 if self.root not in ("", "/") else len(self.root)
        out: dict[str, tuple[int, float | None]] = {}
        for full, info in found.items():
            rel = full[cut:].lstrip("/") if self.root else full
            if info.get("type", "file") == "file" and (hidden or not rel.rsplit("/", 1)[-1].startswith(".")):
                out[rel] = (int(info.get("size") or 0), _mtime(info))
        return out

    def stat(self, path: str) -> tuple[int, float | None]:
        """``(size, modification time or None)`` of the object at ``path``, without reading it."""
        full = self._full(path)
        try:
            self.fs.invalidate_cache(full)
            info = self.fs.info(full)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.url}/{path} does not exist") from None
        except Exception as exc:
            raise explain(exc, "reach", f"{self.url}/{path}") from exc
        if info.get("type", "file") != "file":  # a directory (or prefix) is not an object
            raise CheckpointNotFoundError(f"{self.url}/{path} is not an object")
        return int(info.get("size") or 0), _mtime(info)

    def incomplete_uploads(self) -> builtins.list[tuple[str, str, float | None]]:
        """``(relative key, upload id, initiated time)`` of every multipart upload under the root
        that was started and never completed nor aborted (S3 only; others have none)."""
        if not hasattr(self.fs, "abort_mpu"):
            return []
        bucket, key = self.root.split("/", 1) if "/" in self.root else (self.root, "")
        prefix = key.rstrip("/") + "/" if key else ""
        out: list[tuple[str, str, float | None]] = []
        marker: dict[str, str] = {}
        try:
            while True:
                page = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **marker)
                for upload in page.get("Uploads") or []:
                    out.append((upload["Key"][len(prefix):], upload["UploadId"], _mtime(upload)))
                if not page.get("IsTruncated"):
                    return out
                marker = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}
        except Exception as exc:
            raise explain(exc, "list the uploads of", self.url) from exc

    def abort_upload(self, path: str, upload_id: str) -> None:
        """Abort an incomplete multipart upload: its parts stop taking (billed) space."""
        bucket = self.root.split("/", 1)[0]
        try:
            self.fs.abort_mpu(bucket, self._full(path)[len(bucket) + 1:], upload_id)
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise explain(exc, "abort the upload of", f"{self.url}/{path}") from exc

    def delete(self, path: str) -> None:
        try:
            self.fs.rm_file(self._full(path))
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise explain(exc, "delete", f"{self.url}/{path}") from exc

    def exists(self, path: str) -> bool:
        try:
            self.fs.invalidate_cache(self._full(path))
            return bool(self.fs.exists(self._full(path)))
        except Exception as exc:
            raise explain(exc, "reach", f"{self.url}/{path}") from exc
