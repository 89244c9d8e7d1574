"""Kept markers: the steps that a framework's saves name, recorded in the run root.

A save that names a step (a Lightning ``ModelCheckpoint`` reference, an Accelerate ``save_state``
folder, :meth:`diffckpt.CheckpointEngine.keep`) must not outlive the step's data, and the save
outlives the process that made it: a later session's retention and ``diffckpt gc`` run where that
process's memory is gone. So each kept step is also a small object under ``kept/`` that every
retention pass reads (``docs/format.md`` section 9a). One marker per save, named by a hash of the
save's name (its ``why``): a save rewritten under its name at another step moves its marker, and
the framework's removal of the save deletes it (:meth:`KeptSteps.release`), so that retention may
reclaim the step.

A marker is written only once the step it names is durable (on the writer thread, after what was
queued before it), and deleted only after the save it stands for is gone, so a crash between the
two leaves a marker too many (a step kept longer), never a save without its step.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .checksums import XXH3_128
from .errors import CheckpointNotFoundError, CorruptRecordError, DiffCkptError
from .format import FORMAT_VERSION, checksum_for, is_int
from .storage import Storage

__all__ = ["KEPT_DIR", "KeptStep", "KeptSteps", "decode_kept", "encode_kept", "is_kept_path", "kept_path",
           "read_kept"]

log = logging.getLogger("diffckpt")
KEPT_DIR = "kept"


@dataclass(frozen=True)
class KeptStep:
    """A step that a save names: session ``gen``'s ``step``, kept because of ``why``."""

    gen: int
    step: int
    why: str
    path: str = ""  # the marker's path under the run root, when read from one


def kept_path(why: str) -> str:
    """``kept/<xxh3-128 of why, 32 hex>.json``: the marker of the save named ``why``."""
    return f"{KEPT_DIR}/{XXH3_128.hexdigest(why.encode())}.json"


def is_kept_path(path: str) -> bool:
    """Whether a listed path is a kept marker (temporary files of a write are not)."""
    folder, _, name = path.partition("/")
    return folder == KEPT_DIR and name.endswith(".json") and "/" not in name and not name.startswith(".")


def encode_kept(gen: int, step: int, why: str) -> bytes:
    """A marker's bytes (JSON, sorted keys)."""
    body = {"format": FORMAT_VERSION, "gen": gen, "step": step, "why": why}
    return json.dumps(body, indent=1, sort_keys=True).encode()


def decode_kept(data: bytes, path: str) -> KeptStep:
    """Parse a marker, raising :class:`CorruptRecordError` if it is damaged or of a format this
    diffckpt does not read."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        body = None
    if not isinstance(body, dict):
        raise CorruptRecordError(f"{path}: kept marker is damaged (not a JSON object)")
    checksum_for(body.get("format"), f"{path}: kept marker")  # raises for a version not read here
    for key in ("gen", "step"):
        if not is_int(body.get(key)) or body[key] < 0:
            raise CorruptRecordError(f"{path}: kept marker is damaged ({key} {body.get(key)!r} is not a "
                                     "step or session number)")
    if not isinstance(body.get("why"), str):
        raise CorruptRecordError(f"{path}: kept marker is damaged (why is not a string)")
    return KeptStep(body["gen"], body["step"], body["why"], path)


def read_kept(storage: Storage, paths: Iterable[str]) -> tuple[list[KeptStep], dict[str, str]]:
    """The markers at ``paths`` (from a listing), and ``{path: problem}`` of those that cannot be
    read.

    A marker deleted since the listing was released: it is left out. One that is damaged names a
    step nobody can tell, so the caller must keep everything rather than guess.
    """
    kept, problems = [], {}
    for path in sorted(paths):
        try:
            kept.append(decode_kept(storage.read(path), path))
        except CheckpointNotFoundError:
            continue
        except DiffCkptError as exc:
            problems[path] = str(exc)
    return kept, problems


class KeptSteps:
    """The steps one process keeps: in memory, for its own retention at once, and as markers in
    the run root (``storage``), for every later session and ``diffckpt gc``.

    ``after_written(fn)`` runs ``fn`` once everything queued before is durable (the writer
    thread, in order), or at once when no session writes; ``durable()`` is the session's durable
    step then.
    """

    def __init__(self, storage: Storage, after_written: Callable[[Callable[[], None]], None],
                 durable: Callable[[], int | None]) -> None:
        self.storage = storage
        self.after_written = after_written
        self.durable = durable
        self.gen: int | None = None  # the session that keeps (the newest this process started)
        self._held: dict[str, tuple[int, int]] = {}  # why -> (gen, step)

    def held(self) -> list[tuple[int, int, str]]:
        """``(gen, step, why)`` of every step this process keeps."""
        held = self._held.copy()  # one call, atomic under the GIL: the maintenance thread asks
        return [(gen, step, why) for why, (gen, step) in held.items()]

    def keep(self, step: int, why: str) -> None:
        """Keep ``step`` of the session for the save named ``why`` (a durable step, or one whose
        record is queued: the marker follows its data)."""
        gen = self.gen
        if gen is None:
            return  # nothing recorded in this process: no step of it to keep
        self._held[why] = (gen, step)
        data = encode_kept(gen, step, why)

        def mark() -> None:
            durable = self.durable()
            if durable is None or step > durable:  # a marker never names a step that is not there
                log.warning("diffckpt: step %d is kept by this process only (%s): it was not durable when "
                            "kept; keep a step once it is recorded", step, why)
                return
            self.storage.write(kept_path(why), data)

        self.after_written(mark)

    def saved(self) -> list[KeptStep]:
        """The markers in the run root now, every session's (damaged ones left out)."""
        paths = [p for p in self.storage.list(KEPT_DIR + "/") if is_kept_path(p)]
        return read_kept(self.storage, paths)[0]

    def release(self, why: str) -> None:
        """Stop keeping the step of the save named ``why``: the framework removed the save."""
        self._held.pop(why, None)
        self.after_written(lambda: self.storage.delete(kept_path(why)))
