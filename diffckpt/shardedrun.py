"""A sharded run on storage: the run root's sessions and one stream per rank, and how a step is
found, replayed and reassembled from them.

Sharded training (FSDP2) writes, per session, a root session file naming the world size
(``"sharded": {"world_size": N}``) and, under ``ranks/r<rank>/``, each rank's own stream: an
ordinary run (sessions, bases, segments, as in ``docs/format.md``) of that rank's pieces as plain
tensors, plus the shard table in its session file. Nothing is exchanged between ranks per step:

- a step is **durable** once every rank's stream has it; the newest such step of a session is the
  smallest of the ranks' newest durable steps, computed here from listings alone;
- each rank replays its own stream on plain tensors (the optimizers' steps are elementwise, so
  replaying a piece equals replaying the whole and cutting it), which is how both a same-layout
  resume (in parallel, one stream per rank) and a reassembly into full tensors (any other layout,
  offline tools) work.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from .errors import (
    CheckpointNotFoundError,
    CorruptRecordError,
    DiffCkptError,
    IncompatibleCheckpointError,
)
from .inventory import Inventory
from .rankstreams import RANKS_DIR, rank_prefix
from .runstore import RunStore, session_path
from .storage import Storage
from .storage.prefixed import substorage

if TYPE_CHECKING:  # torch and the modules that use it are imported where tensors are handled:
    import torch  # reading a run's layout (`diffckpt ls`, `gc`) does without them


__all__ = ["Resolution", "ShardedRun", "load_into_live", "modules_of", "rank_streams"]

log = logging.getLogger("diffckpt")


@dataclass(frozen=True)
class Resolution:
    """A step of a sharded session: its generation, world size and step."""

    gen: int
    world_size: int
    step: int


class ShardedRun:
    """The sharded sessions of the run root at ``storage`` and their rank streams."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.root = RunStore(storage)
        self._streams: dict[int, RunStore] = {}

    def stream(self, rank: int) -> RunStore:
        """Rank ``rank``'s stream (a run of its own, under ``ranks/r<rank>/``)."""
        if rank not in self._streams:
            self._streams[rank] = RunStore(substorage(self.storage, rank_prefix(rank)))
        return self._streams[rank]

    def world(self, gen: int) -> int | None:
        """The world size of root session ``gen`` if it is sharded, else ``None``."""
        try:
            meta = json.loads(self.storage.read(session_path(gen)))
        except (CheckpointNotFoundError, ValueError, RecursionError):
            return None  # damaged or vanished: not readable as a sharded session
        sharded = meta.get("sharded") if isinstance(meta, dict) else None
        if isinstance(sharded, dict) and isinstance(sharded.get("world_size"), int):
            return sharded["world_size"]
        return None

    def sessions(self, inv: Inventory | None = None) -> dict[int, int]:
        """``{gen: world size}`` of the root's sharded sessions (none without rank streams)."""
        inv = inv or self.root.inventory()
        if not any(p.startswith(RANKS_DIR + "/") for p in inv.sizes):
            return {}
        return {gen: w for gen in inv.sessions if (w := self.world(gen)) is not None}

    def inventories(self, world: int) -> list[Inventory]:
        return [self.stream(r).inventory() for r in range(world)]

    @staticmethod
    def durable(gen: int, invs: list[Inventory]) -> int | None:
        """The newest step of session ``gen`` that every rank's stream rebuilds (``None``: none).

        Not simply the smallest of the ranks' newest steps: a rank ahead may no longer reach
        that step (its older base compacted away), so the spans every rank reaches are
        intersected."""
        common = invs[0].durable_spans(gen) if invs else []
        for inv in invs[1:]:  # merged, sorted spans: their pairwise overlaps stay sorted
            common = [(max(a, c), min(b, d)) for a, b in common for c, d in inv.durable_spans(gen)
                      if max(a, c) <= min(b, d)]
        return common[-1][1] if common else None

    @staticmethod
    def reaches(gen: int, step: int, invs: list[Inventory]) -> bool:
        """Whether every rank's stream of session ``gen`` rebuilds ``step``."""
        return all(any(b.gen == gen and b.step <= step <= inv.chain_end(b) for b in inv.bases) for inv in invs)

    def resolve(self, step: int | None = None) -> Resolution | None:
        """The sharded session and step to restore for ``step`` (``None``: the newest step durable
        on every rank of the newest session that has one), or ``None`` when the step belongs to an
        unsharded session of the root (restored as usual).

        Raises:
            CheckpointNotFoundError: nothing is durable on every rank, or ``step`` is not.
        """
        if not self.storage.list(RANKS_DIR + "/"):
            return None  # no rank streams: an ordinary run (one listing of an empty prefix)
        top = self.root.inventory()
        plain = {b.gen for b in top.bases}
        seen: dict[int, list[Inventory]] = {}
        spans = []
        for gen in sorted(set(top.sessions) | plain, reverse=True):  # newest first, read lazily
            world = None if gen in plain else self.world(gen)
            if world is None:
                if gen not in plain:
                    continue  # a session that never committed a base at the root
                if step is None or any(self.root._plan_for(top, b, step) for b in top.bases if b.gen == gen):
                    return None
                continue
            invs = seen.setdefault(world, self.inventories(world))
            newest = self.durable(gen, invs)
            spans.append(f"g{gen} ({world} ranks): {'none' if newest is None else f'up to {newest}'}")
            if step is None and newest is not None:
                return Resolution(gen, world, newest)
            if step is not None and self.reaches(gen, step, invs):
                return Resolution(gen, world, step)
        what = "no step is durable on every rank" if step is None else f"step {step} is not durable on every rank"
        raise CheckpointNotFoundError(
            f"{what} under {self.storage.url} (durable everywhere: {'; '.join(spans) or 'none'}). "
            "A rank's stream is behind or damaged: see `diffckpt ls`; restore an earlier step")

    # ------------------------------------------------------------------ replay
    def replay_rank(self, res: Resolution, rank: int, upto: int, *, exact: bool, device: str = "cpu",
                    verify: bool = True, allow_modules: tuple[str, ...] = ("torch.",)) -> dict[str, Any]:
        """Replay rank ``rank``'s stream of ``res.gen`` on plain tensors up to ``upto``: exactly
        (damage raises) or, if not ``exact``, to the newest intact restorable step before damage.

        Returns what :func:`diffckpt.load_state` returns, for this rank's pieces.
        """
        from .loading import replay_plan

        store = self.stream(rank)
        where = f"rank {rank} ({rank_prefix(rank)})"
        problems = []
        # Warnings and errors name the rank: every stream's objects have the same names.
        caught: list[warnings.WarningMessage] = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for plan in store.candidates(upto, gen=res.gen):
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
                text = str(w.message).removeprefix("diffckpt: ")
                warnings.warn(f"diffckpt: {where}: {text}", w.category, stacklevel=3)
        raise CorruptRecordError(f"{where}: no usable base for step {upto} of session g{res.gen}: "
                                 f"{'; '.join(problems)}. Restore an earlier step (see `diffckpt ls`)")

    def replay_all(self, res: Resolution, exact: bool, **kw: Any) -> list[dict[str, Any]]:
        """Every rank's pieces at one common step: ``res.step``, or (not ``exact``) the newest
        step before damage that every rank can still rebuild."""
        step, results = res.step, cast(dict[int, dict[str, Any]], {})
        while True:
            for r in range(res.world_size):
                if r not in results or results[r]["step"] != step:
                    results[r] = self.replay_rank(res, r, step, exact=exact or step != res.step, **kw)
            low = min(x["step"] for x in results.values())
            if all(x["step"] == low for x in results.values()):
                return [results[r] for r in range(res.world_size)]
            step = low  # a rank's stream is damaged before the others' end: all go back to its step

    def full_state(self, res: Resolution, pieces: list[dict[str, Any]]) -> dict[str, Any]:
        """Full tensors from every rank's pieces (as :func:`diffckpt.load_state` returns them).

        The pieces are consumed one tensor at a time (each is dropped once its full tensor is
        built), so memory holds about one copy of the state, plus one tensor, not two."""
        import torch

        from .sharding import assemble

        metas = [self.stream(r).session_meta(res.gen) for r in range(res.world_size)]
        tables = [m.get("shards") or {} for m in metas]
        names = [n for n, _ in metas[0]["parameters"]]
        for r, table in enumerate(tables):
            if sorted(table) != sorted(names):
                raise CorruptRecordError(f"rank {r}'s session g{res.gen} has no shard table for every parameter; "
                                         "the run cannot be reassembled")

        def full(name: str, values: list[torch.Tensor]) -> torch.Tensor:
            return assemble([(v, t[name]["offset"]) for v, t in zip(values, tables)], tables[0][name]["shape"])

        model = {}
        for key in list(pieces[0]["model"]):
            values = [p["model"].pop(key) for p in pieces]
            model[key] = full(key, values) if key in tables[0] else values[0]  # buffers are whole
        optimizers = []
        for o, sd in enumerate(pieces[0]["optimizers"]):
            order = [n for group in metas[0]["optimizer_params"][o] for n in group]
            state: dict[Any, Any] = {}
            for i, entries in sd["state"].items():
                name, shard = order[int(i)], tables[0][order[int(i)]]
                state[i] = {}
                for k, v in list(entries.items()):
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        if list(v.shape) != shard["local_shape"]:
                            raise IncompatibleCheckpointError(
                                f"optimizer {o} keeps {k!r} of {name!r} in a shape other than the parameter's "
                                f"({list(v.shape)}, piece {shard['local_shape']}); only optimizers whose state "
                                "is elementwise can be reassembled")
                        v = full(name, [p["optimizers"][o]["state"][i].pop(k) for p in pieces])
                    state[i][k] = v
            optimizers.append({"state": state, "param_groups": sd["param_groups"]})
        out = dict(pieces[0], model=model, optimizers=optimizers)
        out["parameters"] = [[n, tables[0][n]["shape"]] for n in names]
        return out

    def load_full(self, step: int | None = None, **kw: Any) -> dict[str, Any] | None:
        """Full tensors of ``step`` (``None``: newest durable on every rank), or ``None`` when the
        step lies in an unsharded session."""
        res = self.resolve(step)
        if res is None:
            return None
        return self.full_state(res, self.replay_all(res, exact=step is not None, **kw))


