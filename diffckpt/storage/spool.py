"""Spools: local files an object's bytes are appended to before the object is written to storage.

The background writer encodes each step's record as it arrives and appends it to the open
segment's spool, so the record's memory is freed at once; at commit the whole spool is written to
storage under its final name, atomically. A storage that can do better than copying the file
offers ``spool(hint)`` (a local :class:`~diffckpt.storage.FsspecStorage` puts the spool beside
the target, and committing is a rename); otherwise :func:`open_spool` puts it in the system
temporary folder.

Reading by byte range is the other half: :func:`read_range` reads part of an object where the
storage can (``storage.read_range``) and slices a whole read where it cannot; :func:`ranged` tells
a reader which of the two it gets, so that it can read whole objects instead of many ranges.
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import os
import re
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

from ..errors import StorageError
from .freespools import KEEP_FREE, fill, keep, release_free_spools, seen, take
from .nodelocal import lock, locked, open_private, private_folder, user_folder
from .spoolmap import AHEAD, MAP_MIN, MAPPABLE, FileMap
from .spoolwrite import Buffer, target_of, views_of, write_at

__all__ = ["KEEP_FREE", "SPOOL_FOLDER", "Spool", "open_spool", "ranged", "read_into", "read_range", "release_free_spools",
           "remove_dead_spools", "spool_folder", "temporary_spool"]

SPOOL_FOLDER = "spool"
"""The folder, in this user's folder of the system temporary folder (``diffckpt-<uid>``,
:mod:`~diffckpt.storage.nodelocal`), of the spools of storages that have no place of their own for
them (object stores, a caller's storage without ``spool``)."""


def spool_folder() -> str:
    """Where :func:`temporary_spool` puts spools: ``<TMPDIR>/diffckpt-<uid>/spool``."""
    return os.path.join(user_folder(tempfile.gettempdir()), SPOOL_FOLDER)


PROBE = 1 << 20
"""Bytes :meth:`Spool.write_rate` writes (and cuts off again) to measure a file system that
nothing was appended to yet: small enough to cost well under a millisecond, large enough that the
call itself does not dominate (a small write measures a little faster than a large one, which errs
towards writing without compression)."""


class Spool:
    """A local file an object's bytes are appended to before the object is written to storage.

    ``Spool(path)`` creates the file (it must not exist). Buffers are written to it directly, never
    joined, and read back chunk by chunk with ``pread``, so neither appending nor committing holds
    the object in memory. The file stays readable through the spool until :meth:`discard`, even
    after a local commit renamed it to the object's name.

    Attributes:
        path: the local file.
        size: bytes appended so far.
        temporary: whether the file is in a folder of diffckpt's own (:func:`temporary_spool`,
            or in memory): it is then readable by its owner only, and a local storage copies it
            instead of renaming it, so that the object gets the permissions of any other object.
        anonymous: whether it is a file in memory with no name (:meth:`in_memory`).
    """

    def __init__(self, path: str, *, temporary: bool = False, _fd: int | None = None) -> None:
        self.path = path
        self.size = 0
        self.temporary = temporary
        self.anonymous = _fd is not None
        self._file: Any = None
        self._map: FileMap | None = None  # the file's pages mapped, once an append went that way
        if _fd is None:
            # Exclusive create, no link followed: two writers never share a spool, and nothing
            # planted at the name is written through. Temporary spools are owner-only.
            fd = open_private(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600 if temporary else 0o666)
            # Held while the spool is open: a sweep tells a spool still written from a dead one's.
            lock(fd)
        else:
            fd = _fd
        self._file = open(fd, "r+b", buffering=0)  # open as long as the spool is
        self._target = target_of(fd)  # what its file system was measured to take

    @classmethod
    def in_memory(cls, name: str) -> Spool:
        """A spool in memory (``memfd_create``): where no folder can take one, a segment's bytes
        stay in RAM (at most ``write_batch`` records) rather than stopping training.

        Raises:
            StorageError: this platform has no anonymous files.
        """
        make = getattr(os, "memfd_create", None)
        if make is None:
            raise StorageError("no folder could take a spool and this platform has no files in memory")
        try:
            fd = make(f"diffckpt-{name}"[:200], getattr(os, "MFD_CLOEXEC", 0))
        except OSError as exc:
            raise StorageError(f"no folder could take a spool, nor memory: {exc}") from exc
        return cls(f"<memory:{name}>", temporary=True, _fd=fd)

    def append(self, parts: Sequence[Buffer]) -> int:
        """Write ``parts`` in order after what was appended before; return the offset where they
        start. If writing fails, the spool is as it was before (the partial write is cut off).

        A large append may go out from several threads at once (``spoolwrite.py``: where its file
        system measured faster that way), or, into the pages a kept spool's file has, be copied
        into its mapping (``spoolmap.py``); each append's time is measured for :meth:`write_rate`."""
        start = self.size
        views = views_of(parts)
        size = sum(v.nbytes for v in views)
        if self._map is None and size >= MAP_MIN and MAPPABLE and self.temporary and not self.anonymous:
            self._map = FileMap(self._file.fileno())
        mapped = self._map is not None and size >= MAP_MIN and self._map.covers(start, size)
        workers = 1 if mapped else self._target.workers(size)
        began = time.perf_counter()
        if mapped and self._copy_in(views, start):
            workers = 0  # neither way of writing: a copy into the mapping
        else:
            try:
                self.size += write_at(self._file.fileno(), views, start, workers)
            except OSError as exc:
                # Later offsets must stay those of `size`: drop whatever part of the buffers went out.
                with contextlib.suppress(OSError):
                    self.truncate(start)
                raise _failed("append to", self, exc) from exc
            if self._map is not None:
                self._map.grown(self.size)
        self._target.note(size, time.perf_counter() - began, workers)
        if self._map is not None and size >= MAP_MIN:  # the pages of the next ones, beside training
            self._map.reserve(self.size + AHEAD * size)
            seen(os.path.dirname(self.path), self.size)  # what the next spools are allocated ahead for
        return start

    def _copy_in(self, views: list[memoryview], start: int) -> bool:
        """Copy ``views`` into the mapping at ``start``; ``False`` where no mapping could be made
        (address space, a limit): the caller writes them instead, over what was copied."""
        assert self._map is not None
        try:
            self.size += self._map.write(views, start)
            return True
        except OSError:
            self._map.close()
            self._map = None
            return False

    def write_rate(self) -> float | None:
        """Bytes per second appends to this spool's file system took in this process; where none
        was made yet, measured on :data:`PROBE` bytes appended and cut off again. ``None`` if that
        fails (a full disk, which the next append reports)."""
        rate = self._target.rate()
        if rate is None:
            start = self.size
            try:
                self.append([bytes(PROBE)])
            except StorageError:
                return None
            self.truncate(start)
            rate = self._target.rate()
        return rate

    def read_at(self, offset: int, size: int) -> bytes:
        """The ``size`` bytes appended at ``offset`` (``pread``: appending is not disturbed)."""
        if offset < 0 or size < 0 or offset + size > self.size:
            raise ValueError(f"bytes [{offset}, {offset + size}) are not in {self!r}")
        fd = self._file.fileno()
        pieces: list[bytes] = []
        got = 0
        while got < size:  # pread may return fewer bytes than asked
            piece = os.pread(fd, size - got, offset + got)
            if not piece:  # someone truncated the file: what it held is lost
                raise StorageError(f"the spool file {self.path} ends at byte {offset + got}, not at {self.size}")
            pieces.append(piece)
            got += len(piece)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def truncate(self, size: int) -> None:
        """Keep only the first ``size`` bytes; the next append starts there."""
        if not 0 <= size <= self.size:
            raise ValueError(f"cannot truncate {self!r} to {size} bytes")
        if self._map is not None:
            self._map.settle()  # no pages allocated and mapped past the cut while it is made
        os.ftruncate(self._file.fileno(), size)  # appends write at `size`, not at the file's position
        self.size = size
        if self._map is not None:
            self._map.cut(size)

    def chunks(self, size: int = 8 << 20, from_offset: int = 0) -> Iterator[bytes]:
        """The content from ``from_offset`` on, in order, ``size`` bytes at a time (the last
        chunk may be shorter)."""
        if size <= 0:
            raise ValueError(f"chunk size must be positive, not {size}")
        for pos in range(from_offset, self.size, size):
            yield self.read_at(pos, min(size, self.size - pos))

    def fileno(self) -> int:
        """The spool's open file (for a copy in the kernel: ``storage/localwrite.py``); its first
        :attr:`size` bytes are the content."""
        return int(self._file.fileno())

    def __iter__(self) -> Iterator[bytes]:
        """:meth:`chunks`: a storage that only knows lists of buffers can write a spool too."""
        return self.chunks()

    def sync(self) -> None:
        """Make what was appended durable (``fsync``), before the file is renamed to an object."""
        if self._map is not None:
            self._map.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        """Close the file and keep it: a journal names it, for a resume on this node."""
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._file is not None:
            self._file.close()

    def discard(self) -> None:
        """Close the file and remove it; again, or after a commit renamed it, it does nothing. A
        temporary spool's file may be kept instead, for the next spool in its folder to write
        into (:data:`KEEP_FREE`): this object lets go of it either way."""
        if self._file is None:  # handed to a later spool already
            return
        if self.temporary and not self.anonymous and not self._file.closed and keep(self.path, self._file, self._map):
            self._file = self._map = None
            return
        if self._map is not None:
            self._map.close()
            self._map = None
        self._file.close()
        if not self.anonymous:  # a file in memory goes with its close
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is not None:  # the object will not be written: its bytes are garbage
            self.discard()

    def __repr__(self) -> str:
        return f"Spool({self.path!r}, size={self.size})"


def _failed(action: str, spool: Spool | str, exc: OSError) -> StorageError:
    """A :class:`StorageError` for a spool file, saying where it is (a full temporary folder is
    not where a user looks first)."""
    path = spool.path if isinstance(spool, Spool) else spool
    hint = ""
    if exc.errno == errno.ENOSPC:
        hint = (" (the disk is full: free space; a spool in the temporary folder holds one open "
                "segment, and TMPDIR chooses the folder)")
    return StorageError(f"cannot {action} the spool file {path}: {exc}{hint}")


def temporary_spool(hint: str, folder: str | None = None) -> Spool:
    """A spool in this user's spool folder of the system temporary folder (:func:`spool_folder`),
    for an object that will be written at a path like ``hint``.

    Before it is created, the spools there that no process holds any more are removed, so that
    what a ``kill -9`` leaves behind does not add up. ``folder``: a journal's folder instead
    (``journal.py``, already this user's and private), whose spools outlive their process until a
    resume merges them or garbage collection removes them.
    """
    shared = folder is None
    folder = spool_folder() if folder is None else folder
    name = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(hint.rstrip("/")))[-120:]
    path = os.path.join(folder, f"{os.getpid()}-{uuid.uuid4().hex[:8]}-{name}.tmp")
    try:
        if shared:
            private_folder(os.path.dirname(folder))
            private_folder(folder)
            remove_dead_spools(folder)
        else:
            private_folder(folder)
        kept = take(folder, path)
        fill(folder)  # a file for the spool after this one, beside training
        if kept is None:
            return Spool(path, temporary=True)
        spool = Spool.__new__(Spool)
        spool.path, spool.size, spool.temporary, spool.anonymous = path, 0, True, False
        spool._file, spool._target, spool._map = kept[0], target_of(kept[0].fileno()), kept[1]
        return spool
    except StorageError as exc:
        raise StorageError(f"cannot create the spool file {path}: {exc}") from exc
    except OSError as exc:
        raise _failed("create", path, exc) from exc


