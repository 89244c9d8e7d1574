"""The run layout on storage: sessions, bases, segments, and verified reads of them.

Readers trust only committed objects: a base exists once its COMMIT marker does, a segment once
its single object does. A chain is a committed base followed by segments whose ``after`` equals
the previous ``last``; it ends at the first gap (:class:`~diffckpt.inventory.Inventory`
classifies a listing and finds the chains; :mod:`diffckpt.planning` chooses what to read).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from .errors import CheckpointNotFoundError, ConcurrentWriterError, CorruptRecordError
from .format import FORMAT_VERSION, BaseName, SegmentName, checksum_for, decode_commit
from .inventory import Inventory, RestorePlan
from .prefetch import Prefetcher, Preparer
from .recordreads import ReadStats, RecordReader
from .storage import Storage

if TYPE_CHECKING:
    from .basereads import BaseFile

__all__ = ["RUN_FILE", "RunStore", "loss_path", "session_path", "tuning_path"]

log = logging.getLogger("diffckpt")
RUN_FILE = "run.json"


def session_path(gen: int) -> str:
    """Where session ``gen`` records what it was started with."""
    return f"sessions/g{gen:06d}.json"


def tuning_path(gen: int) -> str:
    """Where session ``gen`` keeps the auto-tuner's decisions (rewritten on each change)."""
    return f"sessions/g{gen:06d}.tuning.json"


def loss_path(gen: int) -> str:
    """Where session ``gen`` states what each failure loses, as measured at its first record."""
    return f"sessions/g{gen:06d}.loss.json"


