"""Replay without the training code: the optimizers rebuilt from what the run recorded (class
name, param groups with their implementation flags, parameter names), so no model class is
needed. Only optimizer classes from modules named in ``allow_modules`` are imported (``torch.``
by default), never code from the run.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from .baseload import ReplayTarget
from .errors import UnsupportedConfigurationError
from .inventory import RestorePlan
from .prefetch import Prefetcher
from .replay import ReplayResult, replay
from .runstore import RunStore
from .sessionfile import recorded_device

__all__ = ["read_base_on", "replay_plan"]


def _optimizer_class(qualname: str, allow_modules: tuple[str, ...]) -> type[torch.optim.Optimizer]:
    module_name, _, cls_name = qualname.rpartition(".")
    if not any(module_name == m.rstrip(".") or module_name.startswith(m) for m in allow_modules):
        raise UnsupportedConfigurationError(
            f"the run used optimizer {qualname}; importing it needs trust: pass "
            f"allow_modules=('{module_name}',) (CLI: --allow-module {module_name})")
    cls = getattr(importlib.import_module(module_name), cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise UnsupportedConfigurationError(f"{qualname} is not a torch optimizer class")
    return cls


def read_base_on(store: RunStore, plan: RestorePlan, device: str) -> tuple[dict[str, Any], Any]:
    """``(commit info, state tree)`` of ``plan``'s base, its tensors read straight into new
    tensors on ``device``; a step's 0-dim counters stay on the CPU, where optimizers keep them.
    What :func:`replay_plan` is given."""
    info, state = store.open_base(plan.base)
    if torch.device(device).type == "cpu":
        return info, state.fill()
    tensors = [t for t in state.skeleton["model"].values() if isinstance(t, torch.Tensor)]
    tensors += [t for opt in state.skeleton["optimizers"] for entries in opt.get("state", {}).values()
                if isinstance(entries, dict) for t in entries.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    return info, state.fill({id(t): torch.empty(t.shape, dtype=t.dtype, device=device) for t in tensors})


def replay_plan(store: RunStore, plan: RestorePlan, *, device: str | None = "cpu", verify: bool = True,
                allow_modules: tuple[str, ...] = ("torch.",),
                loaded: tuple[dict[str, Any], Any] | None = None,
                fetching: Prefetcher[Any, Any] | None = None) -> dict[str, Any]:
    """Replay ``plan`` (any committed base, not only the one :func:`diffckpt.load_state` would
    choose) onto tensors and optimizers built here.

    ``diffckpt verify --deep`` replays each base up to the next one to compare them.
    ``loaded`` is the base's ``(commit info, state tree)`` if the caller already read it
    (:func:`read_base_on`): its tensors on ``device`` become the state replayed and returned,
    with no copy, and ``fetching`` the reads of its records begun meanwhile. ``device=None``: the
    device type the base's session trained on (:func:`recorded_device`).

    Returns:
        what :func:`diffckpt.load_state` returns.
    """
    meta = store.session_meta(plan.base.gen)
    device = recorded_device(meta) if device is None else device
    info, base = loaded if loaded is not None else read_base_on(store, plan, device)
    model = {k: v.to(device) for k, v in base["model"].items()}  # the base's own tensors: one copy of the state
    names = [name for name, _ in meta["parameters"]]
    aliases = meta.get("aliases") or {}
    for key, name in aliases.items():  # a tied weight is the parameter itself during replay
        model[key] = model[name]
    params = {n: model[n] for n in names}
    buffers = {k: v for k, v in model.items() if k not in params and k not in aliases}
    optimizers = []
    for qualname, opt_state, groups_names in zip(meta["optimizers"], base["optimizers"],
                                                 meta["optimizer_params"]):
        cls = _optimizer_class(qualname, allow_modules)
        groups = []
        for group, group_names in zip(opt_state["param_groups"], groups_names):
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({"params": [params[n] for n in group_names], **hyper})
        optimizers.append(cls(groups))  # type: ignore[call-arg]  # concrete classes default the rest

    def load(sd: dict[str, torch.Tensor]) -> None:
        for k, t in model.items():
            if k not in aliases:
                t.copy_(sd[k])

    result: ReplayResult = replay(store, plan, ReplayTarget(params, buffers, load), optimizers,
                                  verify=verify, loaded=(info, base), fetching=fetching)
    for key, name in aliases.items():  # a copy: files such as safetensors refuse shared tensors
        model[key] = model[name].clone()
    return {"step": result.step, "model": model, "optimizers": [o.state_dict() for o in optimizers],
            "state": result.state, "base_step": result.base_step, "replayed": result.replayed,
            "result": result, "optimizer_classes": meta["optimizers"], "optimizer_params": meta["optimizer_params"],
            "parameters": meta["parameters"]}
