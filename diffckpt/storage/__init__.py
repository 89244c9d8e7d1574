"""Where runs live: the :class:`Storage` protocol and its optional capabilities
(:class:`InspectableStorage`), the fsspec implementation, retries, and :func:`open_storage`.

Everything above this package reads and writes whole objects through :class:`Storage`; nothing
else in diffckpt touches a file system or an object store.
"""

from .fsspec_storage import FsspecStorage
from .opening import open_storage
from .protocol import InspectableStorage, Storage
from .retry import RetryingInspectableStorage, RetryingStorage, RetryPolicy, is_transient, unwrap

__all__ = ["FsspecStorage", "InspectableStorage", "RetryPolicy", "RetryingInspectableStorage", "RetryingStorage",
           "Storage", "is_transient", "open_storage", "unwrap"]
