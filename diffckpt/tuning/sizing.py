"""The size model for planning: how many bytes a step's record and a base hold for a described
model, optimizer and gradient codec (:class:`ModelSpec`, :class:`CodecSpec`).

Training measures these sizes; ``diffckpt tune`` has no run to measure and derives them from the
parameter count instead.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from ..options import CheckpointOptions

__all__ = ["FP32", "STATE_SLOTS", "CodecSpec", "ModelSpec", "parse_codec"]

FP32 = 4  # bytes per parameter of master weights, optimizer state and dense gradients
STATE_SLOTS = {"adam": 2, "adamw": 2, "sgd-momentum": 1, "sgd": 0}


@dataclass(frozen=True)
class CodecSpec:
    """A gradient codec as far as sizes go (``kind``: none, topk, powersgd, lowprec)."""

    kind: str
    value: float = 0.0
    text: str = "none"

    def record_bytes(self, params: int) -> float:
        """Bytes a step's record holds (the codec's payload; dense fp32 gradients without one)."""
        if self.kind == "topk":  # an int32 index delta and a float32 value per kept entry
            return max(1.0, math.ceil(self.value * params)) * 8
        if self.kind == "powersgd":
            # P (rows x r) and Q (cols x r) in float32 per matrix. For transformer-shaped
            # matrices of width h (attention h x h, MLP h x 4h, embeddings V x h) that is about
            # 6 r / h bytes per parameter, with h from params ~ 12 L h^2 and L ~ h / 64.
            width = (params / 0.1875) ** (1 / 3)
            return min(FP32, 6 * self.value / width) * params
        if self.kind == "lowprec":
            return 2.0 * params
        return float(FP32 * params)

    def extra_base_bytes(self, params: int) -> float:
        """Codec state saved with bases: PowerSGD's error-feedback residuals (on by default)."""
        return float(FP32 * params) if self.kind == "powersgd" else 0.0

    def snippet(self) -> str | None:
        """The codec as a ``DiffCheckpoint(codec=...)`` argument (``None``: no codec)."""
        if self.kind == "topk":
            return f"TopK({self.value:g})"
        if self.kind == "powersgd":
            return f"PowerSGD({int(self.value)})"
        if self.kind == "lowprec":
            return f'LowPrecision("{self.text}")'
        return None

    def describe(self) -> str:
        return {"topk": f"topk {self.value:g} (index + value per kept entry)",
                "powersgd": f"powersgd rank {int(self.value)} (approximate: transformer-shaped matrices)",
                "lowprec": f"{self.text} gradients",
                }.get(self.kind, "none (dense fp32 gradients)")


def parse_codec(text: str) -> CodecSpec:
    """``none``, ``topk:0.01``, ``powersgd:4``, ``bf16`` / ``fp16`` (or ``lowprec:bf16``)."""
    s = text.strip().lower()
    kind, _, arg = s.partition(":")
    try:
        if kind in ("none", "dense") and not arg:
            return CodecSpec("none")
        if kind == "topk":
            ratio = float(arg or "0.01")
            if 0 < ratio <= 1:
                return CodecSpec("topk", ratio, s)
        elif kind == "powersgd":
            rank = int(arg or "4")
            if rank >= 1:
                return CodecSpec("powersgd", rank, s)
        elif kind in ("bf16", "fp16") and not arg:
            return CodecSpec("lowprec", 2, kind)
        elif kind == "lowprec" and arg in ("bf16", "fp16", "bfloat16", "float16"):
            return CodecSpec("lowprec", 2, "bf16" if arg.startswith("b") else "fp16")
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(
        f"unknown codec {text!r}: use none, topk:RATIO (e.g. topk:0.01), powersgd:RANK (e.g. "
        "powersgd:4), bf16 or fp16")


@dataclass(frozen=True)
class ModelSpec:
    """What the user says about training."""

    params: int
    step_s: float
    optimizer: str = "adamw"
    codec: CodecSpec = CodecSpec("none")
    memory_bytes: int = CheckpointOptions.max_pending_bytes

    @property
    def slots(self) -> int:
        return STATE_SLOTS[self.optimizer]

    @property
    def base_bytes(self) -> float:
        """fp32 master weights plus the optimizer's state slots (plus codec state)."""
        return FP32 * self.params * (1 + self.slots) + self.codec.extra_base_bytes(self.params)

    @property
    def record_bytes(self) -> float:
        return self.codec.record_bytes(self.params)
