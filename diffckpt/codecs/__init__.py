"""Gradient codecs: the compressed payload training communicates is the diff that is stored."""

from __future__ import annotations

from typing import Any

from .base import Codec, Payload
from .lowprec import LowPrecision
from .powersgd import PowerSGD
from .topk import TopK

__all__ = ["Codec", "LowPrecision", "Payload", "PowerSGD", "TopK", "codec_from_config"]


def codec_from_config(config: dict[str, Any]) -> Codec:
    """The codec a record's ``codec`` settings describe (for decoding; its state starts empty)."""
    settings = dict(config)
    kind = settings.pop("codec", None)
    if kind == "topk":
        return TopK(settings.pop("ratio"), **settings)
    if kind == "powersgd":
        return PowerSGD(settings.pop("rank"), **settings)
    if kind == "lowprec":
        return LowPrecision(settings.pop("dtype"))
    raise ValueError(f"unknown gradient codec {kind!r} in a record; this diffckpt knows topk, "
                     "powersgd and lowprec: upgrade diffckpt to read this run")

