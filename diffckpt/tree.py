"""Pickle-free serialization of nested training state.

A *tree* is any nesting of dict, list, tuple, str, int, float, bool, None, bytes, torch tensors,
numpy arrays and scalars, torch dtypes and devices. :func:`pack_tree` turns it into one
safetensors buffer whose metadata holds the structure as JSON; :func:`unpack_tree` inverts it.
Nothing on the load path executes code from the file. The JSON encoding is specified in
``docs/format.md``.
"""

from __future__ import annotations

import base64
import json
import math
import struct
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import safetensors.torch
import torch

from .borrowing import ALIGN, borrowed
from .errors import CorruptRecordError, UnsupportedConfigurationError

__all__ = ["Layout", "decode_tree", "encode_tree", "header_length", "pack_tree", "portable", "read_layout",
           "read_metadata", "unpack_tree"]

_META_KEY = "diffckpt.tree"


def encode_tree(obj: Any, tensors: dict[str, torch.Tensor], path: str = "$") -> Any:
    """Return a JSON-able form of ``obj``; tensors are moved into ``tensors`` by name."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, np.generic):  # before float: np.float64 is a float subclass
        return {"npscalar": obj.dtype.str, "value": encode_tree(obj.item(), tensors, path)}
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"float": repr(obj)}
    if isinstance(obj, torch.Tensor):
        return {"tensor": _add_tensor(obj, tensors, path)}
    if isinstance(obj, np.ndarray):
        try:
            as_tensor = torch.from_numpy(obj.copy())
        except TypeError:
            raise UnsupportedConfigurationError(
                f"numpy array of dtype {obj.dtype} at {path} cannot be stored without pickle") from None
        return {"ndarray": _add_tensor(as_tensor, tensors, path)}
    if isinstance(obj, dict):
        items = [[encode_tree(k, tensors, f"{path}.key"), encode_tree(v, tensors, f"{path}[{k!r}]")]
                 for k, v in obj.items()]
        return {"dict": items}
    if isinstance(obj, list):
        return [encode_tree(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):  # torch.Size is a tuple and comes back as one
        return {"tuple": [encode_tree(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, bytes):
        return {"bytes": base64.b64encode(obj).decode("ascii")}
    if isinstance(obj, torch.dtype):
        return {"dtype": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {"device": str(obj)}
    raise UnsupportedConfigurationError(
        f"cannot store {type(obj).__qualname__} at {path} without pickle; keep checkpoint state to "
        "dicts, lists, numbers, strings and tensors (convert it in state_dict/on_save_checkpoint)"
    )


_STORABLE = {
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32,
    torch.uint64, torch.bool,
}


def _add_tensor(t: torch.Tensor, tensors: dict[str, torch.Tensor], path: str) -> str:
    if t.layout != torch.strided:
        raise UnsupportedConfigurationError(f"sparse tensor at {path} is not supported")
    if t.dtype not in _STORABLE:
        raise UnsupportedConfigurationError(
            f"tensor of dtype {t.dtype} at {path} is not supported by the checkpoint format")
    name = str(len(tensors))
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    # safetensors refuses views and shared storage: give each entry storage of its own.
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.contiguous().clone()
    tensors[name] = t
    return name


def decode_tree(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Invert :func:`encode_tree`; malformed input raises :class:`CorruptRecordError`."""
    try:
        return _decode(node, tensors)
    except CorruptRecordError:
        raise
    except Exception as exc:  # malformed nodes surface as assorted built-in errors
        raise CorruptRecordError(f"malformed state tree: {type(exc).__name__}: {exc}") from None


def _decode(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if node is None or isinstance(node, (bool, str, int, float)):
        return node
    if isinstance(node, list):
        return [_decode(v, tensors) for v in node]
    if not isinstance(node, dict) or len(node) not in (1, 2):
        raise CorruptRecordError(f"unexpected node in state tree: {str(node)[:80]}")
    (tag, value), *rest = node.items()
    if tag == "dict":
        return {_hashable(_decode(k, tensors)): _decode(v, tensors) for k, v in value}
    if tag == "tuple":
        return tuple(_decode(v, tensors) for v in value)
    if tag == "tensor":
        return _tensor(tensors, value)
    if tag == "ndarray":  # a skeleton's (``read_layout``) stays a tensor on the meta device
        t = _tensor(tensors, value)
        return t if t.device.type == "meta" else t.numpy()
    if tag == "npscalar":
        return np.dtype(value).type(_decode(rest[0][1], tensors))
    if tag == "float":
        return float(value)
    if tag == "bytes":
        return base64.b64decode(value, validate=True)
    if tag == "dtype":
        dtype = getattr(torch, value, None)
        if not isinstance(dtype, torch.dtype):
            raise CorruptRecordError(f"unknown dtype {value!r} in state tree")
        return dtype
    if tag == "device":
        return torch.device(value)
    raise CorruptRecordError(f"unknown tag {tag!r} in state tree")


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def _tensor(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return tensors[name]
    except KeyError:
        raise CorruptRecordError(f"state tree refers to missing tensor {name!r}") from None


# safetensors dtype names, in the order safetensors sorts tensors (descending) before writing them.
_DTYPE_ORDER = ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32",
                "F32", "C64", "F64", "I64", "U64"]
_DTYPE_NAMES = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3", torch.int16: "I16", torch.uint16: "U16", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.int32: "I32", torch.uint32: "U32", torch.float32: "F32",
    torch.complex64: "C64", torch.float64: "F64", torch.int64: "I64", torch.uint64: "U64",
}


