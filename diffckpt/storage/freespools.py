"""Discarded temporary spools kept open for the next spool in their folder to write over.

A spool's file in ``/dev/shm`` or the temporary folder is written once per segment; writing into
the pages of a file that has them costs a third of writing a new one (:data:`KEEP_FREE`). So
:class:`~diffckpt.storage.spool.Spool` hands its file here when it is discarded (:func:`keep`) and
the next spool in the folder takes it (:func:`take`), with its mapping (``spoolmap.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import uuid
from typing import Any

from .nodelocal import free_bytes
from .spoolmap import FileMap

__all__ = ["KEEP_FREE", "keep", "release_free_spools", "take"]

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


def keep(path: str, file: Any, mapped: FileMap | None) -> bool:
    """Keep a discarded temporary spool's open ``file`` (and its mapping) for the next spool in its
    folder, renamed as a spool no journal names; ``False`` where it is not kept (the caller removes it)."""
    global _exit_hooked
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
            kept.append((free, file, os.getpid(), mapped))
            if not _exit_hooked:
                atexit.register(release_free_spools)
                _exit_hooked = True
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
        for where in [folder] if folder is not None else list(_free):
            for free, file, pid, mapped in _free.pop(where, []):
                if pid == os.getpid():
                    _drop(free, file, mapped)
                else:  # a forked child's copy: the parent's file stays
                    _close(file, mapped)
