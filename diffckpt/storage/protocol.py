"""What diffckpt needs from a store: the :class:`Storage` protocol, and the optional
capabilities of :class:`InspectableStorage`.

Everything above ``diffckpt.storage`` reads and writes whole objects through :class:`Storage`.
Garbage collection can do more where a store can say more (when each object was written,
temporary files, multipart uploads that never completed); a store says so by implementing
:class:`InspectableStorage`, and ``isinstance(storage, InspectableStorage)`` is the one test.
Paths are relative to the run root and use ``/``.

Two more capabilities are optional and found with ``getattr``, through the helpers of
:mod:`diffckpt.storage.spool`: ``spool(hint)`` gives a local file to append an object's bytes to
before the object is written (:func:`~diffckpt.storage.open_spool`), and ``read_range(path, start,
end)`` with ``ranged = True`` reads part of an object (:func:`~diffckpt.storage.read_range`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from .spool import Spool  # spool.py imports nothing of this module
from .spoolwrite import Buffer  # checksums.py's, as every storage module takes it

__all__ = ["Buffer", "Data", "InspectableStorage", "Storage", "as_bytes", "data_size", "is_storage"]

Data = bytes | Sequence[Buffer] | Spool


def as_bytes(data: Data) -> bytes:
    """``data`` as one bytes object (joins a list of buffers, reads a spool back)."""
    if isinstance(data, bytes):
        return data
    if isinstance(data, Spool):
        return data.read_at(0, data.size)  # one read into one buffer, not chunks joined
    return b"".join(data)


def data_size(data: Data) -> int:
    """How many bytes ``data`` holds, without joining or reading anything."""
    if isinstance(data, Spool):
        return data.size
    if isinstance(data, (bytes, memoryview)):
        return memoryview(data).nbytes
    return sum(memoryview(part).nbytes for part in data)


@runtime_checkable
class Storage(Protocol):
    """What the engine needs from a store: atomic whole-object writes and plain reads."""

    url: str

    def write(self, path: str, data: Data) -> None:
        """Write ``data`` (bytes, buffers to concatenate, or a :class:`Spool`'s content) so that
        readers see the whole object or nothing. A spool given is the caller's to discard
        afterwards; it must stay readable until the write returned (iterating it yields its
        content in chunks)."""

    def create(self, path: str, data: bytes) -> bool:
        """Write ``data`` only if ``path`` does not exist, atomically; return whether it did not
        (two writers racing for a name: exactly one gets ``True``)."""

    def read(self, path: str) -> bytes:
        """Return the whole object; raise :class:`CheckpointNotFoundError` if it is absent."""

    def list(self, prefix: str) -> dict[str, int]:
        """Return ``{relative path: size}`` for every committed object under ``prefix``."""

    def delete(self, path: str) -> None:
        """Remove an object; absent objects are ignored."""

    def exists(self, path: str) -> bool:
        """Whether an object is present."""


_STORAGE_MEMBERS = ("url", "write", "create", "read", "list", "delete", "exists")


def is_storage(obj: object) -> bool:
    """Whether ``obj`` has what :class:`Storage` asks for: ``isinstance``, or on Python 3.12 and
    later, where ``isinstance`` misses methods a wrapper forwards through ``__getattr__``, the
    same members found as a call finds them."""
    return isinstance(obj, Storage) or all(hasattr(obj, name) for name in _STORAGE_MEMBERS)


@runtime_checkable
class InspectableStorage(Protocol):
    """Optional capabilities of a :class:`Storage`: describing what it holds beyond
    :meth:`Storage.list`, and cleaning up uploads that never completed.

    Garbage collection uses them where a storage has them: with modification times it can tell
    leftovers of interrupted writes that are old enough to remove from those of a writer still at
    work (without them nothing counts as old), and incomplete multipart uploads are found and
    aborted. :class:`~diffckpt.storage.FsspecStorage` implements all of it; the wrappers of
    :func:`~diffckpt.storage.open_storage` implement it exactly when the storage they wrap does.

    ``isinstance`` checks that the methods exist; on Python 3.12 and later it does not see
    methods that a wrapper forwards through ``__getattr__``, so a wrapper defines them.
    """

    def details(self, prefix: str, hidden: bool = False) -> dict[str, tuple[int, float | None]]:
        """``{relative path: (size, modification time or None)}`` under ``prefix``; with
        ``hidden``, also the dot-files that :meth:`Storage.list` leaves out (temporary files)."""

    def stat(self, path: str) -> tuple[int, float | None]:
        """``(size, modification time or None)`` of one object, without reading it; raise
        :class:`CheckpointNotFoundError` if there is no object at ``path``."""

    def incomplete_uploads(self) -> list[tuple[str, str, float | None]]:
        """``(relative key, upload id, start time or None)`` of every upload under the root
        that was started and neither completed nor aborted (empty where there are none)."""

    def abort_upload(self, path: str, upload_id: str) -> None:
        """Abort an incomplete upload, so that its parts stop taking space."""
