"""The segment the background writer is filling: each record encoded when it arrives and appended
to a local spool, so that a record's memory (its gradients, leased from training) is let go as
soon as its bytes are written, whatever ``write_batch`` and the model size.

The segment commits as one object when the writer cuts it (``write_batch`` records, a flush, a
base): :meth:`OpenSegment.finish` ends it with the format-3 index and the writer hands the spool
to :meth:`Storage.write` (a rename on local disk, an upload from the file on object stores), so
what is durable, and when, does not change. Records after the newest restorable one move to the
next open segment.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from .checksums import Buffer
from .errors import StorageError
from .format import SegmentName
from .journal import JournalPlace, JournalWriter, make_folder
from .leases import Lease
from .segment import SegmentEncoder
from .storage import Storage
from .storage.spool import Spool, open_spool, temporary_spool
from .storage.spoolwrite import helpers

log = logging.getLogger("diffckpt")

__all__ = ["OpenSegment"]

_COPY = 8 << 20  # bytes moved at a time when records move on to the next segment
_BESIDE = 1 << 20  # records this large are hashed beside their write; a thread's handoff costs more below


class OpenSegment:
    """Records of session ``gen`` after step ``after``, appended to a spool as they arrive.

    ``lost``: called with the error once the node-local tier fails here (its folder unwritable
    or full): the segment goes on without a journal, and the writer turns the tier off."""

    def __init__(self, storage: Storage, gen: int, after: int, compression: str, level: int,
                 decided: str | None = None, journal: JournalPlace | None = None,
                 lost: Callable[[BaseException], None] | None = None) -> None:
        self.storage = storage
        self.place = journal
        self.lost = lost
        self.gen = gen
        self.after = after
        self.compression = compression
        self.level = level
        self.encoder = SegmentEncoder({"gen": gen, "after": after}, compression, level, decided,
                                      write_rate=self._write_rate)
        # The node-local tier: each record's place and checksum, so that a resume on this node
        # after a crash takes the records back from the spool (journal.py).
        self.journal: JournalWriter | None = None
        self.journaling = False  # whether each record is journaled (not once the tier failed)
        self.steps: list[tuple[int, bool]] = []  # (step, restorable) of each record, in order
        self.ends: list[int] = []  # the spool's size after each record
        self.encode_s = 0.0
        # The name the segment will have is known only at its cut; the hint places the spool.
        self.spool: Spool = self._open_spool(SegmentName(after, after, gen).path.replace(".seg", ".open"))
        if self.place is not None:
            try:
                self.journal = JournalWriter(self.place.folder, self.place.url, gen, after, self.spool.path,
                                             self.place.session)
                self.journaling = True
            except StorageError as exc:
                self._tier_lost(exc)
            except BaseException:
                self.spool.discard()
                raise

    def _open_spool(self, hint: str) -> Spool:
        """The spool: in the journal's folder where the storage has no place of its own (object
        stores); where that folder fails, the storage's usual place (the tier is then off); where
        no folder can take it, memory, so that a full temporary folder does not stop training."""
        if self.place is not None:
            try:
                make_folder(self.place.folder)
                if self.place.memory:  # at memory speed, whatever the run root; its commit is a copy
                    return temporary_spool(hint, self.place.folder)
                return open_spool(self.storage, hint, self.place.folder)
            except StorageError as exc:
                self._tier_lost(exc)
        try:
            return open_spool(self.storage, hint)
        except StorageError as exc:
            log.warning("diffckpt: %s; the open segment's records are kept in memory until it is written "
                        "(at most write_batch records). Free space there, or set TMPDIR to a folder with room",
                        exc)
            return Spool.in_memory(os.path.basename(hint))

    def _to_memory(self, exc: BaseException) -> None:
        """The folder of a spool of diffckpt's own filled up: what the segment holds so far moves to
        memory, where it stays until it is written (at most ``write_batch`` records); its journal,
        which names the file, goes, and the tier is off."""
        log.warning("diffckpt: %s; the open segment's records are kept in memory until it is written "
                    "(at most write_batch records)", exc)
        memory = Spool.in_memory(os.path.basename(self.spool.path))
        for chunk in self.spool.chunks():
            memory.append([chunk])
        self.spool.discard()
        self.spool = memory
        if self.journal is not None:
            self.journal.discard()
            self.journal = None
        if self.journaling:
            self._tier_lost(exc)

    def _tier_lost(self, exc: BaseException) -> None:
        self.place, self.journaling = None, False
        if self.lost is not None:
            self.lost(exc)

    def __len__(self) -> int:
        return len(self.steps)

    def _write_rate(self) -> float | None:
        """What zstd would save time for (``segment.zstd_shortens``): the spool's file system, for
        every spool. Each record's path ends there, on the writer thread, with training waiting for
        the record before it: compression must not slow it. The upload or copy after it (an object
        store, a local root fed from a tier in memory) is paced by ``durability``, off that path;
        ``compression="zstd"`` asks for smaller uploads whatever it costs there."""
        return self.spool.write_rate()

    def add(self, record: dict[str, Any], journal: bool = True) -> None:
        """Encode ``record`` and append its bytes; nothing of it is kept in memory. A large record
        is hashed on a helper thread while its bytes are written (both release the GIL).
        ``journal=False``: not journaled yet (:meth:`journal_last` next)."""
        start = time.monotonic()
        blob = self.encoder.encode(record)
        self.encode_s += time.monotonic() - start
        checksum = helpers().submit(self.encoder.checksum, blob) if blob.length >= _BESIDE else None
        try:
            self._append(blob.parts)
        finally:  # the hash reads the record's memory: it ends before the record may go
            digest = checksum.result() if checksum is not None else None
        self.encoder.added(blob, digest or self.encoder.checksum(blob))
        self.steps.append((record["step"], record.get("state") is not None))
        self.ends.append(self.spool.size)
        if journal:
            self._journal(-1)

    def journal_last(self, leases: list[Lease], stop: threading.Event) -> None:
        """Journal the record added last with ``journal=False`` once every one of ``leases`` (on
        the gradients it was read from) ended cleanly; if one did not, the gradients changed while
        it was read: take it back and raise :class:`GradientMutatedError`."""
        try:
            for lease in leases:
                lease.wait(stop)
        except BaseException:
            entry = self.encoder.entries.pop()
            self.encoder.raw_bytes -= entry["raw_length"]
            self.encoder.stored_bytes -= entry["length"]
            del self.steps[-1], self.ends[-1]
            self.spool.truncate(self.ends[-1] if self.ends else len(self.encoder.lead or b""))
            raise
        self._journal(-1)

    def _append(self, parts: list[Buffer]) -> None:
        try:
            self.spool.append(parts)
        except StorageError as exc:  # a full disk
            if not self.spool.temporary or self.spool.anonymous:  # the run root's own disk: no way on
                raise
            self._to_memory(exc)
            self.spool.append(parts)

    def _journal(self, i: int) -> None:
        if self.journal is not None and self.journaling:  # after the bytes: a journaled record is in the spool
            entry = self.encoder.entries[i]
            try:
                self.journal.add(entry, self.ends[i] - entry["length"], self.steps[i][1])
            except StorageError as exc:  # what it journaled before still serves a resume after a crash
                self._tier_lost(exc)

    def cut(self) -> int:
        """How many records a segment cut now takes: up to the newest restorable one."""
        return max((i + 1 for i, (_, restorable) in enumerate(self.steps) if restorable), default=0)

    def finish(self, cut: int) -> tuple[SegmentName, OpenSegment | None]:
        """End the segment after its first ``cut`` records (its index appended to the spool) and
        return its name and the open segment of the records after them (``None`` if none)."""
        name = SegmentName(self.after, self.steps[cut - 1][0], self.gen)
        rest = self.move_on(cut, name.last) if cut < len(self.steps) else None
        self.spool.append([self.encoder.tail(self.encoder.entries[:cut], last=name.last)])
        return name, rest

    def move_on(self, cut: int, after: int) -> OpenSegment:
        """The records from ``cut`` on as the next open segment (after step ``after``): their
        encoded bytes copied to its spool, cut from this one's."""
        rest = OpenSegment(self.storage, self.gen, after, self.compression, self.level,
                           decided=self.encoder.compression, journal=self.place, lost=self.lost)
        rest.spool.append([rest.encoder.start()])
        begin = self.ends[cut - 1] if cut else len(self.encoder.lead or b"")
        for offset in range(begin, self.spool.size, _COPY):
            rest.spool.append([self.spool.read_at(offset, min(_COPY, self.spool.size - offset))])
        shift = rest.spool.size - self.spool.size
        rest.encoder.entries = self.encoder.entries[cut:]
        rest.steps = self.steps[cut:]
        rest.ends = [end + shift for end in self.ends[cut:]]
        for i in range(len(rest.steps)):
            rest._journal(i)
        self.spool.truncate(begin)
        del self.encoder.entries[cut:], self.steps[cut:], self.ends[cut:]
        return rest

    def drop_through(self, step: int) -> OpenSegment | None:
        """What stays open once the records up to ``step`` are superseded (by a base at that
        step): ``None`` when every record goes, the spool removed."""
        gone = sum(1 for s, _ in self.steps if s <= step)
        if not gone:
            return self
        if gone == len(self.steps):
            self.discard()
            return None
        rest = self.move_on(gone, step)
        self.discard()
        return rest

    def discard(self) -> None:
        """Remove the spool and its journal (nothing of it was committed, or a commit consumed it)."""
        self.spool.discard()
        if self.journal is not None:
            self.journal.discard()

    def keep(self) -> None:
        """Close the spool and keep it with its journal, for a resume on this node (its commit
        failed or was given up); without a journal nothing could use it, so it goes."""
        if self.journal is None:
            self.spool.discard()
            return
        self.spool.close()
        self.journal.close()