def remove_dead_spools(folder: str) -> None:
    """Remove the spools in ``folder`` that no process holds open (their writer ended: a spool
    is locked for as long as it is open)."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return
    for name in names:
        path = os.path.join(folder, name)
        if name.endswith(".tmp") and locked(path) is False:
            with contextlib.suppress(OSError):  # gone already
                os.unlink(path)


def open_spool(storage: Any, hint: str, folder: str | None = None) -> Spool:
    """A spool for an object that will be written at a path like ``hint`` (e.g.
    ``"diffs/000000000012-open.g000001.seg"``): ``storage.spool(hint)`` where the storage has
    that method, otherwise a spool in the system temporary folder (:func:`temporary_spool`).
    ``folder``: where a spool that is not beside its object goes instead of the temporary folder
    (a journal's folder). A storage's ``spool`` is called as documented, ``spool(hint)``; only one
    that takes a ``folder`` too (diffckpt's own) is told it."""
    make = getattr(storage, "spool", None)
    if not callable(make):
        return temporary_spool(hint, folder)
    return make(hint, folder=folder) if folder is not None and _takes_folder(make) else make(hint)


def _takes_folder(method: Any) -> bool:
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):  # a builtin or C method: call it as documented
        return False
    return "folder" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def read_range(storage: Any, path: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of the object at ``path``: ``storage.read_range`` where the storage
    has it, else a whole read, sliced. Raises :class:`~diffckpt.CheckpointNotFoundError` if there
    is no object, as ``read`` does; an object shorter than ``end`` gives fewer bytes."""
    if start < 0 or end < start:
        raise ValueError(f"invalid byte range [{start}, {end}) of {path}")
    method = getattr(storage, "read_range", None)
    if callable(method):
        return bytes(method(path, start, end))
    return bytes(storage.read(path)[start:end])


def read_into(storage: Any, path: str, start: int, out: memoryview) -> int:
    """Read bytes ``[start, start + len(out))`` of the object at ``path`` into ``out`` (a writable
    byte view, e.g. of a tensor's memory) and return how many were read: fewer where the object
    ends first. ``storage.read_into`` where the storage has it (a local file is read straight into
    ``out``, with no copy through the process), else :func:`read_range`, copied in. Raises
    :class:`~diffckpt.CheckpointNotFoundError` if there is no object."""
    method = getattr(storage, "read_into", None)
    if callable(method):
        return int(method(path, start, out))
    data = read_range(storage, path, start, start + out.nbytes)
    out[: len(data)] = data
    return len(data)


def ranged(storage: Any) -> bool:
    """Whether ``storage`` reads byte ranges itself: a reader told ``False`` reads whole objects
    rather than several ranges of one (each of which would read the whole object)."""
    return bool(getattr(storage, "ranged", False))
