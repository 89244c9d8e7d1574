"""The node-local tier: a journal of each open segment's records, that outlives the process.

The background writer appends every record, as soon as it is encoded, to the open segment's spool
(``openseg.py``), a local file. A process killed with ``kill -9`` (or by the OOM killer, a NCCL
abort, an unhandled exception) leaves that file's pages in the page cache, but the spool alone
cannot be trusted: its index is written only when the segment is cut. The journal is the missing
half: beside each spool, a small file of framed entries (step, whether restorable, offset, length
and XXH3-128 of the record's bytes), one appended after each record, without ``fsync`` (it must
outlive a process, not the node). A resume on the same node reads it back
(``journalfile.py``), cuts it at the first frame or record that fails its check, and commits
what continues the run root's newest durable chain (``localtier.py``).

Where it lives: ``<local_dir>/diffckpt-<uid>/<key>/``, in the user's own folder (mode 0700,
checked on every use: ``storage/nodelocal.py``), ``key`` a hash of the stream's URL (a rank of
sharded training has a stream, hence a journal, of its own). On object stores the spools live
there too; on a local run root they stay beside the segment they become (a rename commits them)
and the journal names them.

A writer holds an ``flock`` on its journal while it appends: a journal is in use exactly while
its lock is held (a dead writer's lock is gone, whatever its pid now names), and a resume takes
the lock before it merges or removes one, so two processes never take the same journal.

Frame: ``b"DJ"`` | u32 length | JSON | XXH3-128 of the JSON (16 bytes). The first frame is the
header (``url``, ``gen``, ``after``, ``spool``, ``host``, ``pid``, the ``session`` file's id, and
the writer's ``boot`` id and process ``start`` time where the system tells them); each next one an
entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import struct
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any

from .checksums import XXH3_128
from .errors import StorageError
from .storage.nodelocal import (
    free_bytes,
    identity,
    local_path,
    lock,
    memory_backed,
    open_private,
    private_folder,
    user_folder,
)

__all__ = [
    "DIGEST",
    "HEAD",
    "LOCAL_DIR_ENV",
    "MAGIC",
    "JournalPlace",
    "JournalWriter",
    "default_local_dir",
    "journal_folder",
    "make_folder",
    "place_for",
    "remove_folder",
    "resolve_local_dir",
    "tier_budget",
]

MAGIC = b"DJ"
HEAD = struct.Struct("<2sI")  # a frame: magic and length, then the JSON and its XXH3-128
DIGEST = XXH3_128.digest_size
_FORMAT = 1


@dataclass(frozen=True)
class JournalPlace:
    """Where the journals of one stream go: ``folder`` (:func:`journal_folder`), the stream's
    ``url`` their headers name, and the ``session`` id of the session file they continue (a run
    root made anew at the same URL has sessions of the same numbers, not of the same ids).
    ``memory``: whether the folder is held in memory and the run root is not (the spools then go
    there whatever the run root, so that records are written at memory speed)."""

    folder: str
    url: str
    session: str | None = None
    memory: bool = False


LOCAL_DIR_ENV = "DIFFCKPT_LOCAL_DIR"
"""The environment variable that chooses the folder of ``local_dir="auto"`` (a job's or a
cluster's choice, e.g. a local NVMe disk, without a code change)."""

SHARED_MEMORY = "/dev/shm"
MIN_SHARED_MEMORY = 1 << 30  # free bytes below which "auto" does not take shared memory


def default_local_dir() -> str:
    """Where ``local_dir="auto"`` keeps journals and spools: ``$DIFFCKPT_LOCAL_DIR`` if set; else
    shared memory when it is held in memory, writable and has ``MIN_SHARED_MEMORY`` free (a
    container's default 64 MiB does not); else the system temporary folder (``TMPDIR``)."""
    chosen = os.environ.get(LOCAL_DIR_ENV)
    if chosen:
        return chosen
    shm = SHARED_MEMORY
    if (os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) and memory_backed(shm)
            and free_bytes(shm) >= MIN_SHARED_MEMORY):
        return shm
    return tempfile.gettempdir()


def resolve_local_dir(local_dir: str) -> str:
    """The folder ``CheckpointOptions.local_dir`` names (``"auto"``: :func:`default_local_dir`)."""
    return default_local_dir() if local_dir == "auto" else local_dir


