"""The node-local tier's journals read back: a journal's header and entries, cut at the first
damaged frame (:func:`read_journal`); the records of its spool that pass their checksum
(:func:`verified_records`); whether its writer still runs, and the claim a resume takes before it
merges or removes one (:class:`JournalFile`); and the sweep of what dead processes left
(:func:`sweep`, :func:`sweep_dead`). The format and the writing side are in ``journal.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .checksums import XXH3_128
from .errors import DiffCkptError
from .format import CHECKSUMS, FORMAT_VERSION
from .journal import DIGEST, HEAD, MAGIC, remove_folder
from .segment import LEAD_READ, segment_lead
from .storage.nodelocal import lock, locked, open_private, private_folder, running, user_folder

__all__ = ["JournalFile", "journals", "read_journal", "stream_folders", "sweep", "sweep_dead", "sweep_dead_once",
           "verified_records"]

_READ = 8 << 20  # bytes hashed at a time when a record is checked


@dataclass
class JournalFile:
    """A journal read back: its header and its entries up to the first damaged frame.

    ``claimed``: this process holds the journal's lock (:meth:`claim`) and may merge or remove
    it; ``busy``: a claim found the lock held (a writer, or another process taking it)."""

    path: str
    url: str
    gen: int
    after: int
    spool: str
    host: str
    pid: int
    ident: dict[str, str] = field(default_factory=dict)
    session: str | None = None  # the id of the session file it continues (None: an older writer's)
    entries: list[dict[str, Any]] = field(default_factory=list)
    torn: bool = False  # whether a damaged or partial frame ended it early
    busy: bool = False
    _lock_fd: int | None = field(default=None, repr=False)

    @property
    def local(self) -> bool:
        """Whether it was written on this host (a ``local_dir`` may be shared)."""
        return self.host == socket.gethostname()

    @property
    def claimed(self) -> bool:
        return self._lock_fd is not None

    @property
    def in_use(self) -> bool:
        """Whether a writer still appends to it, or another process is taking it: its lock is
        held (where the file system has no locks: its writer, of the same boot and start time,
        still runs on this host)."""
        if self.claimed:
            return False
        if self.busy:
            return True
        held = locked(self.path)
        if held is not None:
            return held
        return self.local and running(self.pid, self.ident)

    @property
    def spool_ours(self) -> bool:
        """Whether the spool is where diffckpt puts spools, so a removal may delete it: beside the
        journal, or a temporary file in the ``diffs/`` folder of the stream's local run root. A
        spool elsewhere (a caller's storage made it) is never deleted by a resume."""
        spool = os.path.realpath(self.spool)
        if os.path.dirname(spool) == os.path.dirname(os.path.realpath(self.path)):
            return True
        url = self.url[len("file://"):] if self.url.startswith("file://") else self.url
        name = os.path.basename(spool)
        return ("://" not in url and name.startswith(".") and name.endswith(".tmp")
                and os.path.dirname(spool) == os.path.realpath(os.path.join(url, "diffs")))

    def remove(self, spool: bool = True) -> None:
        """Delete the journal (and its spool, which nothing commits any more, where it is ours),
        then let its lock go."""
        paths = [self.path] + ([self.spool] if spool and self.spool_ours else [])
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.release()

    def release(self) -> None:
        """Let go of a claim (:func:`read_journal` with ``claim``)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _frames(data: bytes) -> Iterator[dict[str, Any] | None]:
    """The frames of ``data`` in order; ``None`` once one is cut short or fails its check."""
    pos = 0
    while pos < len(data):
        if pos + HEAD.size > len(data):
            yield None
            return
        magic, length = HEAD.unpack_from(data, pos)
        body = data[pos + HEAD.size: pos + HEAD.size + length]
        digest = data[pos + HEAD.size + length: pos + HEAD.size + length + DIGEST]
        if magic != MAGIC or len(body) < length or XXH3_128.digest(body) != digest:
            yield None
            return
        try:
            frame = json.loads(body)
        except ValueError:
            yield None
            return
        yield frame if isinstance(frame, dict) else None
        pos += HEAD.size + length + DIGEST


def read_journal(path: str, claim: bool = False) -> JournalFile | None:
    """The journal at ``path``, its entries cut at the first damaged frame; ``None`` if even its
    header is unreadable, or it is not a regular file of this user. ``claim``: take its lock
    first (kept until :meth:`JournalFile.release` or :meth:`JournalFile.remove`), and read it
    under the lock; a journal whose lock is held is read all the same, marked ``busy``."""
    try:
        fd = open_private(path)
    except OSError:
        return None
    keep = False
    try:
        got = lock(fd) if claim else None
        with open(fd, "rb", closefd=False) as f:
            data = f.read()
        frames = _frames(data)
        header = next(frames, None)
        if header is None:
            return None
        try:
            ident: dict[str, str] = {k: str(header[k]) for k in ("boot", "start") if k in header}
            journal = JournalFile(path, str(header["url"]), int(header["gen"]), int(header["after"]),
                                  str(header["spool"]), str(header["host"]), int(header["pid"]), ident,
                                  str(header["session"]) if "session" in header else None)
        except (TypeError, KeyError, ValueError):
            return None
        for frame in frames:
            if frame is None or not _is_entry(frame):
                journal.torn = True
                break
            journal.entries.append(frame)
        if claim:
            # no locks here: the writer's identity decides (a live writer's journal is not taken)
            journal.busy = got is False or (got is None and journal.local and running(journal.pid, ident))
            if not journal.busy:
                journal._lock_fd, keep = fd, True
        return journal
    finally:
        if not keep:
            os.close(fd)


def _is_entry(frame: dict[str, Any]) -> bool:
    return all(isinstance(frame.get(k), int) and not isinstance(frame.get(k), bool) and frame[k] >= 0
               for k in ("step", "offset", "length", "raw_length")) and isinstance(frame.get("restorable"), bool)


def journals(folder: str, url: str, claim: bool = False) -> list[JournalFile]:
    """The readable journals in ``folder`` of the stream at ``url``, oldest session first
    (``claim``: each one's lock taken where free, see :func:`read_journal`)."""
    try:
        names = sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        journal = read_journal(os.path.join(folder, name), claim) if name.endswith(".journal") else None
        if journal is not None and journal.url != url:
            journal.release()
        elif journal is not None:
            found.append(journal)
    return sorted(found, key=lambda j: (j.gen, j.after))


def verified_records(journal: JournalFile) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The spool's lead (``{}`` if unreadable) and the journal's entries whose bytes in the spool
    match their checksum, cut at the first that does not: a torn tail, a record overwritten when
    the segment was cut, a missing spool."""
    algorithm = CHECKSUMS[FORMAT_VERSION]
    good: list[dict[str, Any]] = []
    try:
        fd = open_private(journal.spool, owner=False)  # a regular file, no link followed
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


def sweep(folder: str, apply: bool = True) -> list[str]:
    """Remove what dead processes left in a stream's journal folder that no journal can use:
    journals killed before their header was written, spools no journal names; return their
    paths (``apply=False``: only say what would go). Anything still locked by its writer stays,
    and so does anything that is not a regular file of this user."""
    try:
        names = sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    named, dead = set(), []
    for name in names:
        path = os.path.join(folder, name)
        if name.endswith(".journal"):
            journal = read_journal(path)
            if journal is not None:
                named.add(os.path.basename(journal.spool))
            elif locked(path) is False:
                dead.append(path)
    dead += [os.path.join(folder, n) for n in names
             if n.endswith(".tmp") and n not in named and locked(os.path.join(folder, n)) is False]
    if apply:
        for path in dead:
            with contextlib.suppress(OSError):
                os.unlink(path)
    return dead


def stream_folders(local_dir: str) -> list[str]:
    """Every stream's journal folder of this user in ``local_dir`` (checked to be this user's)."""
    top = user_folder(local_dir)
    try:
        names = sorted(os.listdir(top))
    except (FileNotFoundError, NotADirectoryError):
        return []
    private_folder(top, create=False)
    return [os.path.join(top, n) for n in names if len(n) == 16 and all(c in "0123456789abcdef" for c in n)]


def sweep_dead(local_dir: str, apply: bool = True) -> list[str]:
    """:func:`sweep` every stream's folder of this user in ``local_dir`` and remove those left
    empty: what is provably dead, whatever run it was of (journals a resume could still take back
    stay); return what went (``apply=False``: what would go)."""
    dead = []
    for folder in stream_folders(local_dir):
        dead += sweep(folder, apply)
        if apply:
            remove_folder(folder)
    return dead


_SWEPT: set[str] = set()  # the local folders this process swept already


def sweep_dead_once(local_dir: str) -> None:
    """:func:`sweep_dead` the first time a session of this process journals to ``local_dir``: a
    new session removes what is provably dead. A failure to look is no reason to stop training."""
    if local_dir in _SWEPT:
        return
    _SWEPT.add(local_dir)
    with contextlib.suppress(OSError, DiffCkptError):
        sweep_dead(local_dir)
