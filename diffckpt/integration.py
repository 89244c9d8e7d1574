"""What an adapter may use: the toolkit the Lightning, Fabric, Accelerate and transformers
adapters are written with, and a new adapter should be.

- the engine and what it is handed and gives back: :class:`CheckpointEngine`,
  :class:`FrameworkState`, :class:`Committed`;
- the step life cycle: :class:`StepDriver` (SIGTERM agreed by every rank, the session begun at
  the first boundary, each step committed, the close), :func:`step_metrics`,
  :func:`check_log_every`; for hand-written loops :class:`LoopCheckpointer` and
  :class:`TrackedLoader` (with :data:`END`), and :class:`StopSignal`;
- RNG and data order: :func:`get_rng_state`, :func:`set_rng_state`,
  :func:`epoch_start_state`, :func:`set_epoch_start_state`; the rest of an epoch dealt over
  another number of ranks: :func:`deal`, :func:`distributed_dealing`, :func:`drawn_order`,
  :func:`global_order`, :class:`IndexSampler`, :class:`Remainder`;
- refusals and checks: :func:`check_replayable`, :func:`is_sharded`, :func:`require_extra`,
  :func:`check_codec`;
- options merging (an explicit keyword wins over ``options=``): :func:`merge_options`,
  :class:`NotGiven`, ``NOT_GIVEN_*``, ``Auto``, ``ByBytes``;
- storage and results: :func:`open_storage`, :class:`FsspecStorage`, :data:`RUN_FILE`,
  :class:`ReplayResult`, :class:`GradientCompressor`, :class:`Codec`, :data:`HF_TRAINER_KEY`.

Adapters import from here, from :mod:`diffckpt` and from :mod:`diffckpt.errors` only (a test pins
it), and pass values to each other's modules explicitly instead of reaching into private state.
"""

from __future__ import annotations

from .capture import check_replayable
from .codecs import Codec
from .codecs.compressor import GradientCompressor, check_codec
from .dataorder import epoch_start_state, set_epoch_start_state
from .dealing import IndexSampler, Remainder, deal, distributed_dealing, drawn_order, global_order
from .driver import StepDriver, check_log_every, step_metrics
from .engine import CheckpointEngine
from .extras import require_extra
from .hf_trainer import KEY as HF_TRAINER_KEY
from .loop import END, LoopCheckpointer, TrackedLoader
from .options import (
    NOT_GIVEN_BASE_EVERY_N_STEPS,
    NOT_GIVEN_EVERY_N_STEPS,
    NOT_GIVEN_WRITE_BATCH,
    Auto,
    ByBytes,
    CheckpointOptions,
    NotGiven,
    merge_options,
)
from .preemption import StopSignal
from .replay import ReplayResult
from .rng import get_rng_state, set_rng_state
from .runstore import RUN_FILE
from .session import Committed, FrameworkState
from .sharding import is_sharded
from .storage import FsspecStorage, open_storage

__all__ = [
    "END", "HF_TRAINER_KEY", "NOT_GIVEN_BASE_EVERY_N_STEPS", "NOT_GIVEN_EVERY_N_STEPS", "NOT_GIVEN_WRITE_BATCH",
    "RUN_FILE", "Auto", "ByBytes", "CheckpointEngine", "CheckpointOptions", "Codec", "Committed", "FrameworkState",
    "FsspecStorage", "GradientCompressor", "IndexSampler", "LoopCheckpointer", "NotGiven", "Remainder",
    "ReplayResult", "StepDriver", "StopSignal", "TrackedLoader", "check_codec", "check_log_every",
    "check_replayable", "deal", "distributed_dealing", "drawn_order", "epoch_start_state", "get_rng_state",
    "global_order", "is_sharded", "merge_options", "open_storage", "require_extra", "set_epoch_start_state",
    "set_rng_state", "step_metrics",
]
