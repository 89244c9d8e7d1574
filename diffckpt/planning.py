"""Which base and segments rebuild a step of one stream (a plain run, or one rank's stream of a
sharded run): plans from an :class:`~diffckpt.inventory.Inventory`, best first, and the base of
the first plan that can be loaded.

Where a step lies when a run root holds sharded sessions too is decided once, above this, by
:func:`diffckpt.locate.locate`; every restore goes through it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from .errors import CheckpointNotFoundError, CorruptRecordError
from .format import BaseName
from .inventory import Inventory, RestorePlan
from .runstore import RUN_FILE, RunStore

__all__ = ["candidates", "durable_ranges", "open_plan", "plan", "plan_for"]


def plan(store: RunStore, step: int | None = None, inv: Inventory | None = None) -> RestorePlan:
    """Choose the base and segments for ``step`` (``None``: the newest durable step).

    The newest session with a committed base wins for ``None``; an explicit step is looked up
    from the newest session to the oldest. This is the first of :func:`candidates`.
    """
    return candidates(store, step, inv)[0]


def candidates(store: RunStore, step: int | None = None, inv: Inventory | None = None,
               gen: int | None = None) -> list[RestorePlan]:
    """Every plan of one session that rebuilds ``step``, best first.

    For ``None``: each committed base of the newest session with one, ordered by how far its
    chain reaches, then newest base first (least replay). For an explicit step: the bases of the
    newest session that reaches ``step``, newest first. ``gen``: only that session's. ``inv``:
    a listing already taken (else the stream is listed now).

    Raises:
        CheckpointNotFoundError: nothing is committed, or ``step`` is not durable.
    """
    inv = inv or store.inventory()
    if not inv.bases:
        raise CheckpointNotFoundError(_nothing_here(store.storage.url, inv))
    for g in inv.gens():
        if gen is not None and g != gen:
            continue
        bases = sorted((b for b in inv.bases if b.gen == g), reverse=True)
        if not bases:
            continue
        if step is None:
            plans = [RestorePlan(base, inv.chain(base), inv.chain_end(base), True) for base in bases]
            plans.sort(key=lambda p: p.target, reverse=True)  # stable: newest base first
            return _sized(plans, inv)
        found = [p for p in (plan_for(inv, b, step) for b in bases) if p is not None]
        if found:
            return _sized(found, inv)
    raise CheckpointNotFoundError(
        f"step {step} is not durable under {store.storage.url}; durable steps: {durable_ranges(inv)}. "
        "Pick one of those (see `diffckpt ls`).")


def plan_for(inv: Inventory, base: BaseName, step: int) -> RestorePlan | None:
    """The plan that rebuilds ``step`` from ``base``, or ``None`` when its chain does not reach it."""
    if base.step > step:
        return None
    if base.step == step:
        return RestorePlan(base, [], step, False)
    segs = []
    for seg in inv.chain(base):
        segs.append(seg)
        if seg.last >= step:
            return RestorePlan(base, segs, step, False)
    return None


def open_plan(store: RunStore, step: int | None = None, inv: Inventory | None = None,
              gen: int | None = None, read: Callable[[RestorePlan], tuple[dict[str, Any], Any]] | None = None
              ) -> tuple[RestorePlan, dict[str, Any], Any]:
    """Choose a plan for ``step`` (``None``: newest durable) and load its base: ``read(plan)``
    (default: :meth:`RunStore.load_base` of its base), which a restore gives to read the base
    straight into the live model (:func:`diffckpt.replay.read_base_into`).

    Returns ``(plan, commit info, base state tree)``. A base that cannot be used (its COMMIT
    marker is damaged or unreadable, its state file is missing or fails its checksum) is skipped
    with a warning, and the next of :func:`candidates` is tried: an older committed base of the
    same session that reaches ``step`` (for ``None``: the one whose chain reaches furthest, so the
    step restored may be older). For ``None``, a warning also says when committed segments of
    that session lie beyond the step chosen (a missing segment cut the chain). Steps of other
    sessions are never used in place of damaged ones. ``inv`` and ``gen`` as for
    :func:`candidates`.

    Raises:
        CheckpointNotFoundError: nothing is committed, or ``step`` is not durable.
        CorruptRecordError: no candidate base can be loaded.
    """
    inv = inv or store.inventory()
    problems: list[str] = []
    for found in candidates(store, step, inv, gen):
        try:
            info, tree = read(found) if read is not None else store.load_base(found.base)
        except (CorruptRecordError, CheckpointNotFoundError) as exc:
            problems.append(str(exc))
            continue
        if problems:
            warnings.warn(f"diffckpt: {'; '.join(problems)}; using the older base at step "
                          f"{found.base.step} instead, restoring step {found.target}", stacklevel=4)
        beyond = [s for s in inv.segments if s.gen == found.base.gen and s.last > found.target]
        if found.latest and beyond:
            warnings.warn(
                f"diffckpt: nothing continues session g{found.base.gen} after step {found.target} "
                f"(a segment is missing before {beyond[0].path}); its steps up to "
                f"{max(s.last for s in beyond)} cannot be rebuilt. Restoring step {found.target}, "
                "the newest step before the gap", stacklevel=4)
        return found, info, tree
    raise CorruptRecordError(
        f"no usable base for {'the newest step' if step is None else f'step {step}'} under "
        f"{store.storage.url}: {'; '.join(problems)}. Restore an earlier step (see `diffckpt ls`) "
        "or check the storage with `diffckpt verify`")


def durable_ranges(inv: Inventory) -> str:
    """Durable steps per session as merged ranges, e.g. ``g1: 0..5, 10..13``."""
    parts = [f"g{gen}: " + ", ".join(f"{lo}..{hi}" for lo, hi in inv.durable_spans(gen))
             for gen in sorted({b.gen for b in inv.bases})]
    return "; ".join(parts) or "none"


def _nothing_here(url: str, inv: Inventory) -> str:
    if "" in inv.sizes:  # an object at the root itself: the path names a file
        return (f"{url} is a file, not a run directory: pass the directory (or URL prefix) that "
                "the run was written to")
    if not inv.sizes:
        return (f"nothing under {url}: the path does not exist or is empty. Check the path (and "
                "storage_options for remote URLs), or train first to create the run")
    if RUN_FILE not in inv.sizes:
        return f"{url} is not a diffckpt run (it has no {RUN_FILE}): check the path"
    return (f"no committed checkpoint under {url} yet: the run never committed a base, so no "
            "step is durable. Train until the first base is written")


def _sized(plans: list[RestorePlan], inv: Inventory) -> list[RestorePlan]:
    """``plans`` with the listed size of each of their segments, which bounds prefetching."""
    for found in plans:
        found.sizes = {s.path: inv.sizes.get(s.path, 0) for s in found.segments}
    return plans
