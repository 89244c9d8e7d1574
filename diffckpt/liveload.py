"""A replayed state loaded onto live parameters, sharded or not, after a check that it was
trained with this model and these optimizers."""

from __future__ import annotations

from typing import Any

import torch

from .compat import check_optimizers, model_problems, saved_groups
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
    # Pieces are compared with this rank's pieces, full tensors with the full shapes.
    mine = {k: local(v) if pieces else v for k, v in own.items()}  # a tied alias too
    where = "the checkpoint"
    problems = model_problems(mine, state["model"], dtypes=False)
    if problems:
        raise IncompatibleCheckpointError(
            f"{where} was written for a different model: {'; '.join(problems)}. Restore it with the "
            "model definition it was trained with, or start a new run directory")
    check_optimizers(optimizers, saved_groups(state["optimizers"]),
                     {"optimizers": state.get("optimizer_classes"), "optimizer_params": state.get("optimizer_params")},
                     {id(p): n for n, p in params.items()}, where)
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
