"""Temporary spool files kept open for the next spool in their folder to write over.

A spool's file in ``/dev/shm`` or the temporary folder is written once per segment; writing into
the pages of a file that has them costs a third of writing a new one (:data:`KEEP_FREE`), and a
copy into their mapping less still (``spoolmap.py``). So :class:`~diffckpt.storage.spool.Spool`
hands its file here when it is discarded (:func:`keep`) and the next spool in the folder takes it
(:func:`take`), with its mapping.

A segment's spool is discarded only once its commit ends, and in ``durability="paced"`` a
segment the run root is too slow for waits in the tier until a base supersedes it, so the next
segments would mostly start new files. Where cores are spare (``spoolmap.SPARE_CORES``), each
spool opened in a folder therefore has a helper thread allocate (``posix_fallocate``) and map a
new file of the largest size a spool reached there (:func:`fill`), beside training: the next
spool takes it, and its records are copies into pages that are there. A full file system stops
that quietly (the spools then write their own pages, and fail as writes do).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import uuid
from typing import Any

from . import spoolmap
from .nodelocal import free_bytes, lock, open_private
from .spoolmap import MAP_MIN, FileMap
from .spoolwrite import helpers

__all__ = ["KEEP_FREE", "fill", "keep", "release_free_spools", "seen", "take"]

KEEP_FREE = 2
"""Discarded temporary spools a process keeps per folder for its next ones to write into.

A spool in ``/dev/shm`` or the temporary folder is a new file for each segment, and a new file's
pages are allocated and zeroed by the kernel as it is written: on the 2-core VM, 91 MB written
into a new ``/dev/shm`` file took 68 ms of CPU, into the pages of an existing one 24 ms. The
node-local tier writes every record so, so a discarded spool (its segment committed or dropped)
is renamed and kept, open and locked, and the next spool in that folder takes it over and writes
over its pages. Two, because a segment's spool is discarded when its commit ends, usually after
the next segment's spool was opened; only while the folder's file system keeps four times the
spool's size free (:func:`keep`), and removed when its writer ends (:func:`release_free_spools`),
at the process's exit, or by the next sweep once the process is gone (a ``.tmp`` no journal names)."""

_free: dict[str, list[tuple[str, Any, int, FileMap | None]]] = {}  # folder -> (path, open file, pid, mapping)
_free_lock = threading.Lock()
_exit_hooked = False
_largest: dict[str, int] = {}  # folder -> the largest size a spool of this process reached there
_filling: dict[str, int] = {}  # folder -> fills running
_released: dict[str, int] = {}  # folder -> releases so far: a fill that ends after one drops its file


def seen(folder: str, size: int) -> None:
    """A spool in ``folder`` holds ``size`` bytes (the size :func:`fill` allocates)."""
    with _free_lock:
        if size > _largest.get(folder, 0):
            _largest[folder] = size


def fill(folder: str) -> None:
    """Have a helper thread allocate and map a file for the next spool in ``folder``, of the
    largest size a spool reached there, unless :data:`KEEP_FREE` files are kept or on their way,
    no spool there reached :data:`~diffckpt.storage.spoolmap.MAP_MIN`, or no core is spare."""
    if not (spoolmap.SPARE_CORES and spoolmap.MAPPABLE):
        return
    with _free_lock:
        size = _largest.get(folder, 0)
        if size < MAP_MIN or len(_free.get(folder, [])) + _filling.get(folder, 0) >= KEEP_FREE:
            return
        _filling[folder] = _filling.get(folder, 0) + 1
        released = _released.get(folder, 0)
    helpers().submit(_fill, folder, size, released)


def _hold(folder: str, path: str, file: Any, mapped: FileMap | None) -> None:
    """Keep ``file`` (renamed ``path``) for the next spool in ``folder``; ``_free_lock`` is held."""
    global _exit_hooked
    _free.setdefault(folder, []).append((path, file, os.getpid(), mapped))
    if not _exit_hooked:
        atexit.register(release_free_spools)
        _exit_hooked = True


def _fill(folder: str, size: int, released: int) -> None:
    path = os.path.join(folder, f"{os.getpid()}-{uuid.uuid4().hex[:8]}-free.tmp")
    file: Any = None
    mapped: FileMap | None = None
    try:
        if free_bytes(folder) < 4 * size:  # room that others need (as keep() leaves)
            return
        fd = open_private(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        file = open(fd, "r+b", buffering=0)
        lock(fd)  # held while kept: a sweep tells it from a dead process's
        os.posix_fallocate(fd, 0, size)
        mapped = FileMap(fd)
        mapped.map_all()
        with _free_lock:
            if _released.get(folder, 0) == released and len(_free.get(folder, [])) < KEEP_FREE:
                _hold(folder, path, file, mapped)
                file = None
    except (OSError, ValueError):  # a full file system, a folder gone: the spools write their own pages
        pass
    finally:
        if file is not None:
            _drop(path, file, mapped)
        elif mapped is None:  # never opened
            with contextlib.suppress(OSError):
                os.unlink(path)
        with _free_lock:
            _filling[folder] -= 1


def keep(path: str, file: Any, mapped: FileMap | None) -> bool:
    """Keep a discarded temporary spool's open ``file`` (and its mapping) for the next spool in its
    folder, renamed as a spool no journal names; ``False`` where it is not kept (the caller removes it)."""
    folder = os.path.dirname(path)
    try:
        size = os.fstat(file.fileno()).st_size
        if size == 0 or free_bytes(folder) < 4 * size:  # nothing to reuse, or room that others need
            return False
        with _free_lock:
            kept = _free.setdefault(folder, [])
            if len(kept) >= KEEP_FREE:
                return False
            free = os.path.join(folder, f"{os.getpid()}-{uuid.uuid4().hex[:8]}-free.tmp")
            os.rename(path, free)
            _hold(folder, free, file, mapped)
        return True
    except OSError:
        return False


def take(folder: str, path: str) -> tuple[Any, FileMap | None] | None:
    """A kept spool's open file (and its mapping) of this process in ``folder``, renamed to ``path``, or ``None``."""
    with _free_lock:
        kept = _free.get(folder, [])
        while kept:
            free, file, pid, mapped = kept.pop()
            if pid != os.getpid():  # a forked child's copy of its parent's: the parent's file,
                _close(file, mapped)  # whose lock this copy must not keep alive
                continue
            try:
                os.rename(free, path)
            except OSError:
                _drop(free, file, mapped)
                continue
            return file, mapped
    return None


def _close(file: Any, mapped: FileMap | None) -> None:
    with contextlib.suppress(OSError, BufferError):
        if mapped is not None:
            mapped.close()
        file.close()


def _drop(path: str, file: Any, mapped: FileMap | None) -> None:
    _close(file, mapped)
    with contextlib.suppress(OSError):
        os.unlink(path)


def release_free_spools(folder: str | None = None) -> None:
    """Remove the discarded spools this process keeps for reuse (:data:`KEEP_FREE`) in
    ``folder``, or in every folder: a writer that ends returns their memory."""
    with _free_lock:
        for where in {folder} if folder is not None else set(_free) | set(_filling):
            _released[where] = _released.get(where, 0) + 1
            for free, file, pid, mapped in _free.pop(where, []):
                if pid == os.getpid():
                    _drop(free, file, mapped)
                else:  # a forked child's copy: the parent's file stays
                    _close(file, mapped)
