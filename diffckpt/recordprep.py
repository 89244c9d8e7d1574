"""A step record made ready for encoding, on the writer thread: gradients narrowed to 16 bits
where that is exact, and, once its tensors are on the host, buffers that did not change since the
record before dropped and the fingerprint computed. Kept apart from ``writer.py`` because it is
pure data work: nothing here waits, writes or knows the writer's state."""

from __future__ import annotations

from typing import Any

import torch

from .checksums import fingerprint
from .narrowing import narrowed

__all__ = ["narrow_gradients", "prepare_record"]


def narrow_gradients(record: dict[str, Any], pool: Any = None, taken: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Store ``record``'s bfloat16-valued float32 gradients in 16 bits, and those bfloat16-valued
    but in a few rows as row-split gradients (exact, half the bytes or close, and far cheaper than
    zstd finding the zero halves; replay casts every gradient to its parameter's dtype, format.md
    section 6). Only gradients: a base and the rest of a record
    (buffers, state) keep their dtypes.

    Host gradients are narrowed here, in place (here, not on the training thread: it reads every
    gradient byte). The others are returned: the host stage narrows them on their device before
    it copies them (``staging.py``), so that only the bytes stored cross the bus and none is read
    twice. ``pool``, ``taken``: where host copies' memory comes from (:func:`narrowed`)."""
    left: list[torch.Tensor] = []
    for event in record["events"]:
        if "grads" in event:
            left += [g for group in event["grads"] for g in group if g is not None and g.device.type != "cpu"]
            event["grads"] = [[g if g is None or g.device.type != "cpu" else narrowed(g, pool, taken) for g in group]
                              for group in event["grads"]]
    return left


def prepare_record(record: dict[str, Any], last: dict[str, torch.Tensor] | None,
                   staged: bool) -> dict[str, torch.Tensor]:
    """Make ``record`` (on the host) ready in place; return the buffers to compare the next
    record with.

    ``last``: the buffers as of the record before (``None`` after a base: all are kept).
    ``staged``: whether the record's tensors sit in pooled host buffers (copied from the GPU)."""
    buffers = record.get("buffers") or {}
    if last is not None:
        record["buffers"] = {k: v for k, v in buffers.items() if k not in last or not torch.equal(last[k], v)}
    params = record.pop("fingerprint_params", None)
    if params is not None:
        record["fingerprint"] = fingerprint(params)
    # Buffers staged from the GPU sit in pooled host buffers that the next record reuses once
    # released: kept as they are, the next comparison would see its own values.
    return {**(last or {}), **({k: v.clone() for k, v in buffers.items()} if staged else buffers)}
