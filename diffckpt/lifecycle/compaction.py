"""Compaction: roll a new base forward from an existing base and its diffs, from storage alone.

It replays without the training process (in another process or machine, or in a background
thread of the trainer), so training never stalls for a full checkpoint: run it with
``base_every_n_steps=None`` and bases appear by compaction. The new base is written into the
session of the steps it replayed, at a step where a segment ends, so that the next segment
continues its chain; restores then pick it like any base (least replay first).

Replay checks every fingerprint recorded in training on the way. The base's COMMIT marker says
it was compacted, from which base, on which device, and up to which step the replay matched the
fingerprints recorded in training (``verified_through``; the base's own step when a fingerprint
was recorded there).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from .. import planning
from ..checksums import fingerprint
from ..deprecation import renamed_kwargs
from ..errors import CheckpointNotFoundError
from ..format import BaseName, base_commit
from ..loading import load_state
from ..runstore import RunStore
from ..sessionfile import recorded_device, training_device  # re-exported: they were defined here
from ..storage import Storage, open_storage
from ..tree import pack_parts

__all__ = ["CompactionResult", "compact", "recorded_device", "training_device"]

log = logging.getLogger("diffckpt")


@dataclass
class CompactionResult:
    """What :func:`compact` did."""

    step: int
    gen: int
    from_base: int
    replayed: int
    written: bool  # False when a base already existed at ``step``
    verified_through: int | None
    bytes: int = 0
    seconds: float = 0.0
    replay_s: float = 0.0

    @property
    def verified_at_step(self) -> bool:
        """Whether the new base matched a fingerprint recorded in training at its own step."""
        return self.verified_through == self.step

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "gen": self.gen, "from_base": self.from_base, "replayed": self.replayed,
                "written": self.written, "verified_through": self.verified_through,
                "verified_at_step": self.verified_at_step, "bytes": self.bytes,
                "seconds": round(self.seconds, 3), "replay_s": round(self.replay_s, 3),
                "steps_per_s": round(self.replayed / self.replay_s, 1) if self.replay_s > 0 else None}


def compaction_target(store: RunStore, to: int | None) -> tuple[int, int, int]:
    """``(gen, step, base step)`` that compacting to ``to`` (``None``: the newest durable step)
    would write and start from.

    Raises:
        CheckpointNotFoundError: ``to`` is not durable, or no segment ends at it.
    """
    inv = store.inventory()
    plan = planning.plan(store, to, inv)
    ends = sorted({s.last for s in [*inv.chain(plan.base), *plan.segments]})  # a plan may cross sessions
    if plan.target != plan.base.step and plan.target not in ends:
        near = [s for s in ends if s < plan.target][-3:] + [s for s in ends if s > plan.target][:3]
        raise CheckpointNotFoundError(
            f"step {plan.target} is durable but no segment ends there, so a base at it would not "
            f"continue any chain; compact to a step where a segment ends (near it: {near}; "
            "`diffckpt ls` lists segments)")
    return plan.gen, plan.target, plan.base.step


@renamed_kwargs(url="dirpath")
def compact(dirpath: str | os.PathLike[str] | Storage, to: int | None = None, *, device: str | None = None,
            storage_options: dict[str, Any] | None = None, allow_modules: tuple[str, ...] = ("torch.",),
            by: str = "diffckpt compact") -> CompactionResult:
    """Write a base at step ``to`` (``None``: the newest durable step) by replaying stored diffs.

    Args:
        dirpath: the run root (local path, fsspec URL or a :class:`Storage`); ``url=`` is a
            deprecated spelling.
        to: a durable step where a segment ends.
        device: where replay runs; ``None``: the device type training ran on
            (:func:`recorded_device`), the only one that gives a bit-exact base (replay
            elsewhere is checked against the fingerprints recorded in training).
        storage_options: passed to fsspec.
        allow_modules: modules optimizer classes may be imported from.
        by: who compacted, recorded in the COMMIT marker.

    Raises:
        CheckpointNotFoundError: ``to`` is not durable or not a segment end.
        ReplayMismatchError: replay diverged from the training fingerprints; nothing is written.
        UnsupportedConfigurationError: ``device`` is ``None`` and training's device type is not
            available here.
    """
    start = time.perf_counter()
    store = RunStore(open_storage(dirpath, **(storage_options or {})))
    gen, step, base_step = compaction_target(store, to)
    if base_step == step:
        return CompactionResult(step, gen, base_step, 0, False, None, seconds=time.perf_counter() - start)
    meta = store.session_meta(gen)
    device = recorded_device(meta) if device is None else device
    state = load_state(store.storage, step, device=device, allow_modules=allow_modules)
    result = state["result"]
    model = {k: v.detach().to("cpu") for k, v in state["model"].items()}
    tree: dict[str, Any] = {"model": model, "optimizers": _to_cpu(state["optimizers"]), "state": state["state"]}
    if result.codec_payloads:  # the codec resumes from them, as after replay (see GradientCompressor.restore)
        tree["codec_payloads"] = _to_cpu(result.codec_payloads)
    parts = pack_parts(tree)
    params = [model[name] for name, _ in meta["parameters"]]
    name = BaseName(step, gen)
    compacted = {"from_base": state["base_step"], "replayed": state["replayed"], "device": device,
                 "verified_through": result.verified_through, "by": by, "time": time.time()}
    if store.storage.exists(name.commit_path) or store.storage.exists(name.state_path):
        # Another compaction, or training's own base, is writing this step right now: keep theirs.
        return CompactionResult(step, gen, state["base_step"], state["replayed"], False, result.verified_through,
                                seconds=time.perf_counter() - start, replay_s=result.replay_s)
    store.storage.write(name.state_path, parts)
    store.storage.write(name.commit_path, base_commit(step, gen, fingerprint(params), parts, compacted=compacted))
    out = CompactionResult(step, gen, state["base_step"], state["replayed"], True, result.verified_through,
                           bytes=sum(len(p) for p in parts), seconds=time.perf_counter() - start,
                           replay_s=result.replay_s)
    log.info("diffckpt: compacted step %d of g%d from base %d (%d steps replayed in %.2fs; fingerprints from "
             "training matched through step %s)", step, gen, out.from_base, out.replayed, out.replay_s,
             out.verified_through)
    return out


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu")
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
