"""Whether a checkpoint was written for this model and these optimizers: the one check every
restore makes before it loads anything (replay onto a module, a replayed state onto live,
possibly sharded, parameters), so that a mismatch leaves the model and optimizers untouched."""

from __future__ import annotations

from typing import Any

import torch

from .errors import IncompatibleCheckpointError

__all__ = ["check_optimizers", "model_problems", "qualname", "saved_groups"]


def qualname(obj: object) -> str:
    """The import path of ``obj``'s class, as a session records its optimizers."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def model_problems(own: dict[str, Any], saved: dict[str, Any], dtypes: bool = True) -> list[str]:
    """What differs between this model's state dict ``own`` and a checkpoint's ``saved``: keys
    either side lacks, and tensor shapes (and, with ``dtypes``, dtypes). At most six."""
    problems = [f"{k!r} is in the checkpoint, not in this model" for k in saved if k not in own][:3]
    problems += [f"{k!r} is in this model, not in the checkpoint" for k in own if k not in saved][:3]
    for k, mine in own.items():
        theirs = saved.get(k)
        if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor) and (
                mine.shape != theirs.shape or (dtypes and mine.dtype != theirs.dtype)):
            problems.append(f"{k!r} is {theirs.dtype}{list(theirs.shape)} in the checkpoint, "
                            f"{mine.dtype}{list(mine.shape)} here")
    return problems[:6]


def check_optimizers(optimizers: list[torch.optim.Optimizer], saved_groups: list[list[int]],
                     meta: dict[str, Any], names: dict[int, str], where: str) -> None:
    """Raise :class:`IncompatibleCheckpointError` unless ``optimizers`` are those of training.

    ``saved_groups``: each saved optimizer's parameter count per param group; ``meta``: the
    session's record (the optimizer classes and each group's parameter names, in order);
    ``names``: this model's parameter names by ``id``.
    """
    if len(optimizers) != len(saved_groups):
        raise IncompatibleCheckpointError(
            f"{where} holds {len(saved_groups)} optimizer(s) but {len(optimizers)} were given; "
            "configure the same optimizers as in training")
    classes = meta.get("optimizers") or []
    recorded = meta.get("optimizer_params") or []
    for i, (opt, groups) in enumerate(zip(optimizers, saved_groups)):
        if i < len(classes) and classes[i] != qualname(opt):
            raise IncompatibleCheckpointError(
                f"{where} was written with optimizer {i} of class {classes[i]}, not {qualname(opt)}; "
                "replay needs the optimizer class used in training")
        if len(groups) != len(opt.param_groups):
            raise IncompatibleCheckpointError(
                f"{where}: optimizer {i} ({type(opt).__name__}) had {len(groups)} param group(s) in "
                f"training, {len(opt.param_groups)} now; configure the same param groups")
        for j, (then, now) in enumerate(zip(groups, opt.param_groups)):
            if then != len(now["params"]):
                raise IncompatibleCheckpointError(
                    f"{where}: param group {j} of optimizer {i} had {then} parameters "
                    f"in training, {len(now['params'])} now; the model or optimizer differs")
            if i < len(recorded) and j < len(recorded[i]):
                mine = [names.get(id(p), "") for p in now["params"]]
                for k, (a, b) in enumerate(zip(recorded[i][j], mine)):
                    if a != b:
                        raise IncompatibleCheckpointError(
                            f"{where}: param group {j} of optimizer {i} holds {b!r} at position {k}, "
                            f"but {a!r} in training; optimizer state is matched by position, so build "
                            "the optimizer from the parameters in the order used in training")


def saved_groups(optimizer_states: list[dict[str, Any]]) -> list[list[int]]:
    """Each saved optimizer state dict's parameter count per param group."""
    return [[len(g["params"]) for g in sd["param_groups"]] for sd in optimizer_states]