class RunStore:
    """Reads and writes the layout of one run root."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    # ----------------------------------------------------------------- listing
    def inventory(self, listing: dict[str, int] | None = None) -> Inventory:
        """Classify a listing of the run root (``listing``: one already taken, else list now)."""
        listing = self.storage.list("") if listing is None else listing
        sessions: dict[int, dict[str, Any]] = {}
        bases: list[BaseName] = []
        segments: list[SegmentName] = []
        for path in listing:
            if (seg := SegmentName.parse(path)) is not None:
                segments.append(seg)
            elif (base := BaseName.parse(path)) is not None:
                bases.append(base)
            elif path.startswith("sessions/g") and path.endswith(".json"):
                try:
                    sessions[int(path[len("sessions/g") : -len(".json")])] = {}
                except ValueError:
                    continue
        # Complete before the Inventory exists: its chains are cached from these lists.
        return Inventory(sessions, sorted(bases), sorted(segments), listing)

    def is_run(self) -> bool:
        return self.storage.exists(RUN_FILE)

    def session_meta(self, gen: int) -> dict[str, Any]:
        """What session ``gen`` recorded when it started (parameters, optimizers, options)."""
        path = session_path(gen)
        try:
            meta = json.loads(self.storage.read(path))
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(
                f"{self.storage.url}/{path} is missing; the session's steps cannot be checked "
                "against the model and optimizers. Restore a step of another session") from None
        except (ValueError, RecursionError):  # not JSON (or absurdly nested): damaged
            meta = None
        if not isinstance(meta, dict):
            raise CorruptRecordError(
                f"{self.storage.url}/{path} is damaged (not a JSON object); the session's steps "
                "cannot be checked against the model and optimizers. Restore a step of another session")
        return meta

    def start_session(self, meta: dict[str, Any], gen: int | None = None) -> int:
        """Register a new writer session and return its generation number.

        The session file is created atomically (exclusive create), so two jobs starting on the
        same run root at once get different generations and never write the same objects.
        ``gen``: the generation the run root's session took (a rank's stream of a sharded run
        takes its root's), which must still be free here.
        """
        run = {"format": "diffckpt", "version": FORMAT_VERSION, "updated": time.time()}
        self.storage.write(RUN_FILE, json.dumps(run, sort_keys=True).encode())
        if gen is not None:
            body = dict(meta, gen=gen, started=time.time())
            if not self.storage.create(session_path(gen), json.dumps(body, indent=1, sort_keys=True).encode()):
                raise ConcurrentWriterError(
                    f"{self.storage.url}/{session_path(gen)} exists already: another job is writing "
                    "this run. Stop it, or give each job its own dirpath")
            return gen
        gen = max(self.inventory().gens(), default=0) + 1
        while True:
            body = dict(meta, gen=gen, started=time.time())
            if self.storage.create(session_path(gen), json.dumps(body, indent=1, sort_keys=True).encode()):
                return gen
            log.warning("diffckpt: session g%d of %s was just started by another job; taking g%d",
                        gen, self.storage.url, gen + 1)
            gen += 1

    def loss_statement(self, gen: int) -> dict[str, Any] | None:
        """What session ``gen`` stated each failure loses (``None``: not stated, or unreadable)."""
        try:
            body = json.loads(self.storage.read(loss_path(gen)))
        except (CheckpointNotFoundError, ValueError, RecursionError):
            return None
        return body if isinstance(body, dict) and isinstance(body.get("text"), str) else None

    def tuning_log(self, gen: int) -> list[dict[str, Any]]:
        """The auto-tuner's decisions in session ``gen``, oldest first (empty without tuning)."""
        try:
            body = json.loads(self.storage.read(tuning_path(gen)))
        except (CheckpointNotFoundError, ValueError, RecursionError):
            return []
        decisions = body.get("decisions") if isinstance(body, dict) else None
        return decisions if isinstance(decisions, list) else []

    def newer_session(self, gen: int, storage: Storage | None = None) -> dict[str, Any] | None:
        """What the session after ``gen`` recorded, if one started (``None`` otherwise)."""
        storage = storage or self.storage
        try:  # one GET: cheaper on object stores than an existence check and then a read
            data = storage.read(session_path(gen + 1))
        except CheckpointNotFoundError:
            return None
        try:
            meta = json.loads(data)
        except (ValueError, RecursionError):
            meta = None
        return meta if isinstance(meta, dict) else {"gen": gen + 1}

    # ---------------------------------------------------------------- reading
    def open_base(self, base: BaseName) -> tuple[dict[str, Any], BaseFile]:
        """Return ``(commit info, state file)`` of a committed base: its COMMIT marker read and
        checked, and its state file's header (:class:`~diffckpt.basereads.BaseFile`), whose
        tensors are read, and verified with the hash algorithm of the marker's format version, by
        :meth:`~diffckpt.basereads.BaseFile.fill`."""
        from .basereads import BaseFile  # torch: `diffckpt ls` and `gc` read runs without it

        info = decode_commit(self.storage.read(base.commit_path), base.commit_path)
        if info.get("step") != base.step or info.get("gen") != base.gen:
            raise CorruptRecordError(f"{base.commit_path} describes step {info.get('step')} of session "
                                     f"{info.get('gen')}, not its own directory")
        expected = info["files"]["state.safetensors"]
        algorithm = checksum_for(info["format"], f"{base.commit_path}: COMMIT marker")
        return info, BaseFile(self.storage, base.state_path, expected["size"], algorithm, expected[algorithm.key])

    def load_base(self, base: BaseName) -> tuple[dict[str, Any], Any]:
        """Return ``(commit info, state tree)`` of a committed base, verified, its tensors new
        CPU tensors read straight from the file (:meth:`open_base`, then ``fill``)."""
        info, state = self.open_base(base)
        return info, state.fill()

    def read_records(self, plan: RestorePlan, *, prefetch: int | None = None,
                     stats: ReadStats | None = None, prepare: Preparer[dict[str, Any]] | None = None,
                     fetching: Prefetcher[Any, Any] | None = None
                     ) -> Generator[tuple[dict[str, Any] | None, str | None], None, None]:
        """Yield ``(record, None)`` for each record after the base up to the target, in order, and
        ``(None, problem)`` once on damage: :meth:`diffckpt.recordreads.RecordReader.read` (prefetched,
        large segments read record by record; ``fetching``: begun by :meth:`fetch_records`)."""
        return RecordReader(self.storage).read(plan, prefetch=prefetch, stats=stats, prepare=prepare,
                                               fetching=fetching)

    def fetch_records(self, plan: RestorePlan) -> Prefetcher[Any, Any]:
        """Begin reading ``plan``'s records now (:meth:`diffckpt.recordreads.RecordReader.fetch`),
        for :meth:`read_records`; close it if it is not read to the end."""
        return RecordReader(self.storage).fetch(plan)
