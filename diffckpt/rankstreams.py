"""Where each rank of a sharded session keeps its stream under the run root.

Apart from :mod:`diffckpt.sharding` (which works on tensors) so that reading a run's layout
(``diffckpt ls``, ``gc``) does not import torch.
"""

from __future__ import annotations

__all__ = ["RANKS_DIR", "rank_prefix"]

RANKS_DIR = "ranks"


def rank_prefix(rank: int) -> str:
    """Where rank ``rank`` of a sharded session writes its stream, under the run root."""
    return f"{RANKS_DIR}/r{rank:05d}/"
