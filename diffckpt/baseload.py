"""Loading a base into what replay writes: the live model (:class:`ReplayTarget`) and optimizers.

A restore reads the base straight into the live tensors (:func:`read_base_into`, through
:class:`~diffckpt.basereads.BaseFile`), after checking it against them on its header alone
(:func:`check_base`); :func:`load_into` then loads what was read, which for tensors read in place
copies nothing. Everything that can be checked is checked before anything is loaded: on
:class:`~diffckpt.errors.IncompatibleCheckpointError` the model and optimizers are left as they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .compat import check_optimizers, model_problems, saved_groups
from .errors import IncompatibleCheckpointError
from .inventory import RestorePlan
from .runstore import RunStore

__all__ = ["ReplayTarget", "check_base", "load_into", "read_base_into", "where"]


@dataclass
class ReplayTarget:
    """The tensors replay writes into: parameters by name (replay and fingerprints follow the
    order training recorded), buffers by name, how to load a model state dict into them and,
    optionally, how to check one without loading it. Both raise ``RuntimeError`` for a state
    dict of another model. ``state``: the tensors a base's model state may be read into in place,
    by key (``None``: none may, the state is loaded with ``load``)."""

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    load: Any  # Callable[[dict[str, Tensor]], None]
    check: Any = None  # Callable[[dict[str, Tensor]], None]: raise RuntimeError, load nothing
    state: dict[str, torch.Tensor] | None = None

    @classmethod
    def from_module(cls, module: torch.nn.Module) -> ReplayTarget:
        # A module with load_state_dict hooks may change what it is given: it is given a copy.
        hooked = any(m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks for m in module.modules())
        return cls(dict(module.named_parameters()), dict(module.named_buffers()),
                   lambda sd: module.load_state_dict(sd, strict=True),
                   lambda sd: _check_module(module, sd), None if hooked else module.state_dict())


def _check_module(module: torch.nn.Module, sd: dict[str, Any]) -> None:
    # Checked before loading: load_state_dict copies every matching tensor before it reports
    # the mismatched ones, which would leave the module half-loaded.
    problems = model_problems(module.state_dict(), sd)
    if problems:
        raise RuntimeError("; ".join(problems))


def check_base(target: ReplayTarget, optimizers: list[torch.optim.Optimizer], base: dict[str, Any],
               where: str, meta: dict[str, Any] | None = None) -> None:
    """Raise :class:`IncompatibleCheckpointError` unless ``base`` (a base's tree, or its skeleton
    of meta tensors) was written for ``target`` and ``optimizers``.

    ``meta`` is the session's record (:meth:`RunStore.session_meta`); with it, the optimizer
    classes and the parameters of each param group are checked too.
    """
    try:
        if target.check is not None:
            target.check(base["model"])
        check_optimizers(optimizers, saved_groups(base["optimizers"]), meta or {},
                         {id(p): n for n, p in target.params.items()}, where)
    except RuntimeError as exc:
        raise _other_model(where, exc) from None


def _other_model(where: str, exc: Exception) -> IncompatibleCheckpointError:
    return IncompatibleCheckpointError(
        f"{where} was written for a different model: {exc}. Restore it with the model "
        "definition it was trained with, or start a new run directory")


def read_base_into(store: RunStore, plan: RestorePlan, target: ReplayTarget, optimizers: list[torch.optim.Optimizer],
                   meta: dict[str, Any] | None = None) -> tuple[dict[str, Any], Any]:
    """Read ``plan``'s base straight into ``target``'s tensors where it may (``target.state``)
    and the optimizer state into new tensors on each parameter's device, which
    :func:`load_into` then hands the optimizers as they are: the state crosses memory once.
    Returns ``(commit info, state tree)`` for :func:`load_into`.

    The base is checked against ``target`` and ``optimizers`` on its header alone, before
    anything is read (:func:`check_base`; a header that reads as another model's is first checked
    against the base's checksum, so that damage is called damage).

    Raises:
        IncompatibleCheckpointError: another model or optimizer; nothing was read or loaded.
        CorruptRecordError: the base is damaged. ``target``'s tensors may be partly overwritten
            by then: load another base into them (:func:`diffckpt.planning.open_plan` does), or
            discard them.
    """
    info, state = store.open_base(plan.base)
    meta = store.session_meta(plan.base.gen) if meta is None else meta
    try:
        check_base(target, optimizers, state.skeleton, where(store, plan), meta)
    except IncompatibleCheckpointError:
        state.verify()
        raise
    return info, state.fill(_destinations(target, optimizers, state.skeleton))


def _destinations(target: ReplayTarget, optimizers: list[torch.optim.Optimizer], skeleton: dict[str, Any]
                  ) -> dict[int, torch.Tensor]:
    """Where :func:`read_base_into` reads each tensor of a checked base's ``skeleton``: the live
    tensor of each model key (each live memory once: a tied weight's second key goes to a new
    tensor, which ``load`` copies), and for parameters off the CPU, new tensors on their device
    for their optimizer state. The rest is read into new CPU tensors."""
    into: dict[int, torch.Tensor] = {}
    taken: set[int] = set()
    state = target.state or {}
    for key, t in skeleton["model"].items():
        live = state.get(key)
        if (isinstance(t, torch.Tensor) and isinstance(live, torch.Tensor) and live.dtype == t.dtype
                and live.shape == t.shape and live.data_ptr() not in taken):
            into[id(t)] = live
            taken.add(live.data_ptr())
    for opt, saved in zip(optimizers, skeleton["optimizers"]):
        params = [p for group in opt.param_groups for p in group["params"]]
        for index, entries in saved.get("state", {}).items():
            device = params[index].device if isinstance(index, int) and 0 <= index < len(params) else None
            if device is None or device.type == "cpu" or not isinstance(entries, dict):
                continue
            for t in entries.values():
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    into[id(t)] = torch.empty(t.shape, dtype=t.dtype, device=device)
    return into


def where(store: RunStore, plan: RestorePlan) -> str:
    """How errors name ``plan``'s base."""
    return f"{store.storage.url} base {plan.base.step}"


def load_into(target: ReplayTarget, optimizers: list[torch.optim.Optimizer], base: dict[str, Any],
              where: str, meta: dict[str, Any] | None = None) -> None:
    """Load a base's model and optimizer states, turning mismatches into clear errors.

    ``meta`` as for :func:`check_base`. Everything that can be checked is checked before
    anything is loaded, so on :class:`IncompatibleCheckpointError` the model and optimizers are
    left as they were. Tensors the base was read into in place (:func:`read_base_into`) are
    loaded onto themselves, which copies nothing; the optimizers keep the tensors they are given.
    """
    check_base(target, optimizers, base, where, meta)
    try:
        target.load(base["model"])
    except RuntimeError as exc:
        raise _other_model(where, exc) from None
    for i, (opt, state) in enumerate(zip(optimizers, base["optimizers"])):
        try:
            opt.load_state_dict(state)
        except (ValueError, KeyError, RuntimeError) as exc:
            raise IncompatibleCheckpointError(
                f"{where}: optimizer {i} ({type(opt).__name__}) does not match the checkpoint: {exc}. "
                "Configure the same optimizer and param groups as in training") from None