def pack_parts(obj: Any) -> list[bytes | memoryview]:
    """Serialize a tree to a safetensors buffer given as parts: the header, then each tensor's
    memory as a zero-copy view (concatenated they are exactly what ``safetensors`` writes).

    Zero-copy matters: the writer thread would otherwise copy every gradient twice while holding
    the GIL, stalling the training thread.
    """
    tensors: dict[str, torch.Tensor] = {}
    structure = encode_tree(obj, tensors)
    meta = json.dumps(structure, separators=(",", ":"), allow_nan=False)
    # Tensors of whole 64-byte lines first (safetensors' order within each group), the header padded
    # so that data start on a line: in a buffer read to an aligned address, every such tensor is
    # aligned as torch's allocator places tensors, and a reader takes it as a view, not a copy
    # (``borrowing.py``). Any order and header padding are valid safetensors.
    order = sorted(tensors, key=lambda n: (_nbytes(tensors[n]) % ALIGN != 0,
                                           -_DTYPE_ORDER.index(_DTYPE_NAMES[tensors[n].dtype]), n))
    entries, views, offset = [], [], 0
    for name in order:
        t = tensors[name]
        nbytes = _nbytes(t)
        entries.append(f"{json.dumps(name)}:{{\"dtype\":\"{_DTYPE_NAMES[t.dtype]}\",\"shape\":"
                       f"{json.dumps(list(t.shape), separators=(',', ':'))},\"data_offsets\":[{offset},{offset + nbytes}]}}")
        views.append(t.reshape(-1).view(torch.uint8).numpy().data if nbytes else b"")
        offset += nbytes
    header = "{" + ",".join([f'"__metadata__":{{{json.dumps(_META_KEY)}:{json.dumps(meta)}}}', *entries]) + "}"
    head = header.encode()
    head += b" " * (-(8 + len(head)) % ALIGN)
    return [struct.pack("<Q", len(head)), head, *views]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def pack_tree(obj: Any) -> bytes:
    """Serialize a tree to one safetensors buffer (structure in its metadata)."""
    return b"".join(pack_parts(obj))


def _read_header(buf: bytes | memoryview) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors buffer, and where its tensor data starts."""
    if len(buf) < 8:
        raise CorruptRecordError("safetensors buffer is truncated (shorter than its header size)")
    (size,) = struct.unpack_from("<Q", buf, 0)
    if size > len(buf) - 8:
        raise CorruptRecordError("safetensors header runs past the end of the buffer (truncated)")
    try:
        header = json.loads(bytes(buf[8 : 8 + size]))
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise CorruptRecordError(f"safetensors header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CorruptRecordError("safetensors header is not a JSON object")
    return header, 8 + size


def read_metadata(buf: bytes | memoryview) -> dict[str, str]:
    """Return the metadata of a safetensors buffer without touching its tensors."""
    return _metadata(_read_header(buf)[0])


def _metadata(header: dict[str, Any]) -> dict[str, str]:
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptRecordError("safetensors metadata is not a map of strings")
    return meta


_SAFETENSORS_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


def _tensor_spans(header: dict[str, Any], size: int) -> list[tuple[int, int, str, torch.dtype, list[int]]]:
    """``(begin, end, name, dtype, shape)`` of each tensor, in data order, checked as
    ``safetensors`` checks them: known dtypes, sizes that match the shapes, and offsets that
    tile the ``size`` bytes of data exactly (no gap, overlap or trailing bytes)."""
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype"))
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if dtype is None or not _naturals(shape) or not _naturals(offsets) or len(offsets) != 2:
            raise CorruptRecordError(f"tensor {name!r} has an invalid dtype, shape or data_offsets")
        begin, end = offsets
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise CorruptRecordError(f"tensor {name!r} spans {end - begin} bytes, not what its "
                                     f"shape {shape} of {entry['dtype']} needs")
        spans.append((begin, end, name, dtype, shape))
    spans.sort(key=lambda span: span[:2])
    at = 0
    for begin, end, name, _, _ in spans:
        if begin != at:
            raise CorruptRecordError(f"tensor {name!r} starts at byte {begin} of the data, not {at}")
        at = end
    if at != size:
        raise CorruptRecordError(f"the tensors cover {at} bytes of data, but it has {size}")
    return spans


def _naturals(value: Any) -> bool:
    return isinstance(value, list) and all(type(x) is int and x >= 0 for x in value)


def _load_tensors(buf: bytes | memoryview, header: dict[str, Any], start: int) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors buffer, each copied into its own memory (views of ``buf``
    inside :func:`borrowing`).

    The copies are numpy's, which release the GIL, and slices of ``buf`` are views, not copies:
    decoding segments on a prefetch thread (``store.read_records``) then holds the GIL little,
    and replay, on the thread that needs it for every optimizer step, is hardly slowed. Slicing
    ``bytes`` and ``safetensors.torch.load`` copy while holding it.
    """
    if sys.byteorder != "little":  # the data are little-endian: let safetensors swap them
        return safetensors.torch.load(bytes(buf))
    data = memoryview(buf)[start:]
    spans = _tensor_spans(header, len(data))
    views = borrowed(data, spans) if spans else None
    if views is not None:
        return views
    out = {}
    for begin, end, name, dtype, shape in spans:
        if begin == end:
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            raw = np.frombuffer(data, dtype=np.uint8, count=end - begin, offset=begin).copy()
            out[name] = torch.from_numpy(raw).view(dtype).reshape(shape)
    return out