def load_into_live(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer], state: dict[str, Any],
                   *, pieces: bool) -> None:
    """Load a replayed state into a live ``module`` and ``optimizers`` (sharded or not).

    ``state`` is what :func:`diffckpt.load_state` (or :meth:`ShardedRun.replay_rank`) returns;
    with ``pieces`` its tensors are this rank's pieces already, else full tensors, cut here to
    what each live parameter holds. The recorded optimizer classes and the order of their
    parameters are checked before anything is loaded.

    Raises:
        IncompatibleCheckpointError: another model or optimizer; nothing is loaded then.
    """
    import torch

    from .sharding import local, piece, sharded_like

    params = dict(module.named_parameters())
    own = module.state_dict()
    problems = [f"{k!r} is in the checkpoint, not in this model" for k in state["model"] if k not in own][:3]
    problems += [f"{k!r} is in this model, not in the checkpoint" for k in own if k not in state["model"]][:3]
    for k, v in state["model"].items():
        mine = params.get(k)
        if mine is not None and list((local(mine) if pieces else mine).shape) != list(v.shape):
            problems.append(f"{k!r} is {list(v.shape)} in the checkpoint, {list(mine.shape)} here")
    classes, order = state.get("optimizer_classes") or [], state.get("optimizer_params") or []
    names = {id(p): n for n, p in params.items()}
    if len(optimizers) != len(state["optimizers"]):
        problems.append(f"{len(state['optimizers'])} optimizer(s) in the checkpoint, {len(optimizers)} given")
    for i, opt in enumerate(optimizers):
        cls = f"{type(opt).__module__}.{type(opt).__qualname__}"
        if i < len(classes) and classes[i] != cls:
            problems.append(f"optimizer {i} was {classes[i]} in training, {cls} here")
        mine_order = [[names.get(id(p), "") for p in g["params"]] for g in opt.param_groups]
        if i < len(order) and mine_order != order[i]:
            problems.append(f"optimizer {i}'s param groups hold other parameters (or another order) than in training")
    if problems:
        raise IncompatibleCheckpointError(
            f"the checkpoint was written for a different model or optimizer: {'; '.join(problems[:6])}. Restore "
            "it with the model and optimizers it was trained with")
    with torch.no_grad():
        for k, v in state["model"].items():
            target = params.get(k, own[k])
            local(target).copy_(v if pieces else piece(v, target))
    for opt, sd in zip(optimizers, state["optimizers"]):
        live = [p for g in opt.param_groups for p in g["params"]]
        loaded: dict[Any, Any] = {}
        for i, entries in sd["state"].items():
            p = live[int(i)]
            loaded[int(i)] = {k: (sharded_like((v if pieces else piece(v, p)).clone(), p)
                                  if isinstance(v, torch.Tensor) and v.dim() > 0 else
                                  v.clone() if isinstance(v, torch.Tensor) else v)
                              for k, v in entries.items()}
        # load_state_dict keeps the tensors it is given (no copy): they are fresh clones above.
        opt.load_state_dict({"state": loaded, "param_groups": sd["param_groups"]})


def rank_streams(storage: Storage) -> list[str]:
    """The rank stream prefixes present under a run root (``ranks/r00000/``, ...)."""
    found = {"/".join(p.split("/", 2)[:2]) + "/" for p in storage.list("ranks/") if p.count("/") >= 2}
    return sorted(found)


def modules_of(optimizers: list[torch.optim.Optimizer]) -> tuple[str, ...]:
    """The modules of the optimizer classes in use: replay may rebuild those (and torch's)."""
    return ("torch.", *sorted({type(o).__module__ for o in optimizers}))
