"""Sharded tensors (``DTensor``): what each rank holds, and full tensors from the pieces.

Under FSDP2 (``fully_shard``), HSDP (``fully_shard`` over a ``(replicate, shard)`` mesh) and
tensor parallelism (``parallelize_module``, then ``fully_shard`` over the data-parallel
sub-mesh) every parameter, gradient and optimizer state tensor is a ``DTensor``. Whatever its
placements (``Shard(d)``, ``Replicate()``, the ``_StridedShard`` that ``fully_shard`` puts over
a tensor-parallel dim), each rank's piece (``to_local()``) is one compact block of the full
tensor, cut by ``torch.chunk`` (:func:`block_of`); trailing ranks may hold empty pieces. A rank
records only its pieces, as plain tensors, so its stream is an ordinary run of plain tensors;
the *shard table* (written once per session) says where each piece sits in the full tensor, and
which rank of those holding the same block (its replicas) records it (:mod:`diffckpt.replicas`).
That is all a reader needs to reassemble or re-slice a tensor on another layout, without a
process group. See ``docs/sharded.md`` and ``docs/format.md`` section 12.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch

from .errors import UnsupportedConfigurationError
from .rankstreams import rank_prefix  # re-exported: they were defined here

__all__ = [
    "ELEMENTWISE",
    "assemble",
    "block_of",
    "check_elementwise",
    "check_sharded",
    "is_sharded",
    "local",
    "local_tree",
    "piece",
    "rank_prefix",
    "refuse_flat_parameters",
    "same_layout",
    "shard_table",
    "sharded_like",
    "slice_of",
]

try:  # torch.distributed may be built without DTensor (some minimal builds)
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - every supported torch build on CPU has it
    DTensor = Replicate = Shard = _StridedShard = None  # type: ignore[assignment,misc]


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


def _chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """``(offset, length)`` of piece ``i`` of ``torch.chunk`` of ``n`` elements into ``parts``
    (as ``Shard`` cuts: pieces of ``ceil(n / parts)``, the trailing ones short or empty)."""
    size = -(-n // parts)
    start = min(i * size, n)
    return start, min(size, n - start)


def placement_name(pl: Any) -> str:
    """A placement as the shard table writes it (``Shard(0)``, ``Replicate()``,
    ``_StridedShard(0, 2)``), or an error naming what diffckpt does not record."""
    if _StridedShard is not None and isinstance(pl, _StridedShard):
        return f"_StridedShard({pl.dim}, {pl.split_factor})"
    if isinstance(pl, Shard):
        return f"Shard({pl.dim})"
    if isinstance(pl, Replicate):
        return "Replicate()"
    raise UnsupportedConfigurationError(
        f"the placement {pl!r} is not one diffckpt records (Shard, Replicate, and the strided shard fully_shard "
        "puts over a tensor-parallel dim); parameters are never Partial in FSDP2, HSDP or tensor parallelism")


def block_of(shape: list[int] | torch.Size, mesh: list[int], coord: list[int], placements: list[Any]
             ) -> tuple[list[int], list[int]]:
    """``(local shape, offset)`` of the block of a tensor of ``shape`` that the rank at ``coord``
    of a mesh of shape ``mesh`` holds under ``placements`` (placement objects or their
    :func:`placement_name`).

    Plain shards cut in mesh order; then strided shards (``fully_shard`` over a dim that tensor
    parallelism sharded first) cut what is left, in reverse mesh order: the piece is the chunk
    by its data-parallel rank of the chunk by its tensor-parallel rank, one compact block.
    (``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` is wrong for such
    uneven splits over 3 or more data-parallel ranks in torch 2.13, so it is not used.)
    """
    offset, size = [0] * len(shape), [int(n) for n in shape]
    cuts = [(i, _parsed(pl)) for i, pl in enumerate(placements)]
    plain = [(i, d) for i, (d, strided) in cuts if d is not None and not strided]
    strided = [(i, d) for i, (d, s) in reversed(cuts) if d is not None and s]
    for i, d in plain + strided:
        start, size[d] = _chunk(size[d], mesh[i], coord[i])
        offset[d] += start
    return size, offset


def _parsed(pl: Any) -> tuple[int | None, bool]:
    """``(dim, strided)`` of a shard placement, ``(None, False)`` for ``Replicate``."""
    name = pl if isinstance(pl, str) else placement_name(pl)
    if name == "Replicate()":
        return None, False
    inner = name[name.index("(") + 1:-1].split(",")
    return int(inner[0]), name.startswith("_StridedShard")


def _check_strided(name: str, placements: Any, mesh: list[int]) -> None:
    """Refuse a strided shard other than ``fully_shard``'s over a tensor-parallel dim: its split
    factor is the number of pieces the plain shards of that dim make, which :func:`block_of`'s
    order of cuts assumes."""
    for pl in placements:
        if _StridedShard is not None and isinstance(pl, _StridedShard):
            plain = [n for q, n in zip(placements, mesh) if isinstance(q, Shard) and q.dim == pl.dim]
            if pl.split_factor != math.prod(plain):
                raise UnsupportedConfigurationError(
                    f"parameter {name!r} is laid out as {tuple(placements)} over a {mesh} mesh: a strided shard "
                    f"with split factor {pl.split_factor} where the other shards of dim {pl.dim} make "
                    f"{math.prod(plain)} pieces is not the layout fully_shard gives a tensor-parallel parameter, "
                    "and diffckpt does not record it")


def shard_table(module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Per parameter: global shape, dtype, placements, mesh shape, this rank's coordinate, its
    piece's shape and offset (the ``shards`` entry of a rank's session record, before
    :func:`assign_owners` names the rank that records each replicated block).

    Raises:
        UnsupportedConfigurationError: a placement diffckpt does not record, a piece that is
            not the block the placements say, or some parameters sharded and others not.
    """
    table = {}
    for name, p in module.named_parameters():
        p = cast(Any, p)  # a DTensor, checked here
        if not _is_dtensor(p):
            raise UnsupportedConfigurationError(
                f"parameter {name!r} is not sharded while others are; apply fully_shard to the root module "
                "too, so that every parameter is a DTensor")
        mesh = p.device_mesh
        shape, coord = list(mesh.shape), list(mesh.get_coordinate())
        placements = [placement_name(pl) for pl in p.placements]
        _check_strided(name, p.placements, shape)
        local_shape, offset = block_of(p.shape, shape, coord, placements)
        table[name] = {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch."),
                       "placements": placements, "mesh": shape, "coord": coord,
                       "local_shape": local_shape, "offset": offset}
        if list(local(p).shape) != local_shape:  # a layout we did not check
            raise UnsupportedConfigurationError(
                f"parameter {name!r}: the local piece is {list(local(p).shape)}, not the torch.chunk block "
                f"{local_shape} that {placements} over a {shape} mesh give; this layout is not supported")
    return table


def same_layout(live: dict[str, dict[str, Any]], recorded: dict[str, dict[str, Any]]) -> bool:
    """Whether a rank holds the same blocks now (``live``) as when it recorded (``recorded``)."""
    keys = ("shape", "local_shape", "offset")
    return sorted(live) == sorted(recorded) and all(
        [live[n][k] for k in keys] == [recorded[n][k] for k in keys] for n in live)


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


def slice_of(shape: list[int] | torch.Size, mesh: list[int], coord: list[int], placements: list[Any]
             ) -> tuple[slice, ...]:
    """The index of the block of a tensor of ``shape`` that the rank at ``coord`` holds
    (:func:`block_of`)."""
    size, offset = block_of(shape, mesh, coord, placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, size))


def piece(full: torch.Tensor, like: Any) -> torch.Tensor:
    """The piece of ``full`` that ``like`` (a live parameter, sharded or not) holds here."""
    if not _is_dtensor(like):
        return full
    mesh = like.device_mesh
    return full[slice_of(full.shape, list(mesh.shape), list(mesh.get_coordinate()), list(like.placements))]


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
