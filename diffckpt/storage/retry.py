"""Retrying transient storage faults with exponential backoff and full jitter.

Object stores fail transiently all the time: timeouts, 5xx answers, throttling (``SlowDown``),
connections reset mid-upload. Such failures are retried here until the policy's budget is spent;
permanent ones (permissions, a missing bucket, a full disk, bad arguments) are raised at once,
since retrying cannot fix them. Every write diffckpt makes is idempotent (whole objects, fixed
names), so repeating one after an unknown outcome is safe.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import DiffCkptError, StorageUnavailableError
from ..policyoptions import RetryPolicy
from .protocol import InspectableStorage
from .spool import Spool, open_spool, ranged, read_into, read_range

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["RetryPolicy", "RetryingInspectableStorage", "RetryingStorage", "is_transient", "retry_call", "unwrap"]

log = logging.getLogger("diffckpt")
T = TypeVar("T")

_TRANSIENT_ERRNOS = {errno.EBUSY, errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT,
                     errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EAGAIN,
                     getattr(errno, "EREMOTEIO", errno.EIO)}
# Exception classes of botocore, aiohttp, urllib3 and fsspec that mean "try again", by name so
# that the core imports none of them.
_TRANSIENT_NAMES = {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
                    "ClientConnectorError", "ClientConnectionError", "ServerDisconnectedError",
                    "ClientPayloadError", "ClientOSError", "ServerTimeoutError", "IncompleteRead",
                    "ResponseStreamingError", "ProtocolError", "HTTPClientError", "FSTimeoutError",
                    "ResponseParserError", "RemoteDisconnected",
                    "ServiceRequestError", "ServiceResponseError"}  # azure-core (adlfs)
_PERMANENT = (PermissionError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a fault that may go away when retried."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, StorageUnavailableError):
            return True
        if isinstance(current, _PERMANENT):
            return False
        if isinstance(current, (TimeoutError, ConnectionError)):
            return True
        if getattr(current, "errno", None) in _TRANSIENT_ERRNOS or type(current).__name__ in _TRANSIENT_NAMES:
            return True
        response = getattr(current, "response", None)  # botocore's ClientError
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") if isinstance(response, dict) else None
        status = status or getattr(current, "status_code", None) or getattr(current, "code", None)  # Azure, GCS
        if isinstance(status, int) and not isinstance(status, bool) and (status >= 500 or status == 429):
            return True
        current = current.__cause__ or current.__context__
    return False





def retry_call(policy: RetryPolicy, fn: Callable[[], T], what: str, cancel: threading.Event | None = None) -> T:
    """Run ``fn``, retrying transient failures until the budget is spent.

    Raises:
        StorageUnavailableError: transient failures lasted longer than ``budget_s`` (or
            ``cancel`` was set while waiting).
        Exception: a permanent failure, unchanged, at once.
    """
    start = time.monotonic()
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            if not is_transient(exc):
                raise
            attempt += 1
            elapsed = time.monotonic() - start
            wait = policy.delay(attempt)
            if (attempt > 2 and elapsed + wait > policy.budget_s) or (cancel is not None and cancel.is_set()):
                raise StorageUnavailableError(
                    f"cannot {what}: storage kept failing for {elapsed:.1f}s ({attempt} attempts; last "
                    f"error: {_describe(exc)}). Check that the endpoint is reachable and healthy; "
                    f"{policy.budget_setting} sets how long to retry") from exc
            (log.warning if attempt == 1 else log.info)(
                "diffckpt: %s failed (%s); transient, retry %d in %.2fs", what, _describe(exc), attempt, wait)
            if cancel is not None and cancel.wait(wait):
                raise StorageUnavailableError(f"cannot {what}: given up while retrying (last error: "
                                              f"{_describe(exc)})") from exc
            if cancel is None:
                time.sleep(wait)


def _describe(exc: BaseException) -> str:
    root = exc
    while isinstance(root, DiffCkptError) and root.__cause__ is not None:
        root = root.__cause__
    return f"{type(root).__name__}: {root}"


class RetryingStorage:
    """A :class:`~diffckpt.storage.Storage` that retries the transient failures of another.

    Constructing one over an :class:`~diffckpt.storage.InspectableStorage` gives a
    :class:`RetryingInspectableStorage`, which is one too (its extra operations retried as well):
    what the wrapped storage can do, the wrapper can, and ``isinstance`` tells.
    """

    def __new__(cls, inner: Any = None, *args: Any, **kwargs: Any) -> Self:
        # Defaults: pickling and copying call ``__new__(cls)`` alone, with the class already right.
        capable = cls is RetryingStorage and isinstance(inner, InspectableStorage)
        return object.__new__(RetryingInspectableStorage if capable else cls)  # type: ignore[return-value]

    def __init__(self, inner: Any, policy: RetryPolicy | None = None, cancel: threading.Event | None = None) -> None:
        self.inner = inner
        self.url = inner.url
        self.policy = policy or RetryPolicy()
        self.cancel = cancel

    def with_cancel(self, cancel: threading.Event) -> RetryingStorage:
        """The same storage, whose waits end early (raising) once ``cancel`` is set."""
        return RetryingStorage(self.inner, self.policy, cancel)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        return retry_call(self.policy, fn, what, self.cancel)

    def write(self, path: str, data: Any) -> None:
        self._call(f"write {self.url}/{path}", lambda: self.inner.write(path, data))

    def create(self, path: str, data: bytes) -> bool:
        return self._call(f"create {self.url}/{path}", lambda: self.inner.create(path, data))

    def read(self, path: str) -> bytes:
        return self._call(f"read {self.url}/{path}", lambda: self.inner.read(path))

    def read_range(self, path: str, start: int, end: int) -> bytes:
        return self._call(f"read {self.url}/{path}", lambda: read_range(self.inner, path, start, end))

    def read_into(self, path: str, start: int, out: memoryview) -> int:
        """Retried from the start of the range: a failed read leaves nothing of its own in ``out``."""
        return self._call(f"read {self.url}/{path}", lambda: read_into(self.inner, path, start, out))

    @property
    def ranged(self) -> bool:
        return ranged(self.inner)

    def spool(self, hint: str, folder: str | None = None) -> Spool:
        """The wrapped storage's spool. Not retried: it is a local file, whose failures (a full
        disk, permissions) do not go away by themselves. A write of it is retried from its start."""
        return open_spool(self.inner, hint, folder)

    def list(self, prefix: str) -> dict[str, int]:
        return self._call(f"list {self.url}/{prefix}", lambda: self.inner.list(prefix))

    def delete(self, path: str) -> None:
        self._call(f"delete {self.url}/{path}", lambda: self.inner.delete(path))

    def exists(self, path: str) -> bool:
        return self._call(f"reach {self.url}/{path}", lambda: self.inner.exists(path))


class RetryingInspectableStorage(RetryingStorage):
    """:class:`RetryingStorage` over an :class:`~diffckpt.storage.InspectableStorage`."""

    def details(self, prefix: str, hidden: bool = False) -> dict[str, tuple[int, float | None]]:
        return self._call(f"list {self.url}/{prefix}", lambda: self.inner.details(prefix, hidden=hidden))

    def stat(self, path: str) -> tuple[int, float | None]:
        return self._call(f"reach {self.url}/{path}", lambda: self.inner.stat(path))

    def incomplete_uploads(self) -> list[tuple[str, str, float | None]]:
        return self._call(f"list the uploads of {self.url}", self.inner.incomplete_uploads)

    def abort_upload(self, path: str, upload_id: str) -> None:
        self._call(f"abort the upload of {self.url}/{path}", lambda: self.inner.abort_upload(path, upload_id))


def unwrap(storage: Any) -> Any:
    """The storage under a :class:`RetryingStorage` (any other storage as it is)."""
    return storage.inner if isinstance(storage, RetryingStorage) else storage
