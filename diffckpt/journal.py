"""The node-local tier: a journal of each open segment's records, that outlives the process.

The background writer appends every record, as soon as it is encoded, to the open segment's spool
(``openseg.py``), a local file. A process killed with ``kill -9`` (or by the OOM killer, a NCCL
abort, an unhandled exception) leaves that file's pages in the page cache, but the spool alone
cannot be trusted: its index is written only when the segment is cut. The journal is the missing
half: beside each spool, a small file of framed entries (step, whether restorable, offset, length
and XXH3-128 of the record's bytes), one appended after each record, without ``fsync`` (it must
outlive a process, not the node). A resume on the same node reads it back
(:func:`read_journal`), cuts it at the first frame or record that fails its check, and commits
what continues the run root's newest durable chain (``localtier.py``).

Where it lives: ``<local_dir>/diffckpt-journal/<key>/``, ``key`` a hash of the stream's URL (a
rank of sharded training has a stream, hence a journal, of its own). On object stores the spools
live there too; on a local run root they stay beside the segment they become (a rename commits
them) and the journal names them.

Frame: ``b"DJ"`` | u32 length | JSON | XXH3-128 of the JSON (16 bytes). The first frame is the
header (``url``, ``gen``, ``after``, ``spool``, ``host``, ``pid``); each next one an entry.
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
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .checksums import XXH3_128
from .errors import DiffCkptError, StorageError
from .format import CHECKSUMS, FORMAT_VERSION
from .segment import LEAD_READ, segment_lead
from .storage.spool import process_alive

__all__ = [
    "JOURNAL_FOLDER",
    "JournalFile",
    "JournalPlace",
    "JournalWriter",
    "default_local_dir",
    "journal_folder",
    "journals",
    "place_for",
    "read_journal",
    "remove_folder",
    "sweep",
    "verified_records",
]

JOURNAL_FOLDER = "diffckpt-journal"
_MAGIC = b"DJ"
_HEAD = struct.Struct("<2sI")
_DIGEST = XXH3_128.digest_size
_FORMAT = 1
_READ = 8 << 20  # bytes hashed at a time when a record is checked
_OPEN: set[str] = set()  # the journals this process is writing (a resume here must not take them)


@dataclass(frozen=True)
class JournalPlace:
    """Where the journals of one stream go: ``folder`` (:func:`journal_folder`), and the stream's
    ``url`` their headers name."""

    folder: str
    url: str


def default_local_dir() -> str:
    """Where ``local_dir="auto"`` keeps journals: the system temporary folder (``TMPDIR``)."""
    return tempfile.gettempdir()


def place_for(local_dir: str | None, url: str) -> JournalPlace | None:
    """Where the journals of the stream at ``url`` go with ``CheckpointOptions.local_dir``
    (``None``: no journal)."""
    if local_dir is None:
        return None
    return JournalPlace(journal_folder(default_local_dir() if local_dir == "auto" else local_dir, url), url)


def journal_folder(local_dir: str, url: str) -> str:
    """The folder of the journals of the stream at ``url`` (a run root, or a rank's stream)."""
    key = hashlib.sha256(url.encode()).hexdigest()[:16]
    return os.path.join(local_dir, JOURNAL_FOLDER, key)


def make_folder(folder: str) -> None:
    """Create ``folder``: the shared ``diffckpt-journal`` folder open to every user like the
    temporary folder it sits in (sticky), each stream's folder its owner's only."""
    shared = os.path.dirname(folder)
    if not os.path.isdir(shared):
        with contextlib.suppress(FileExistsError):
            os.makedirs(os.path.dirname(shared), exist_ok=True)
            os.mkdir(shared, 0o700)
            os.chmod(shared, 0o1777)
    os.makedirs(folder, mode=0o700, exist_ok=True)


def sweep(folder: str) -> None:
    """Remove what dead processes of this host left in a stream's journal folder that no journal
    can use: journals killed before their header was written, spools without a journal."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return
    named = set()
    for name in names:
        if name.endswith(".journal"):
            journal = read_journal(os.path.join(folder, name))
            if journal is not None:
                named.add(os.path.basename(journal.spool))
            elif not process_alive(_pid(name.split("-", 2)[1:2])):  # g<gen>-<pid>-<hex>.journal
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, name))
    for name in names:
        if name.endswith(".tmp") and name not in named and not process_alive(_pid(name.split("-", 1)[:1])):
            with contextlib.suppress(OSError):  # <pid>-<hex>-<name>.tmp
                os.unlink(os.path.join(folder, name))


def _pid(parts: list[str]) -> int:
    # a name not of ours counts as the live process's: nothing is removed
    return int(parts[0]) if parts and parts[0].isdigit() else os.getpid()


def remove_folder(folder: str) -> None:
    """Remove a stream's journal folder once it is empty (when a session ends or a resume took
    its journals), so that the temporary folder does not fill with empty folders."""
    with contextlib.suppress(OSError):  # not empty, or gone
        os.rmdir(folder)


def _frame(body: dict[str, Any]) -> bytes:
    data = json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
    return _HEAD.pack(_MAGIC, len(data)) + data + XXH3_128.digest(data)


class JournalWriter:
    """The journal of one open segment (session ``gen``, after step ``after``) whose records are
    appended to the spool file ``spool``."""

    def __init__(self, folder: str, url: str, gen: int, after: int, spool: str) -> None:
        self.path = os.path.join(folder, f"g{gen:06d}-{os.getpid()}-{uuid.uuid4().hex[:8]}.journal")
        header = {"journal": _FORMAT, "url": url, "gen": gen, "after": after, "spool": os.path.abspath(spool),
                  "host": socket.gethostname(), "pid": os.getpid()}
        try:
            make_folder(folder)
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
            except FileNotFoundError:  # another session of the stream just removed the empty folder
                make_folder(folder)
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
            self._file = open(fd, "wb", buffering=0)
            self._file.write(_frame(header))
            _OPEN.add(self.path)
        except OSError as exc:
            raise StorageError(f"cannot write the local journal {self.path}: {exc} (set "
                               "CheckpointOptions(local_dir=...) to a folder with space, or None to go without)"
                               ) from exc
        self.last: int | None = None  # the newest step journaled

    def add(self, entry: dict[str, Any], offset: int, restorable: bool) -> None:
        """Journal a record appended to the spool at ``offset`` (``entry``: its segment index
        entry: step, lengths, checksum)."""
        try:
            self._file.write(_frame({**entry, "offset": offset, "restorable": restorable}))
        except OSError as exc:
            raise StorageError(f"cannot append to the local journal {self.path}: {exc}") from exc
        self.last = entry["step"]

    def close(self) -> None:
        """Close the file and keep it (for a resume on this node to merge)."""
        self._file.close()
        _OPEN.discard(self.path)

    def discard(self) -> None:
        """Close the file and remove it: the run root has its records, or they were dropped."""
        self._file.close()
        _OPEN.discard(self.path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


@dataclass
class JournalFile:
    """A journal read back: its header and its entries up to the first damaged frame."""

    path: str
    url: str
    gen: int
    after: int
    spool: str
    host: str
    pid: int
    entries: list[dict[str, Any]] = field(default_factory=list)
    torn: bool = False  # whether a damaged or partial frame ended it early

    @property
    def local(self) -> bool:
        """Whether it was written on this host (a ``local_dir`` may be shared)."""
        return self.host == socket.gethostname()

    @property
    def in_use(self) -> bool:
        """Whether a writer still appends to it: a process of this host that still runs, or a
        session of this process."""
        if self.pid == os.getpid():
            return self.path in _OPEN
        return self.local and process_alive(self.pid)

    def remove(self, spool: bool = True) -> None:
        """Delete the journal (and its spool, which nothing commits any more)."""
        for path in (self.path, self.spool) if spool else (self.path,):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _frames(data: bytes) -> Iterator[dict[str, Any] | None]:
    """The frames of ``data`` in order; ``None`` once one is cut short or fails its check."""
    pos = 0
    while pos < len(data):
        if pos + _HEAD.size > len(data):
            yield None
            return
        magic, length = _HEAD.unpack_from(data, pos)
        body = data[pos + _HEAD.size: pos + _HEAD.size + length]
        digest = data[pos + _HEAD.size + length: pos + _HEAD.size + length + _DIGEST]
        if magic != _MAGIC or len(body) < length or XXH3_128.digest(body) != digest:
            yield None
            return
        try:
            frame = json.loads(body)
        except ValueError:
            yield None
            return
        yield frame if isinstance(frame, dict) else None
        pos += _HEAD.size + length + _DIGEST


def read_journal(path: str) -> JournalFile | None:
    """The journal at ``path``, its entries cut at the first damaged frame; ``None`` if even its
    header is unreadable."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    frames = _frames(data)
    header = next(frames, None)
    if header is None:
        return None
    try:
        journal = JournalFile(path, str(header["url"]), int(header["gen"]), int(header["after"]),
                              str(header["spool"]), str(header["host"]), int(header["pid"]))
    except (TypeError, KeyError, ValueError):
        return None
    for frame in frames:
        if frame is None or not _is_entry(frame):
            journal.torn = True
            break
        journal.entries.append(frame)
    return journal


