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

import time
from typing import Any

from .format import SegmentName
from .journal import JournalPlace, JournalWriter
from .segment import SegmentEncoder
from .storage import Storage
from .storage.spool import Spool, open_spool

__all__ = ["OpenSegment"]

_COPY = 8 << 20  # bytes moved at a time when records move on to the next segment


class OpenSegment:
    """Records of session ``gen`` after step ``after``, appended to a spool as they arrive."""

    def __init__(self, storage: Storage, gen: int, after: int, compression: str, level: int,
                 decided: str | None = None, journal: JournalPlace | None = None) -> None:
        self.storage = storage
        self.place = journal
        self.gen = gen
        self.after = after
        self.compression = compression
        self.level = level
        self.encoder = SegmentEncoder({"gen": gen, "after": after}, compression, level, decided)
        # The name the segment will have is known only at its cut; the hint places the spool.
        self.spool: Spool = open_spool(storage, SegmentName(after, after, gen).path.replace(".seg", ".open"),
                                       journal.folder if journal is not None else None)
        # The node-local tier: each record's place and checksum, so that a resume on this node
        # after a crash takes the records back from the spool (journal.py).
        self.journal: JournalWriter | None = None
        if journal is not None:
            try:
                self.journal = JournalWriter(journal.folder, journal.url, gen, after, self.spool.path)
            except BaseException:
                self.spool.discard()
                raise
        self.steps: list[tuple[int, bool]] = []  # (step, restorable) of each record, in order
        self.ends: list[int] = []  # the spool's size after each record
        self.encode_s = 0.0

    def __len__(self) -> int:
        return len(self.steps)

    def add(self, record: dict[str, Any]) -> None:
        """Encode ``record`` and append its bytes; nothing of it is kept in memory."""
        start = time.monotonic()
        parts = self.encoder.add(record)
        self.encode_s += time.monotonic() - start
        self.spool.append(parts)
        self.steps.append((record["step"], record.get("state") is not None))
        self.ends.append(self.spool.size)
        self._journal(-1)

    def _journal(self, i: int) -> None:
        if self.journal is not None:  # after the bytes: a journaled record is in the spool
            entry = self.encoder.entries[i]
            self.journal.add(entry, self.ends[i] - entry["length"], self.steps[i][1])

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
                           decided=self.encoder.compression, journal=self.place)
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
