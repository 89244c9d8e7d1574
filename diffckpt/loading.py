"""Rebuild any durable step without the training code: for the CLI, exports and plain PyTorch.

The optimizer is reconstructed from what the run recorded (class name, param groups with their
implementation flags, parameter names), so no model class is needed. Only optimizer classes from
modules named in ``allow_modules`` are imported (``torch.`` by default), never code from the run.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

from .deprecation import renamed_kwargs
from .errors import UnsupportedConfigurationError
from .replay import ReplayResult, ReplayTarget, replay
from .runstore import RestorePlan, RunStore
from .storage import Storage, open_storage

__all__ = ["load_state", "replay_plan"]


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


@renamed_kwargs(url="dirpath")
def load_state(dirpath: str | os.PathLike[str] | Storage, step: int | None = None, *, device: str = "cpu",
               storage_options: dict[str, Any] | None = None, verify: bool = True,
               allow_modules: tuple[str, ...] = ("torch.",)) -> dict[str, Any]:
    """Return the state at ``step`` (newest durable if ``None``) of the run at ``dirpath`` (path,
    fsspec URL or :class:`Storage`; ``url=`` is a deprecated spelling) as plain tensors.

    Damage is handled as in :meth:`CheckpointEngine.restore`: for ``None``, the newest step that
    can be rebuilt, with a warning; for an explicit step, an error.

    A run trained sharded (FSDP2) is rebuilt from every rank's stream and returned as full
    tensors, at the newest step durable on every rank (``docs/sharded.md``).

    Returns:
        ``{"step", "model": {name: tensor}, "optimizers": [optimizer state_dict, ...],
        "state": framework state recorded at that step (rank 0's, for a sharded run),
        "base_step", "replayed", "result": the :class:`ReplayResult` (fingerprints checked,
        codec payloads, replay time), "parameters": [[name, shape], ...], "optimizer_classes",
        "optimizer_params": the parameter names of each param group}``.
    """
    storage = open_storage(dirpath, **(storage_options or {}))
    from .shardedrun import ShardedRun  # (it replays each rank's stream with replay_plan below)

    full = ShardedRun(storage).load_full(step, device=device, verify=verify, allow_modules=allow_modules)
    if full is not None:  # a sharded session: every rank's pieces, reassembled
        return full
    store = RunStore(storage)
    plan, info, base = store.open_plan(step)
    return replay_plan(store, plan, device=device, verify=verify, allow_modules=allow_modules,
                       loaded=(info, base))


def replay_plan(store: RunStore, plan: RestorePlan, *, device: str = "cpu", verify: bool = True,
                allow_modules: tuple[str, ...] = ("torch.",),
                loaded: tuple[dict[str, Any], Any] | None = None) -> dict[str, Any]:
    """Replay ``plan`` (any committed base, not only the one :func:`load_state` would choose).

    ``diffckpt verify --deep`` replays each base up to the next one to compare them.
    ``loaded`` is the base's ``(commit info, state tree)`` if the caller already read it.

    Returns:
        what :func:`load_state` returns.
    """
    info, base = loaded if loaded is not None else store.load_base(plan.base)
    meta = store.session_meta(plan.base.gen)
    model = {k: v.to(device).clone() for k, v in base["model"].items()}
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
                                  verify=verify, loaded=(info, base))
    for key, name in aliases.items():  # a copy: files such as safetensors refuse shared tensors
        model[key] = model[name].clone()
    return {"step": result.step, "model": model, "optimizers": [o.state_dict() for o in optimizers],
            "state": result.state, "base_step": result.base_step, "replayed": result.replayed,
            "result": result, "optimizer_classes": meta["optimizers"], "optimizer_params": meta["optimizer_params"],
            "parameters": meta["parameters"]}
