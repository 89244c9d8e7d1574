"""Rebuilding a step of a sharded run: each rank's stream replayed on plain tensors (the
optimizers' steps are elementwise, so replaying a piece equals replaying the whole and cutting
it), and every rank's pieces reassembled into full tensors for another layout or offline tools.

Where the step lies (:class:`~diffckpt.shardedrun.Resolution`) is decided before, by
:func:`diffckpt.locate.locate`, from one listing of the run root that every stream's inventory
is classified from.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, cast

import torch

from .errors import (
    CheckpointNotFoundError,
    CorruptRecordError,
    DiffCkptError,
    IncompatibleCheckpointError,
)
from .offline import replay_plan
from .planning import candidates
from .rankstreams import rank_prefix
from .replicas import not_owned
from .shardedrun import Resolution, ShardedRun
from .sharding import assemble

__all__ = ["full_state", "replay_all", "replay_rank", "with_replicas"]


def replay_rank(run: ShardedRun, res: Resolution, rank: int, upto: int, *, exact: bool, device: str = "cpu",
                verify: bool = True, allow_modules: tuple[str, ...] = ("torch.",)) -> dict[str, Any]:
    """Replay rank ``rank``'s stream of ``res.gen`` on plain tensors up to ``upto``: exactly
    (damage raises) or, if not ``exact``, to the newest intact restorable step before damage.

    Returns what :func:`diffckpt.load_state` returns, for this rank's pieces.
    """
    store = run.stream(rank)
    where = f"rank {rank} ({rank_prefix(rank)})"
    problems = []
    # Warnings and errors name the rank: every stream's objects have the same names.
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for plan in candidates(store, upto, run.inventory(rank), gen=res.gen):
                try:
                    info, tree = store.load_base(plan.base)
                except (CorruptRecordError, CheckpointNotFoundError) as exc:
                    problems.append(str(exc))
                    continue
                return replay_plan(store, dataclasses.replace(plan, latest=not exact), device=device,
                                   verify=verify, allow_modules=allow_modules, loaded=(info, tree))
    except DiffCkptError as exc:
        raise type(exc)(f"{where}: {exc}") from None
    finally:  # outside the recording block: what is warned here reaches the caller
        for w in caught:
            if not str(w.message).startswith("diffckpt: "):  # not ours (a ResourceWarning of a file
                # some other code left open, collected meanwhile): passed on as it came, never
                # made to name the rank, which would make `diffckpt verify` report it as damage
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
                continue
            text = str(w.message).removeprefix("diffckpt: ")
            warnings.warn(f"diffckpt: {where}: {text}", w.category, stacklevel=3)
    raise CorruptRecordError(f"{where}: no usable base for step {upto} of session g{res.gen}: "
                             f"{'; '.join(problems)}. Restore an earlier step (see `diffckpt ls`)")

def replay_all(run: ShardedRun, res: Resolution, exact: bool, **kw: Any) -> list[dict[str, Any]]:
    """Every rank's pieces at one common step: ``res.step``, or (not ``exact``) the newest
    step before damage that every rank can still rebuild."""
    step, results = res.step, cast(dict[int, dict[str, Any]], {})
    while True:
        for r in range(res.world_size):
            if r not in results or results[r]["step"] != step:
                results[r] = replay_rank(run, res, r, step, exact=exact or step != res.step, **kw)
        low = min(x["step"] for x in results.values())
        if all(x["step"] == low for x in results.values()):
            return [results[r] for r in range(res.world_size)]
        step = low  # a rank's stream is damaged before the others' end: all go back to its step

def with_replicas(run: ShardedRun, res: Resolution, rank: int, mine: dict[str, Any], **kw: Any) -> dict[str, Any]:
    """Rank ``rank``'s replayed pieces (``mine``) completed with the blocks another rank records
    (its replicas'), taken from each such owner's stream replayed to the same step: the pieces a
    live parameter at the recorded layout holds."""
    meta = run.stream(rank).session_meta(res.gen)
    table = meta.get("shards") or {}
    owners: dict[int, set[str]] = {}
    for name in not_owned(table, rank):
        owners.setdefault(table[name]["owner"], set()).add(name)
    aliases = meta.get("aliases") or {}
    for owner, names in sorted(owners.items()):
        theirs = replay_rank(run, res, owner, mine["step"], exact=True, **kw)
        for key in list(mine["model"]):
            if aliases.get(key, key) in names:
                mine["model"][key] = theirs["model"][key]
        for o, sd in enumerate(mine["optimizers"]):
            order = [n for group in meta["optimizer_params"][o] for n in group]
            for i, entries in theirs["optimizers"][o]["state"].items():
                if order[int(i)] in names:
                    sd["state"][i] = entries
    return mine


def full_state(run: ShardedRun, res: Resolution, pieces: list[dict[str, Any]]) -> dict[str, Any]:
    """Full tensors from every rank's pieces (as :func:`diffckpt.load_state` returns them); a
    block several ranks hold is taken from the one that recorded it.

    The pieces are consumed one tensor at a time (each is dropped once its full tensor is
    built), so memory holds about one copy of the state, plus one tensor, not two."""
    metas = [run.stream(r).session_meta(res.gen) for r in range(res.world_size)]
    tables = [m.get("shards") or {} for m in metas]
    names = [n for n, _ in metas[0]["parameters"]]
    for r, table in enumerate(tables):
        if sorted(table) != sorted(names):
            raise CorruptRecordError(f"rank {r}'s session g{res.gen} has no shard table for every parameter; "
                                     "the run cannot be reassembled")

    def owners(name: str) -> list[int]:
        return [r for r, t in enumerate(tables) if t[name].get("owner", r) == r]

    def full(name: str, values: list[torch.Tensor]) -> torch.Tensor:
        return assemble([(v, tables[r][name]["offset"]) for r, v in zip(owners(name), values)],
                        tables[0][name]["shape"])

    model = {}
    for key in list(pieces[0]["model"]):
        values = [p["model"].pop(key) for p in pieces]
        model[key] = full(key, [values[r] for r in owners(key)]) if key in tables[0] else values[0]  # buffers: whole
    optimizers = []
    for o, sd in enumerate(pieces[0]["optimizers"]):
        order = [n for group in metas[0]["optimizer_params"][o] for n in group]
        state: dict[Any, Any] = {}
        for i in sorted({i for p in pieces for i in p["optimizers"][o]["state"]}, key=int):
            name = order[int(i)]
            ranks = owners(name)
            state[i] = {}
            for k, v in list(pieces[ranks[0]]["optimizers"][o]["state"][i].items()):
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    if list(v.shape) != tables[ranks[0]][name]["local_shape"]:
                        raise IncompatibleCheckpointError(
                            f"optimizer {o} keeps {k!r} of {name!r} in a shape other than the parameter's "
                            f"({list(v.shape)}, piece {tables[ranks[0]][name]['local_shape']}); only optimizers "
                            "whose state is elementwise can be reassembled")
                    v = full(name, [pieces[r]["optimizers"][o]["state"][i].pop(k) for r in ranks])
                state[i][k] = v
        optimizers.append({"state": state, "param_groups": sd["param_groups"]})
    out = dict(pieces[0], model=model, optimizers=optimizers)
    out["parameters"] = [[n, tables[0][n]["shape"]] for n in names]
    return out
