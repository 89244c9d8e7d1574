"""Where runs live: the :class:`Storage` protocol and its optional capabilities
(:class:`InspectableStorage`), the fsspec implementation, retries, and :func:`open_storage`.

Everything above this package reads and writes whole objects through :class:`Storage` (a
:class:`Spool` holds an object's bytes in a local file until it is written, :func:`read_range`
and :func:`read_into` read part of one); nothing else in diffckpt touches a file system or an object store.
"""

from .fsspec_storage import FsspecStorage
from .opening import open_storage
from .protocol import InspectableStorage, Storage, as_bytes, data_size
from .retry import RetryingInspectableStorage, RetryingStorage, RetryPolicy, is_transient, unwrap
from .spool import Spool, open_spool, ranged, read_into, read_range

__all__ = ["FsspecStorage", "InspectableStorage", "RetryPolicy", "RetryingInspectableStorage", "RetryingStorage",
           "Spool", "Storage", "as_bytes", "data_size", "is_transient", "open_spool", "open_storage", "ranged",
           "read_into", "read_range", "unwrap"]
