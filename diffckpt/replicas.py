"""Blocks several ranks hold (replicas): HSDP's replicate dim, a layer outside the
tensor-parallel plan over the tensor-parallel ranks. Each is recorded once, by its *owner*, the
lowest rank holding it; the others record an empty tensor in its place and skip its gradients
(replay then leaves it alone), and a restore at the same layout takes it from the owner's stream
(:func:`diffckpt.reassembly.with_replicas`). The replicas' bits are compared at every base
(:meth:`diffckpt.coordination.Coordination.check_replicas`), since the run could not resume as it
trained if they differed. See ``docs/sharded.md``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .checksums import fingerprint
from .sharding import local

__all__ = ["assign_owners", "not_owned", "recorded_pieces", "replica_problems", "replica_sums", "without_replicas"]


def assign_owners(tables: list[dict[str, dict[str, Any]]]) -> list[dict[str, dict[str, Any]]]:
    """Every rank's shard table, a replicated block's entry naming its ``owner`` (the lowest
    rank holding it, the one that records it) and its ``replicas`` (every rank holding it).

    Ranks hold the same block of a parameter when its offset and shape are the same (HSDP's
    replicate dim; a layer outside the tensor-parallel plan, over the tensor-parallel ranks).
    A block held by one rank gets neither key, nor does an empty one (trailing ranks of an uneven
    split hold empty pieces at the same offset: nothing to record, nothing to take from another
    stream), so a 1-D FSDP2 table is written as before.
    """
    out = [{n: dict(e) for n, e in t.items()} for t in tables]
    for name in tables[0]:
        groups: dict[tuple[Any, ...], list[int]] = {}
        for r, t in enumerate(tables):
            if math.prod(t[name]["local_shape"]):
                groups.setdefault((tuple(t[name]["offset"]), tuple(t[name]["local_shape"])), []).append(r)
        for ranks in groups.values():
            if len(ranks) > 1:
                for r in ranks:
                    out[r][name].update(owner=ranks[0], replicas=ranks)
    return out


def not_owned(table: dict[str, dict[str, Any]], rank: int) -> set[str]:
    """The parameters whose block ``rank`` holds but another rank records (its replicas')."""
    return {n for n, e in table.items() if e.get("owner", rank) != rank}


def recorded_pieces(module: torch.nn.Module, skip: set[str]) -> list[torch.Tensor]:
    """This rank's piece of every parameter, in order, as its records and bases hold them: empty
    for those another rank records (``skip``: :func:`not_owned`)."""
    return [local(p).detach().new_empty(0) if n in skip else local(p).detach() for n, p in module.named_parameters()]


def without_replicas(tree: dict[str, Any], skip: set[str], module: torch.nn.Module,
                     optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """A base's tree of this rank's pieces without the blocks another rank records (``skip``):
    an empty tensor for such a parameter, no optimizer state for it; replay then leaves it
    alone (its gradients are skipped too), and a restore takes it from its owner's stream."""
    if not skip:
        return tree
    names = {id(p): n for n, p in module.named_parameters()}
    order = [[names.get(id(p), "") for g in o.param_groups for p in g["params"]] for o in optimizers]
    model = {k: v.new_empty(0) if k in skip else v for k, v in tree["model"].items()}
    states = [dict(sd, state={i: e for i, e in sd["state"].items() if order[o][int(i)] not in skip})
              for o, sd in enumerate(tree["optimizers"])]
    return dict(tree, model=model, optimizers=states)


def replica_sums(module: torch.nn.Module, table: dict[str, dict[str, Any]]) -> dict[str, tuple[list[int], str]]:
    """Per replicated block held here: its replicas (ranks) and its fingerprint (XXH3-128 of its
    bytes in order, :func:`diffckpt.checksums.fingerprint`): equal on every replica exactly when
    their bits agree, where a sum of the bits would miss differences that cancel (one element an
    ulp up, another an ulp down, as nondeterministic kernels leave them)."""
    return {name: (table[name]["replicas"], fingerprint([local(p).detach()]))
            for name, p in module.named_parameters() if "replicas" in table.get(name, {})}


def replica_problems(sums: list[dict[str, tuple[list[int], str]]]) -> list[str]:
    """Every replicated block whose replicas disagree (``sums``: each rank's
    :func:`replica_sums`, in rank order), named with the ranks on each side."""
    groups: dict[tuple[str, tuple[int, ...]], dict[str, list[int]]] = {}
    for rank, mine in enumerate(sums):
        for name, (replicas, value) in mine.items():
            groups.setdefault((name, tuple(replicas)), {}).setdefault(value, []).append(rank)
    problems = []
    for (name, _), by_value in groups.items():
        if len(by_value) > 1:
            sides = " against ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
                                     for rs in by_value.values())
            problems.append(f"{name!r} ({sides})")
    return problems
