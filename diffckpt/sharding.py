"""Sharded tensors (FSDP2 ``DTensor``): what each rank holds, and full tensors from the pieces.

Under FSDP2 (``fully_shard``) every parameter, gradient and optimizer state tensor is a
``DTensor`` sharded along dim 0 over a 1-D mesh; each rank's piece (``to_local()``) is a compact,
unpadded ``torch.chunk`` of the full tensor, and trailing ranks may hold 0 rows. A rank records
only its pieces, as plain tensors, so its stream is an ordinary run of plain tensors; the *shard
table* (written once per session) says where each piece sits in the full tensor, which is all a
reader needs to reassemble or re-slice it on another number of processes, without a process
group. See ``docs/sharded.md`` and ``docs/format.md`` section 12.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from .errors import UnsupportedConfigurationError
from .rankstreams import rank_prefix  # re-exported: they were defined here

__all__ = [
    "ELEMENTWISE",
    "assemble",
    "check_elementwise",
    "check_sharded",
    "is_sharded",
    "local",
    "local_tree",
    "piece",
    "rank_prefix",
    "refuse_flat_parameters",
    "shard_table",
    "sharded_like",
    "slice_of",
]

try:  # torch.distributed may be built without DTensor (some minimal builds)
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover - every supported torch build on CPU has it
    DTensor = Shard = None  # type: ignore[assignment,misc]


def _is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``t`` (``t`` itself when it is not sharded)."""
    return t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined]