def place_for(local_dir: str | None, url: str, session: str | None = None) -> JournalPlace | None:
    """Where the journals of the stream at ``url`` go with ``CheckpointOptions.local_dir``
    (``None``: no journal); ``session``: the id of the writing session's file."""
    if local_dir is None:
        return None
    folder, root = resolve_local_dir(local_dir), local_path(url)
    # A run root held in memory takes the spools itself, committed by a rename: in the tier's
    # folder, each record would be written twice, there and by the commit's copy.
    memory = memory_backed(folder) and not (root is not None and memory_backed(root))
    return JournalPlace(journal_folder(folder, url), url, session, memory)


def tier_budget(local_dir: str | None, given: int | None) -> int:
    """``CheckpointOptions.local_max_bytes``: ``given``, else half the free space of the folder the
    spools go to (the node-local tier's, or the temporary folder without one), at least 1 MiB."""
    if given is not None:
        return given
    folder = resolve_local_dir(local_dir) if local_dir is not None else tempfile.gettempdir()
    return max(1 << 20, free_bytes(folder) // 2)


def journal_folder(local_dir: str, url: str) -> str:
    """The folder of the journals of the stream at ``url`` (a run root, or a rank's stream)."""
    key = hashlib.sha256(url.encode()).hexdigest()[:16]
    return os.path.join(user_folder(local_dir), key)


def make_folder(folder: str) -> None:
    """Create ``folder`` and the user's folder it sits in, both this user's only (checked).

    Raises:
        StorageError: either cannot be made, or is not this user's private folder.
    """
    base = os.path.dirname(os.path.dirname(folder))
    try:
        os.makedirs(base, exist_ok=True)  # a local_dir of the user's own may not exist yet
    except OSError as exc:
        raise StorageError(f"cannot create the folder {base}: {exc}") from exc
    private_folder(os.path.dirname(folder))
    private_folder(folder)


def remove_folder(folder: str) -> None:
    """Remove a stream's journal folder once it is empty (when a session ends or a resume took
    its journals), so that the temporary folder does not fill with empty folders."""
    with contextlib.suppress(OSError):  # not empty, or gone
        os.rmdir(folder)


def _frame(body: dict[str, Any]) -> bytes:
    data = json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
    return HEAD.pack(MAGIC, len(data)) + data + XXH3_128.digest(data)


class JournalWriter:
    """The journal of one open segment (session ``gen``, after step ``after``) whose records are
    appended to the spool file ``spool``; locked while it is open.

    Raises:
        StorageError: the journal cannot be created (an unwritable or full folder, or one that
            is not this user's).
    """

    def __init__(self, folder: str, url: str, gen: int, after: int, spool: str, session: str | None = None) -> None:
        self.path = os.path.join(folder, f"g{gen:06d}-{os.getpid()}-{uuid.uuid4().hex[:8]}.journal")
        header = {"journal": _FORMAT, "url": url, "gen": gen, "after": after, "spool": os.path.abspath(spool),
                  "host": socket.gethostname(), "pid": os.getpid(), **identity(),
                  **({"session": session} if session else {})}
        self._fd: int | None = None
        try:
            make_folder(folder)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND
            try:
                self._fd = open_private(self.path, flags)
            except FileNotFoundError:  # another session of the stream just removed the empty folder
                make_folder(folder)
                self._fd = open_private(self.path, flags)
            lock(self._fd)  # held while this journal is written: it is in use exactly as long
            self._write(_frame(header))
        except (OSError, StorageError) as exc:
            self._drop()
            raise StorageError(f"cannot write the local journal {self.path}: {exc}") from exc
        self.last: int | None = None  # the newest step journaled

    def _write(self, data: bytes) -> None:
        """Append ``data`` whole: a short write goes on from where it stopped; one that writes
        nothing (a full disk) raises, and the torn frame it leaves ends the journal for a reader."""
        assert self._fd is not None
        view = memoryview(data)
        while view.nbytes:
            written = os.write(self._fd, view)
            if written <= 0:
                raise OSError(28, "no space left on device (a write wrote nothing)", self.path)
            view = view[written:]

    def add(self, entry: dict[str, Any], offset: int, restorable: bool) -> None:
        """Journal a record appended to the spool at ``offset`` (``entry``: its segment index
        entry: step, lengths, checksum).

        Raises:
            StorageError: the entry could not be appended whole (the journal then ends before it).
        """
        try:
            self._write(_frame({**entry, "offset": offset, "restorable": restorable}))
        except OSError as exc:
            raise StorageError(f"cannot append to the local journal {self.path}: {exc}") from exc
        self.last = entry["step"]

    def close(self) -> None:
        """Close the file and keep it (for a resume on this node to merge); its lock goes."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def discard(self) -> None:
        """Close the file and remove it: the run root has its records, or they were dropped."""
        self._drop()

    def _drop(self) -> None:
        opened = self._fd is not None
        self.close()
        if opened:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