def _is_entry(frame: dict[str, Any]) -> bool:
    return all(isinstance(frame.get(k), int) and not isinstance(frame.get(k), bool) and frame[k] >= 0
               for k in ("step", "offset", "length", "raw_length")) and isinstance(frame.get("restorable"), bool)


def journals(folder: str, url: str) -> list[JournalFile]:
    """The readable journals in ``folder`` of the stream at ``url``, oldest session first."""
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return []
    found = [read_journal(os.path.join(folder, n)) for n in names if n.endswith(".journal")]
    return sorted((j for j in found if j is not None and j.url == url), key=lambda j: (j.gen, j.after))


def verified_records(journal: JournalFile) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The spool's lead (``{}`` if unreadable) and the journal's entries whose bytes in the spool
    match their checksum, cut at the first that does not: a torn tail, a record overwritten when
    the segment was cut, a missing spool."""
    algorithm = CHECKSUMS[FORMAT_VERSION]
    good: list[dict[str, Any]] = []
    try:
        fd = os.open(journal.spool, os.O_RDONLY)
    except OSError:
        return {}, good
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, LEAD_READ, 0)
        try:
            lead = segment_lead(head, journal.spool)
        except DiffCkptError:
            return {}, good
        for entry in journal.entries:
            start, length = entry["offset"], entry["length"]
            if start + length > size or not isinstance(entry.get(algorithm.key), str):
                break
            hasher = algorithm.new()
            for pos in range(start, start + length, _READ):
                hasher.update(os.pread(fd, min(_READ, start + length - pos), pos))
            if hasher.hexdigest() != entry[algorithm.key]:
                break
            good.append(entry)
        return lead, good
    finally:
        os.close(fd)