def local_tree(obj: Any) -> Any:
    """``obj`` with every sharded tensor replaced by this rank's piece (containers copied)."""
    if isinstance(obj, torch.Tensor):
        return local(obj)
    if isinstance(obj, dict):
        return {k: local_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [local_tree(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(local_tree(v) for v in obj)
    return obj


def refuse_flat_parameters(module: torch.nn.Module) -> None:
    """Refuse FSDP1 (``FullyShardedDataParallel``): each rank holds a different flat shard under
    plain-tensor parameters, which would look like replicated (DDP) training and be recorded as
    rank 0's alone."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - every supported torch build has it
        return
    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        raise UnsupportedConfigurationError(
            "the model is wrapped in FullyShardedDataParallel (FSDP1): its flat parameters are sharded "
            "without saying so (they are not DTensors), so each rank's record would be mistaken for the "
            "others'. diffckpt records FSDP2: shard with torch.distributed.fsdp.fully_shard instead, or use "
            "torch.distributed.checkpoint for this run")


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module``'s parameters are sharded (``fully_shard``)."""
    return any(_is_dtensor(p) for p in module.parameters())


def _check(name: str, p: Any) -> None:  # p: a DTensor parameter
    mesh, placements = p.device_mesh, tuple(p.placements)
    if mesh.ndim != 1 or len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        raise UnsupportedConfigurationError(
            f"parameter {name!r} is laid out as {placements} over a {mesh.ndim}-D mesh {tuple(mesh.shape)}; "
            "diffckpt records FSDP2 parameters sharded along dim 0 over a 1-D mesh (fully_shard on a 1-D "
            "data-parallel mesh). HSDP (replicate + shard) and tensor parallelism are not supported yet: "
            "use a 1-D mesh, or torch.distributed.checkpoint for this run")


def shard_table(module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Per parameter: global shape, dtype, placements, mesh shape, this rank's coordinate, its
    piece's shape and offset (the ``shards`` entry of a rank's session record).

    Raises:
        UnsupportedConfigurationError: a parameter is not sharded along dim 0 over a 1-D mesh
            (HSDP, tensor parallelism), or some are sharded and others not.
    """
    table = {}
    params = list(module.named_parameters())
    for name, p in params:
        p = cast(Any, p)  # a DTensor, checked below
        if not _is_dtensor(p):
            raise UnsupportedConfigurationError(
                f"parameter {name!r} is not sharded while others are; apply fully_shard to the root module "
                "too, so that every parameter is sharded")
        _check(name, p)
        world, coord = p.device_mesh.size(), p.device_mesh.get_local_rank()
        rows, offset = Shard.local_shard_size_and_offset(p.shape[0], world, coord)
        table[name] = {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch."),
                       "placements": ["Shard(0)"], "mesh": [world], "coord": [coord],
                       "local_shape": [rows, *p.shape[1:]], "offset": [offset] + [0] * (p.dim() - 1)}
        if list(local(p).shape) != table[name]["local_shape"]:  # a layout we did not check
            raise UnsupportedConfigurationError(
                f"parameter {name!r}: the local shard is {list(local(p).shape)}, not the torch.chunk piece "
                f"{table[name]['local_shape']} that dim-0 sharding gives; this layout is not supported")
    return table


# Optimizers whose step updates each element from that element's own state and gradient: replaying
# a rank's piece alone equals replaying the full tensor and cutting it, bitwise (checked for
# AdamW, see docs/notes/fsdp2.md). Norms or matrix products inside step() (LAMB, Adafactor's
# factored moments, Muon, ...) would see other tensors under another sharding.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "ASGD",
               "Rprop")


def check_elementwise(optimizers: list[torch.optim.Optimizer]) -> None:
    """Refuse optimizers whose step is not elementwise, which sharded replay cannot rebuild."""
    allowed = tuple(getattr(torch.optim, n) for n in ELEMENTWISE if hasattr(torch.optim, n))
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, allowed):
            raise UnsupportedConfigurationError(
                f"optimizer {i} is {type(opt).__name__}; under sharded training diffckpt replays each rank's "
                "piece on its own, which is exact only for optimizers that update every element from its own "
                f"state and gradient (torch.optim {', '.join(ELEMENTWISE)} and their subclasses). Use one of "
                "those, or torch.distributed.checkpoint for this run")


def slice_of(shape: list[int] | torch.Size, world: int, coord: int) -> tuple[slice, ...]:
    """The index of rank ``coord``'s piece of a tensor of ``shape`` sharded along dim 0 over
    ``world`` ranks (``torch.chunk`` pieces, as FSDP2 cuts them)."""
    rows, offset = Shard.local_shard_size_and_offset(int(shape[0]), world, coord)
    return (slice(offset, offset + rows),)


def piece(full: torch.Tensor, like: Any) -> torch.Tensor:
    """The piece of ``full`` that ``like`` (a live parameter, sharded or not) holds here."""
    if not _is_dtensor(like):
        return full
    mesh = like.device_mesh
    return full[slice_of(full.shape, mesh.size(), mesh.get_local_rank())]


def sharded_like(t: torch.Tensor, p: Any) -> torch.Tensor:
    """``t``, this rank's piece, as the ``DTensor`` laid out as ``p`` (``t`` if ``p`` is plain).

    ``shape`` and ``stride`` are given so that uneven pieces are understood without any
    exchange between ranks.
    """
    if not _is_dtensor(p):
        return t
    return DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)


def assemble(pieces: list[tuple[torch.Tensor, list[int]]], shape: list[int]) -> torch.Tensor:
    """The full tensor of ``shape`` from every rank's ``(piece, offset)``; each element is
    covered by exactly one piece (empty pieces are skipped)."""
    if not pieces:
        raise ValueError("no pieces to assemble")
    out = torch.empty(shape, dtype=pieces[0][0].dtype, device=pieces[0][0].device)
    for t, offset in pieces:
        out[tuple(slice(o, o + s) for o, s in zip(offset, t.shape))] = t
    return out


def check_sharded(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer], compressor: Any) -> dict[str, Any]:
    """The shard table of a sharded ``module``, after refusing what sharded recording cannot
    replay exactly: a codec, an optimizer whose state is not elementwise."""
    if compressor is not None:
        raise UnsupportedConfigurationError(
            "compressed training (codec=) is not supported with sharded parameters: a codec decoded per "
            "shard cannot see the global gradient, and FSDP2 has no communication hook for it. Train "
            "without a codec (diffckpt then records each rank's exact gradient pieces)")
    check_elementwise(optimizers)
    return shard_table(module)
