"""Capture and restore of every global random number generator training may draw from."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["get_rng_state", "set_rng_state"]


def get_rng_state() -> dict[str, Any]:
    """Copies of the torch, numpy, python and (if initialized) CUDA generator states."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states captured by :func:`get_rng_state`."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    python = state["python"]
    # JSON has no tuples inside lists; random.setstate wants (version, tuple(ints), gauss).
    random.setstate((python[0], tuple(python[1]), python[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
