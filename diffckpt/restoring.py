"""Rebuilding a located step: as plain tensors (:func:`load_located`, for ``load_state``, exports
and the CLI) or onto the caller's live model and optimizers (:func:`restore_live`, for
``restore`` and ``resume``). Where the step lies was decided by :func:`diffckpt.locate.locate`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from .baseload import ReplayTarget, read_base_into
from .codecs.compressor import GradientCompressor
from .inventory import RestorePlan
from .liveload import load_into_live, modules_of
from .locate import Located
from .offline import read_base_on, replay_plan
from .planning import candidates, open_plan
from .prefetch import Prefetcher
from .reassembly import full_state, replay_all
from .replay import ReplayResult, replay
from .runstore import RunStore
from .sessionfile import recorded_device

__all__ = ["load_located", "restore_live"]

log = logging.getLogger("diffckpt")


def load_located(loc: Located, *, device: str | None = "cpu", verify: bool = True,
                 allow_modules: tuple[str, ...] = ("torch.",)) -> dict[str, Any]:
    """The located step as plain tensors: what :func:`diffckpt.load_state` returns (a sharded
    session's pieces reassembled into full tensors)."""
    if loc.sharded is not None:
        pieces = replay_all(loc.run, loc.sharded, exact=loc.step is not None, device=device, verify=verify,
                            allow_modules=allow_modules)
        return full_state(loc.run, loc.sharded, pieces)
    plans = candidates(loc.store, loc.step, loc.inv)
    if device is None:  # the device type the session trained on
        device = recorded_device(_base_session(loc.store, plans))
    read, begun = _fetching_each(loc.store, lambda found: read_base_on(loc.store, found, device))
    plan, info, base = open_plan(loc.store, loc.step, loc.inv, read=read, plans=plans)
    try:
        return replay_plan(loc.store, plan, device=device, verify=verify, allow_modules=allow_modules,
                           loaded=(info, base), fetching=begun[-1])
    finally:  # read to the end, or replay stopped early: what is still fetched is dropped
        begun[-1].close()


def restore_live(loc: Located, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer], *,
                 verify: bool = True, compressor: GradientCompressor | None = None, rank: int = 0
                 ) -> tuple[ReplayResult, tuple[float, float | None] | None]:
    """Load the located step into ``module`` and ``optimizers``; see
    :meth:`diffckpt.CheckpointEngine.restore`.

    Returns the result and, for a replay in this process, ``(seconds to load the base, seconds
    per replayed step or None)`` for the auto-tuner (``None`` for a reassembled sharded step).
    """
    if loc.sharded is not None:  # written by sharded training: full tensors, cut to what is live here
        full = load_located(loc, verify=verify, allow_modules=modules_of(optimizers))
        load_into_live(module, optimizers, full, pieces=False)
        result: ReplayResult = full["result"]
        result.step, result.state = full["step"], full["state"]
        return result, None
    start = time.perf_counter()
    plans = candidates(loc.store, loc.step, loc.inv)
    target, meta = ReplayTarget.from_module(module), _base_session(loc.store, plans)
    read, begun = _fetching_each(loc.store, lambda found: read_base_into(loc.store, found, target, optimizers, meta))
    plan, info, base = open_plan(loc.store, loc.step, loc.inv, read=read, plans=plans)
    loaded = time.perf_counter()
    try:
        with compressor.paused() if compressor else contextlib.nullcontext():
            result = replay(loc.store, plan, target, optimizers, verify=verify, loaded=(info, base),
                            fetching=begun[-1])
    finally:  # read to the end, or replay stopped early: what is still fetched is dropped
        begun[-1].close()
    replayed = time.perf_counter() - loaded
    if result.step == plan.target and plan.target in {plan.base.step, *(seg.last for seg in plan.segments)}:
        result.continues = (plan.gen, plan.target, plan.base.step)
    log.info("diffckpt: restored step %d from base %d (read in %.2f s): replayed %d steps in "
             "%.2f s (%.1f steps/s, %.1f MiB/s)", result.step, result.base_step, loaded - start,
             result.replayed, result.replay_s, result.steps_per_s, result.read_mib_per_s)
    if compressor is not None:
        if result.codec_config != compressor.codec.config():  # another codec, or none, trained
            compressor.restore(None, {})
        else:
            states = result.codec_states if result.step == result.base_step else None
            compressor.restore(states[rank] if states and rank < len(states) else None, result.codec_payloads)
    return result, (loaded - start, replayed / result.replayed if result.replayed else None)


def _fetching_each(store: RunStore, read: Callable[[RestorePlan], tuple[dict[str, Any], Any]]
                   ) -> tuple[Callable[[RestorePlan], tuple[dict[str, Any], Any]], list[Prefetcher[Any, Any]]]:
    """``read`` (a candidate plan's base, for :func:`diffckpt.planning.open_plan`) with the plan's
    records read meanwhile, so that replay's first steps need not wait for them; and the reads
    begun. A base that fails drops its plan's reads and the next candidate's begin, so the last
    begun are those of the plan whose base loaded."""
    begun: list[Prefetcher[Any, Any]] = []

    def reading(found: RestorePlan) -> tuple[dict[str, Any], Any]:
        early = store.fetch_records(found)
        begun.append(early)
        try:
            return read(found)
        except BaseException:
            early.close()
            raise

    return reading, begun


def _base_session(store: RunStore, plans: list[RestorePlan]) -> dict[str, Any]:
    """What the session of the base that ``plans`` (a step's :func:`diffckpt.planning.candidates`)
    restore from recorded (for a session that continues another, that one's): read before the base,
    so that a damaged or missing session file is its own error, not a reason to try an older base
    (every candidate base is of that session)."""
    return store.session_meta(plans[0].base.gen)
