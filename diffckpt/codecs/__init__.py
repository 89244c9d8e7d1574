"""Gradient codecs: the compressed payload training communicates is the diff that is stored.

Not wired into capture and replay yet (see ``docs/architecture.md``); the codecs themselves are
complete and tested.
"""

from .base import Codec, Payload
from .lowprec import LowPrecision
from .powersgd import PowerSGD
from .topk import TopK

__all__ = ["Codec", "LowPrecision", "Payload", "PowerSGD", "TopK"]
