"""What a session file (``sessions/g<gen>.json``) records, and how a sharded session is opened.

A session file is written once, when a writer session starts on a run root or a rank stream
(:meth:`diffckpt.runstore.RunStore.start_session`, an exclusive create that fences older
sessions). Readers take from it the options, the writing host and process, the model's parameter
names and shapes, the optimizers and which parameters each group steps, and, for sharded
training, the world size and each rank's shard table.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .codecs.compressor import GradientCompressor
from .compat import qualname
from .errors import UnsupportedConfigurationError
from .options import CheckpointOptions
from .replicas import assign_owners
from .runstore import RunStore
from .shardedrun import ShardedRun
from .sharding import local
from .storage import Storage

if TYPE_CHECKING:
    from .coordination import Coordination

__all__ = ["SessionOwner", "open_sharded_session", "recorded_device", "session_body", "training_device",
           "training_meta"]


class SessionOwner(Protocol):
    """What opening a sharded session uses of the process's recorder (``recorder.Recorder``): a
    protocol, as the recorder imports this module and this one does not import it back."""

    options: CheckpointOptions
    storage: Storage  # the run root
    store: RunStore  # the run root's sessions, where rank 0 claims the session
    stream: RunStore  # where this process writes: set to its rank's stream
    collects_garbage: bool  # set where retention runs (rank 0)


def session_body(options: CheckpointOptions, step: int, meta: dict[str, Any]) -> dict[str, Any]:
    """What a session file records: the options, the writing host and process, the step it
    continues from, an ``id`` of its own (the node-local tier's journals name it), and ``meta`` (the model's parameters and optimizers, a sharded session's world
    size, the framework...)."""
    return {"options": dataclasses.asdict(options), "host": socket.gethostname(), "pid": os.getpid(),
            "resumed_from": step, "id": uuid.uuid4().hex, **meta}


def training_device(module: torch.nn.Module) -> str:
    """The device ``module``'s parameters are on (a sharded parameter's local piece; the CPU
    without parameters): what a session records as the device training ran on, and where
    compaction replays by default. Replay is bit-exact on the device type training ran on, so a
    base compacted there matches the fingerprints recorded in training."""
    param = next(module.parameters(), None)
    return "cpu" if param is None else str(local(param).device)


def recorded_device(meta: dict[str, Any]) -> str:
    """Where to replay a session's steps by default: the device type it trained on (its session
    file's ``device``, :func:`training_device`; the CPU for sessions of diffckpt versions that
    did not record it), the only one on which replay is bit-exact (``compact``, ``verify``,
    ``export`` and :func:`diffckpt.load_state` with ``device=None``).

    Raises:
        UnsupportedConfigurationError: that device is not available here.
    """
    device = torch.device(str(meta.get("device", "cpu"))).type
    here = torch.accelerator.current_accelerator()
    if device != "cpu" and (here is None or here.type != device):
        raise UnsupportedConfigurationError(
            f"session g{meta.get('gen')} trained on {meta['device']}, and replay is bit-exact only on the device type "
            f"training ran on, but there is no {device.upper()} device here. Replay on a machine that has one, or "
            f"on this one's CPU with --device cpu (device=\"cpu\" from Python): the result may then differ from "
            "the state training had, so replay checks it against the fingerprints recorded in training and stops "
            "if they differ (a chain without fingerprints is not checked)")
    return device


def training_meta(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                  compressor: GradientCompressor | None) -> dict[str, Any]:
    """What a session file says of the model and optimizers: each group's parameter names, the
    optimizer classes, every parameter's (local) shape, tied weights, the codec, and the device
    training runs on."""
    params = dict(module.named_parameters())
    names = {id(p): n for n, p in params.items()}
    # State-dict keys that are a parameter under another name (tied weights: an LM head
    # sharing the embedding matrix): readers without the module rebuild them from it.
    aliases = {k: names[id(v)] for k, v in module.state_dict(keep_vars=True).items()
               if k not in params and id(v) in names}
    return {
        "optimizer_params": [[[names.get(id(p), "") for p in g["params"]] for g in o.param_groups]
                             for o in optimizers],
        "optimizers": [qualname(o) for o in optimizers],
        "parameters": [[k, list(local(p).shape)] for k, p in params.items()],
        **({"aliases": aliases} if aliases else {}),
        "codec": None if compressor is None else compressor.codec.config(),
        "device": training_device(module)}


def open_sharded_session(coord: Coordination, recorder: SessionOwner, meta: dict[str, Any], step: int,
                         table: Any) -> tuple[int, dict[str, Any]]:
    """Open a sharded session (every rank calls): rank 0 claims it on the run root, naming the
    world size, every rank gets its generation (or rank 0's error) and ``recorder`` writes this
    rank's own stream. Returns the generation and the rank's session ``meta``: its shard table,
    which names the rank that records each block several ranks hold (every rank's table is
    exchanged for that)."""
    def claim() -> int:
        sharded = {"world_size": coord.world_size, "streams": "ranks/r<rank:05d>/"}
        return recorder.store.start_session(session_body(recorder.options, step, dict(meta, sharded=sharded)))

    gen = int(coord.decided(claim, "opening the session"))
    recorder.stream = ShardedRun(recorder.storage).stream(coord.rank)
    recorder.collects_garbage = coord.is_main_process  # retention runs once, over the whole root
    tables = coord.collective.broadcast(coord.collective.gather(table))
    return gen, dict(meta, rank=coord.rank, shards=assign_owners(tables)[coord.rank])
