"""Where runs live: the :class:`Storage` protocol, its fsspec implementation and retries.

Everything above this package reads and writes whole objects through :class:`Storage`; nothing
else in diffckpt touches a file system or an object store.
"""

from .fsspec_storage import FsspecStorage, Storage, open_storage
from .retry import RetryingStorage, RetryPolicy, is_transient, unwrap

__all__ = ["FsspecStorage", "RetryPolicy", "RetryingStorage", "Storage", "is_transient", "open_storage", "unwrap"]
