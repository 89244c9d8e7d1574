"""A replayed state loaded onto live parameters, sharded or not, after a check that it was
trained with this model and these optimizers."""

from __future__ import annotations

from typing import Any

import torch

from .errors import IncompatibleCheckpointError
from .sharding import local, piece, sharded_like

__all__ = ["load_into_live", "modules_of"]


def load_into_live(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer], state: dict[str, Any],
                   *, pieces: bool) -> None:
    """Load a replayed state into a live ``module`` and ``optimizers`` (sharded or not).

    ``state`` is what :func:`diffckpt.load_state` (or :func:`~diffckpt.reassembly.replay_rank`) returns;
    with ``pieces`` its tensors are this rank's pieces already, else full tensors, cut here to
    what each live parameter holds. The recorded optimizer classes and the order of their
    parameters are checked before anything is loaded.

    Raises:
        IncompatibleCheckpointError: another model or optimizer; nothing is loaded then.
    """
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




def modules_of(optimizers: list[torch.optim.Optimizer]) -> tuple[str, ...]:
    """The modules of the optimizer classes in use: replay may rebuild those (and torch's)."""
    return ("torch.", *sorted({type(o).__module__ for o in optimizers}))