def header_length(first: bytes | memoryview) -> int:
    """How many bytes of a :func:`pack_tree` buffer precede its tensor data (the size field and
    the header), from its first 8 bytes or more."""
    if len(first) < 8:
        raise CorruptRecordError("safetensors buffer is truncated (shorter than its header size)")
    return 8 + struct.unpack_from("<Q", first, 0)[0]


@dataclass
class Layout:
    """Where a :func:`pack_tree` buffer keeps what, read from its header alone: its tensors'
    spans in data order (``(begin, end, name, dtype, shape)``, offsets from :attr:`start`) and the
    tree's structure, which :func:`decode_tree` turns into the tree once tensors exist."""

    start: int
    spans: list[tuple[int, int, str, torch.dtype, list[int]]]
    structure: Any

    def skeleton(self) -> tuple[Any, dict[int, str]]:
        """The tree with a tensor on the meta device in place of each stored one (its dtype and
        shape, no memory), and the name of each of them by ``id``: what a reader checks, and
        chooses destinations for, before reading any data."""
        metas = {name: torch.empty(shape, dtype=dtype, device="meta") for _, _, name, dtype, shape in self.spans}
        return decode_tree(self.structure, metas), {id(t): name for name, t in metas.items()}


def read_layout(head: bytes | memoryview, size: int) -> Layout:
    """The :class:`Layout` of a :func:`pack_tree` buffer of ``size`` bytes from its first
    :func:`header_length` bytes (``head``, or more); malformed input raises
    :class:`CorruptRecordError`."""
    if size < len(head[:8]) or header_length(head) > size:
        raise CorruptRecordError("safetensors header runs past the end of the buffer (truncated)")
    header, start = _read_header(head)
    meta = _metadata(header)
    if _META_KEY not in meta:
        raise CorruptRecordError("buffer has no diffckpt state tree in its metadata")
    spans = _tensor_spans(header, size - start)
    try:
        structure = json.loads(meta[_META_KEY])
    except (ValueError, RecursionError) as exc:
        raise CorruptRecordError(f"malformed state tree: {exc}") from None
    return Layout(start, spans, structure)


def unpack_tree(buf: bytes | memoryview) -> Any:
    """Deserialize a buffer written by :func:`pack_tree` (``bytes`` or a view of them)."""
    header, start = _read_header(buf)
    meta = _metadata(header)
    if _META_KEY not in meta:
        raise CorruptRecordError("buffer has no diffckpt state tree in its metadata")
    try:
        tensors = _load_tensors(buf, header, start)
        structure = json.loads(meta[_META_KEY])
        return _decode(structure, tensors)
    except CorruptRecordError:
        raise
    except Exception as exc:  # safetensors and malformed nodes raise assorted types
        raise CorruptRecordError(f"cannot decode state buffer: {type(exc).__name__}: {exc}") from None


def portable(obj: Any) -> Any:
    """``obj`` with numpy values as torch tensors and Python scalars, and tensors on the CPU.

    ``torch.load(weights_only=True)`` (what ``LightningModule.load_from_checkpoint`` uses) refuses
    numpy objects, and the recorded state holds some (DiffCheckpoint's numpy RNG state, for one).
    CPU tensors load on any machine, whatever device the run was replayed on.
    """
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj).copy())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {portable(k): portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(portable(v) for v in obj)
    return obj
