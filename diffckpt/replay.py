"""Rebuild a step: load a base, then replay the recorded optimizer steps on it.

Replay uses the caller's model and optimizers (same classes and implementation flags as in
training, same device type), sets each param group's hyperparameters as recorded, installs the
recorded gradients and calls ``step()``. Fingerprints recorded in training are checked on the
way; a mismatch raises instead of returning a wrong state.

The replay thread does little else: segments are read, verified and decoded ahead in background
threads (their tensors are views of the bytes read where aligned, and are installed as ``.grad``
as they are), and so are the compressed gradients (:class:`_Preparer`: decoded and clipped;
:meth:`RunStore.read_records`).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from dataclasses import replace as _replace
from typing import Any

import torch

from .baseload import ReplayTarget, load_into, read_base_into
from .baseload import where as base_where
from .capture import clone_tree, tree_nbytes
from .checksums import fingerprint_matches
from .codecs import Codec, codec_from_config
from .codecs.compressor import clip_tensors
from .errors import (
    CheckpointNotFoundError,
    CorruptRecordError,
    IncompatibleCheckpointError,
    ReplayMismatchError,
)
from .inventory import RestorePlan
from .narrowing import is_split, widened
from .prefetch import Prefetcher
from .recordreads import ReadStats
from .runstore import RunStore

__all__ = ["ReplayResult", "replay", "replay_progress"]

log = logging.getLogger("diffckpt")


@dataclass
class ReplayResult:
    """Where replay ended and the framework state recorded at that step."""

    step: int
    state: Any
    replayed: int
    base_step: int
    problems: list[str] = field(default_factory=list)
    codec_config: dict[str, Any] | None = None  # the codec the restored session trained with
    codec_states: list[dict[str, torch.Tensor]] | None = None  # per rank, saved with the base
    codec_payloads: dict[str, Any] = field(default_factory=dict)  # last replayed payload per parameter
    verified_through: int | None = None  # newest step whose fingerprint from training was matched
    # (session, step, base step) that a session started at this step continues instead of writing
    # a base of its own at it (``diffckpt.planning``), and the base its chain rests on, from which
    # the next base is counted: set by a restore of a plain step that a segment or base ends
    continues: tuple[int, int, int] | None = None
    # What replay cost, for logs and benchmarks: wall seconds from the base loaded into the model
    # to the end of replay, encoded segment bytes read, and of those seconds the time replay
    # waited for records read and prepared (what prefetching did not hide). A replay redone after
    # damage counts both passes.
    replay_s: float = 0.0
    read_bytes: int = 0
    read_wait_s: float = 0.0

    @property
    def steps_per_s(self) -> float:
        """Steps replayed per second of :attr:`replay_s` (0.0 when nothing was replayed)."""
        return self.replayed / self.replay_s if self.replayed and self.replay_s > 0 else 0.0

    @property
    def read_mib_per_s(self) -> float:
        """Encoded segment MiB read per second of :attr:`replay_s`."""
        return self.read_bytes / 2**20 / self.replay_s if self.replay_s > 0 else 0.0


class _Decoder:
    """Rebuilds the dense gradients of a step recorded as codec payloads, on the parameters'
    device (where training decoded them), and remembers each parameter's last payload."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names
        self.codecs: dict[str, Codec] = {}
        self.last: dict[str, Any] = {}

    def codec(self, config: dict[str, Any]) -> Codec:
        key = json.dumps(config, sort_keys=True)
        if key not in self.codecs:  # a race between two threads builds it twice: both decode alike
            self.codecs[key] = codec_from_config(config)
        return self.codecs[key]

    def grad(self, codec: Codec, p: torch.Tensor, payload: dict[str, torch.Tensor]
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The gradient of ``p`` and the payload on ``p``'s device (for :attr:`last`, once applied)."""
        payload = {k: t.to(p.device) for k, t in payload.items()}
        return codec.decode(payload, p.shape, p.dtype), payload


@dataclass
class _Ready:
    """An event's gradients as ``.grad`` takes them (per param group, ``None``: no gradient)
    and, for a compressed step, each parameter's payload on its device, by name."""

    grads: list[list[torch.Tensor | None]]
    payloads: dict[str, dict[str, torch.Tensor]]


def _ready(event: dict[str, Any], optimizers: list[torch.optim.Optimizer], step: int,
           decoder: _Decoder) -> _Ready:
    """Check an event against the optimizers and build its gradients as the optimizer consumed
    them: decoded on each parameter's device, in its dtype, clipped as recorded. Changes nothing
    else, so it may run ahead on a prefetch thread."""
    index = event["optimizer"]
    if index >= len(optimizers):
        raise IncompatibleCheckpointError(
            f"step {step} used optimizer {index} but only {len(optimizers)} are configured")
    opt = optimizers[index]
    if len(event["groups"]) != len(opt.param_groups):
        raise IncompatibleCheckpointError(
            f"step {step}: optimizer {index} had {len(event['groups'])} param groups in training, "
            f"{len(opt.param_groups)} now; configure the same param groups")
    coded = "payloads" in event
    codec = decoder.codec(event["codec"]) if coded else None
    ready = _Ready([], {})
    for group, grads in zip(opt.param_groups, event["payloads" if coded else "grads"]):
        if len(grads) != len(group["params"]):
            raise IncompatibleCheckpointError(
                f"step {step}: a param group of optimizer {index} had {len(grads)} parameters in "
                f"training, {len(group['params'])} now; the model or optimizer differs")
        out: list[torch.Tensor | None] = []
        for p, g in zip(group["params"], grads):
            if codec is not None and g is not None:
                g, ready.payloads[decoder.names.get(id(p), "")] = decoder.grad(codec, p, g)
            elif is_split(g):
                g = _widened(g, p.device, step)
            if g is not None and g.shape != p.shape:
                raise IncompatibleCheckpointError(
                    f"step {step}: gradient of shape {tuple(g.shape)} for a parameter of shape "
                    f"{tuple(p.shape)}; the model differs from the one trained")
            # A recorded gradient has the parameter's device and dtype: .to returns it as it is,
            # a view of the segment read, which step() only reads.
            out.append(None if g is None else g.to(device=p.device, dtype=p.dtype))
        ready.grads.append(out)
    if coded:  # the decoded gradients are new tensors: clipping them here changes nothing else
        clip_tensors([g for grads in ready.grads for g in grads if g is not None], event.get("clip"))
    return ready


def _widened(split: dict[str, torch.Tensor], device: torch.device, step: int) -> torch.Tensor:
    """A row-split gradient (``narrowing.py``) as the float32 gradient the step consumed."""
    try:
        return widened(split, device)
    except ValueError as exc:
        raise CorruptRecordError(f"step {step}: {exc}; the record was not written by this format's writer "
                                 "(restore an earlier step, or check the run root's files with diffckpt verify)") from None


def _apply_event(event: dict[str, Any], ready: _Ready, optimizers: list[torch.optim.Optimizer],
                 decoder: _Decoder) -> None:
    """Set the hyperparameters in force, install the gradients, step."""
    opt = optimizers[event["optimizer"]]
    for group, hyper, grads in zip(opt.param_groups, event["groups"], ready.grads):
        group.update(hyper)
        for p, g in zip(group["params"], grads):
            p.grad = g
    decoder.last.update(ready.payloads)
    opt.step()


class _Preparer:
    """Readies records for replay (a :class:`~diffckpt.prefetch.Preparer`, on a prefetch thread
    when replay reads ahead): the events' gradients (:func:`_ready`) and a copy of the framework
    state, which outlives the segment it was read from.

    Only events whose parameters are all on the CPU are readied ahead. On an accelerator the
    payloads would be moved and decoded on the prefetch thread's current stream, not on the one
    replay runs on, so :func:`replay` readies those itself, on its own thread. A session without
    a codec has nothing to decode, only 16-bit gradients to widen: its records are prepared on
    the replay thread (:attr:`ahead`). Widening them ahead on a thread of its own made replay at
    GPT-2 124M slower on two cores (20-26 s for 12 steps, against 13.4 s): both are memory-bound.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer], decoder: _Decoder, coded: bool) -> None:
        self.optimizers = optimizers
        self.decoder = decoder
        params = [[p for group in opt.param_groups for p in group["params"]] for opt in optimizers]
        self.on_cpu = [all(p.device.type == "cpu" for p in ps) for ps in params]
        self.dense_bytes = [sum(p.numel() * p.element_size() for p in ps) for ps in params]
        self.ahead = coded and any(self.on_cpu)

    def size(self, record: dict[str, Any]) -> int:
        """The record's tensors (views of its segment) and, for a compressed step, the dense
        gradients decoded from them."""
        decoded = sum(self.dense_bytes[e["optimizer"]] for e in record["events"]
                      if "payloads" in e and e["optimizer"] < len(self.dense_bytes))
        return tree_nbytes(record) + decoded

    def prepare(self, record: dict[str, Any]) -> dict[str, Any]:
        step = record["step"]
        with torch.no_grad():
            ready = [_ready(e, self.optimizers, step, self.decoder)
                     if e["optimizer"] < len(self.on_cpu) and self.on_cpu[e["optimizer"]] else None
                     for e in record["events"]]
        return dict(record, ready=ready, state=clone_tree(record.get("state")))


_PROGRESS: contextvars.ContextVar[Callable[[int, int], None] | None] = contextvars.ContextVar(
    "diffckpt_replay_progress", default=None)


@contextlib.contextmanager
def replay_progress(callback: Callable[[int, int], None]) -> Iterator[None]:
    """Call ``callback(steps replayed, steps to replay)`` after each step replayed inside the
    block (progress bars of the CLI; no plumbing through every caller of :func:`replay`)."""
    token = _PROGRESS.set(callback)
    try:
        yield
    finally:
        _PROGRESS.reset(token)


def replay(store: RunStore, plan: RestorePlan, target: ReplayTarget | torch.nn.Module,
           optimizers: list[torch.optim.Optimizer], verify: bool = True,
           loaded: tuple[dict[str, Any], Any] | None = None, fetching: Prefetcher[Any, Any] | None = None
           ) -> ReplayResult:
    """Restore ``target`` and ``optimizers`` to ``plan.target`` (or the newest good step before it).

    For a plan made for the newest step (``plan.latest``), damage after the base stops replay at
    the newest intact restorable step with a warning. For an explicit step, damage raises.
    ``loaded`` is the base's ``(commit info, state tree)`` if the caller already read it
    (:func:`diffckpt.planning.open_plan`), and ``fetching`` the reads of its records it began
    meanwhile (:meth:`RunStore.fetch_records`).

    On :class:`IncompatibleCheckpointError` raised before replay starts (a different model or
    optimizer), ``target`` and ``optimizers`` are untouched. An error raised during replay
    (:class:`ReplayMismatchError`, damage for an explicit step) leaves them partly replayed:
    restore again or discard them.
    """
    where = base_where(store, plan)
    if isinstance(target, torch.nn.Module):
        target = ReplayTarget.from_module(target)
    meta = store.session_meta(plan.base.gen)
    info, base = loaded if loaded is not None else read_base_into(store, plan, target, optimizers, meta)
    load_into(target, optimizers, base, where, meta)
    order = [name for name, _ in meta.get("parameters") or []]
    # Fingerprints hash the parameters in training's order, whatever order the model uses now.
    params = ([target.params[n] for n in order] if sorted(order) == sorted(target.params)
              else list(target.params.values()))
    if verify and info.get("fingerprint") and not fingerprint_matches(params, info["fingerprint"]):
        raise ReplayMismatchError(
            f"{where}: loaded parameters do not match the fingerprint of step {plan.base.step}; "
            "the model's parameters differ from the ones trained (definition, dtype or device)")
    buffers = target.buffers
    result = ReplayResult(step=plan.base.step, state=base["state"], replayed=0, base_step=plan.base.step,
                          codec_config=meta.get("codec"), codec_states=base.get("codec"),
                          codec_payloads=dict(base.get("codec_payloads") or {}),
                          verified_through=plan.base.step if verify and info.get("fingerprint") else None)
    decoder = _Decoder({id(p): n for n, p in target.params.items()})
    report = _PROGRESS.get()
    decoder.last.update(result.codec_payloads)  # a compacted base carries the payloads before it
    last_applied = plan.base.step
    started, read = time.perf_counter(), ReadStats()
    records = store.read_records(plan, stats=read, fetching=fetching,
                                 prepare=_Preparer(optimizers, decoder, coded=bool(meta.get("codec"))))
    # closing: an error raised here stops the segment reads running ahead at once, not at GC
    with torch.no_grad(), contextlib.closing(records):
        for record, problem in records:
            if problem is not None or record is None:
                result.problems.append(problem or "no record")
                break
            step = record["step"]
            for event, ready in zip(record["events"], record["ready"]):
                if ready is None:
                    ready = _ready(event, optimizers, step, decoder)
                with torch.enable_grad():
                    _apply_event(event, ready, optimizers, decoder)
            for opt, groups in zip(optimizers, record["param_groups"]):
                for group, hyper in zip(opt.param_groups, groups):
                    group.update(hyper)
            for name, value in (record.get("buffers") or {}).items():
                if name not in buffers:
                    raise IncompatibleCheckpointError(
                        f"step {step} recorded buffer {name!r} that the model does not have")
                buffers[name].copy_(value)
            if verify and record.get("fingerprint"):
                if not fingerprint_matches(params, record["fingerprint"]):
                    raise ReplayMismatchError(
                        f"replayed parameters at step {step} do not match the fingerprint recorded in "
                        "training; replay must use the same optimizer class, implementation "
                        "(foreach/fused) and device type as training")
                result.verified_through = step
            last_applied = step
            result.replayed += 1
            if report is not None:
                report(result.replayed, plan.target - plan.base.step)
            if record.get("state") is not None:
                result.step, result.state = step, record["state"]
                result.codec_payloads = dict(decoder.last)
    for p in params:
        p.grad = None
    # The payloads replayed are views of the segments read: the result gets copies of its own.
    result.codec_payloads = clone_tree(result.codec_payloads)
    result.read_bytes, result.read_wait_s = read.bytes, read.wait_s
    result.replay_s = time.perf_counter() - started
    if result.problems:
        if not plan.latest:
            raise CorruptRecordError(
                f"cannot rebuild step {plan.target}: {result.problems[0]}. Restore an earlier step "
                f"(newest intact: {result.step})")
        warnings.warn(f"diffckpt: {result.problems[0]}; restoring step {result.step}, the newest "
                      "intact step before it", stacklevel=2)
    if last_applied != result.step:
        # Replay went past the last restorable point (damage after stateless records): redo it.
        redone = replay(store, _replace(plan, target=result.step, latest=False), target, optimizers, verify)
        redone.read_bytes += result.read_bytes
        redone.read_wait_s += result.read_wait_s
        redone.replay_s = time.perf_counter() - started  # both passes and the base loaded again
        result = redone
    if not plan.latest and result.step != plan.target:
        raise CheckpointNotFoundError(
            f"step {plan.target} is not a restorable step under {store.storage.url} (restorable "
            f"steps are those recorded with every_n_steps); nearest below: {result.step}")
    return result
