"""Generate the golden files pinned by ``tests/core/test_format.py``.

Run ``python tests/golden/make_golden.py`` from the repository root to rewrite them. Do that only
for a deliberate format change (and bump ``diffckpt.format.FORMAT_VERSION`` if old files can no
longer be read): the point of the golden files is that an accidental change fails the tests.

It writes the current format (4: XXH3-128 checksums and fingerprints, each segment's index at
its end, row-split gradients understood) only. ``v1/`` holds the same run, segment and sharded
run in format 1 (SHA-256), ``v2/`` in format 2 (the index in the header) and ``v3/`` in format 3
(as format 4 but for the version numbers), as the releases of this script for those formats
wrote them; they are read-only fixtures that show older runs stay readable and verifiable
(``tests/core/test_format_v1.py``, ``test_format_v2.py``, ``test_format_v3.py``), and nothing
regenerates them: never rewrite them.

Everything here is deterministic: explicit tensor values (no RNG, no BLAS), and every value is a
small dyadic rational, so the simulated SGD steps are exact in float32 on any machine and the
fingerprints do not depend on how a kernel rounds. Records are written with compression "none"
so their bytes do not depend on the zstd library; ``segment-zstd.seg`` is only decoded.

Files (paths relative to ``tests/golden/``), all written here but ``v1/``, ``v2/`` and ``v3/``:

* ``tree.safetensors``: one :func:`diffckpt.tree.pack_tree` buffer using every tag of the tree
  encoding (see :func:`all_tags_tree`).
* ``run/``: a tiny run root, session 1: a base at step 0, segment ``0-2`` (steps 1, 2; step 1
  is not restorable) and segment ``2-4`` (steps 3, 4; step 3 is a skipped optimizer step).
  ``run/run.json`` and ``run/sessions/g000001.json`` carry fixed times and are *not* byte-pinned.
* ``segment-zstd.seg``: the records of segment ``0-2`` compressed with zstd (decode-only).
* ``sharded/``: the same training as ``run/``, recorded sharded over 2 ranks (``docs/format.md``
  section 12): each parameter is cut along dim 0 (``weight`` (2, 3) into two (1, 3) pieces, ``bias``
  (2,) into two (1,) pieces), and rank ``r``'s stream under ``sharded/ranks/r0000<r>/`` holds only
  its pieces; buffers are not sharded and both streams hold them whole. The session files (root:
  world size; rank streams: shard tables) are not byte-pinned; the streams' bases and segments are.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from diffckpt.checksums import fingerprint
from diffckpt.format import FORMAT_VERSION, BaseName, SegmentName, encode_commit, state_entry
from diffckpt.segment import encode_segment
from diffckpt.tree import pack_tree

GEN = 1
OPTIMIZER = "torch.optim.sgd.SGD"
PARAM_NAMES = ["weight", "bias"]
BUFFER_NAMES = ["count", "scale"]
# Every byte-pinned file, relative to tests/golden/.
PINNED = [
    "tree.safetensors",
    "run/bases/000000000000.g000001/state.safetensors",
    "run/bases/000000000000.g000001/COMMIT",
    "run/diffs/000000000000-000000000002.g000001.seg",
    "run/diffs/000000000002-000000000004.g000001.seg",
    *[f"sharded/ranks/r{r:05d}/{name}" for r in (0, 1) for name in (
        "bases/000000000000.g000001/state.safetensors", "bases/000000000000.g000001/COMMIT",
        "diffs/000000000000-000000000002.g000001.seg", "diffs/000000000002-000000000004.g000001.seg")],
]
WORLD = 2


# ------------------------------------------------------------------------------- tree fixture
def all_tags_tree() -> dict[str, Any]:
    """A tree that exercises every JSON form of ``diffckpt/tree.py``."""
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 4
    return {
        "none": None,
        "bools": [True, False],
        "int": 7,
        "neg_int": -3,
        "big_int": 2**70,
        "float": 0.1,
        "neg_zero": -0.0,
        "non_finite": [math.inf, -math.inf, math.nan],
        "str": "héllo \"quoted\"\n",
        "list": [1, "two", [3.5, None]],
        "tuple": (1, (2, "x"), []),
        "empty": {"list": [], "tuple": (), "dict": {}},
        "bytes": b"\x00\x01\xfe\xff diffckpt",
        "dtypes": [torch.float32, torch.bfloat16, torch.int64, torch.bool],
        "devices": [torch.device("cpu"), torch.device("cuda", 1)],
        "int_keys": {0: "zero", 1: "one", -5: "minus five"},
        "mixed_keys": {(1, "a"): "tuple key", None: "none key", 2.5: "float key", True: "bool key",
                       b"k": "bytes key"},
        "tensors": {
            "f32": base,
            "bf16": torch.tensor([1.5, -2.0, 0.25], dtype=torch.bfloat16),
            "f16": torch.tensor([[0.5, 1.0]], dtype=torch.float16),
            "f64": torch.tensor([math.pi, -0.0, math.inf], dtype=torch.float64),
            "i64": torch.tensor([-(2**40), 0, 2**40], dtype=torch.int64),
            "i32": torch.tensor([1, -2], dtype=torch.int32),
            "i8": torch.tensor([-128, 127], dtype=torch.int8),
            "u8": torch.arange(5, dtype=torch.uint8),
            "bool": torch.tensor([True, False, True]),
            "scalar": torch.tensor(3.0),
            "empty": torch.zeros(0, 2),
            "transposed": base.t(),  # not contiguous: stored contiguous
            "view": base[1],  # a view of a larger storage: stored on its own
        },
        "ndarray": np.arange(6, dtype=np.int32).reshape(2, 3),
        "ndarray_u32": np.array([0, 2**32 - 1], dtype=np.uint32),
        "npscalars": [np.int64(-9), np.float32(1.25), np.bool_(True), np.uint8(200),
                      np.float32("nan")],
    }


# --------------------------------------------------------------------------------- run fixture
def _hyper(lr: float) -> dict[str, Any]:
    """One SGD param group's hyperparameters, in the order torch keeps them (params excluded)."""
    return {"lr": lr, "momentum": 0.5, "dampening": 0, "weight_decay": 0, "nesterov": False,
            "maximize": False, "foreach": False, "differentiable": False, "fused": None}


def initial_params() -> dict[str, torch.Tensor]:
    return {"weight": (torch.arange(6, dtype=torch.float32).reshape(2, 3) - 2) / 8,
            "bias": torch.tensor([0.5, -0.25])}


def initial_buffers() -> dict[str, torch.Tensor]:
    return {"count": torch.tensor(0), "scale": torch.ones(2)}


# step -> (events as [(lr in force, {param: grad or None})], lr after the step, state or None)
_STEPS: dict[int, tuple[list[tuple[float, dict[str, torch.Tensor | None]]], float, Any]] = {
    1: ([(0.5, {"weight": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 16,
                "bias": torch.tensor([0.25, -0.5])})], 0.5, None),
    2: ([(0.5, {"weight": torch.full((2, 3), 0.25), "bias": None})], 0.5,
        {"loop": {"step": 2, "epoch": 0}, "sched": {"last_epoch": 2, "_last_lr": [0.5]}}),
    3: ([], 0.25, {"loop": {"step": 3, "epoch": 0}, "sched": {"last_epoch": 3, "_last_lr": [0.25]}}),
    4: ([(0.25, {"weight": -torch.arange(6, dtype=torch.float32).reshape(2, 3) / 32,
                 "bias": torch.tensor([0.125, 0.125])})], 0.125,
        {"loop": {"step": 4, "epoch": 1}, "sched": {"last_epoch": 4, "_last_lr": [0.125]}}),
}
FINGERPRINT_STEPS = (2, 4)
SEGMENTS = [(0, 2), (2, 4)]


def buffers_at(step: int) -> dict[str, torch.Tensor]:
    """Full buffers after ``step``: ``count`` moves every step, ``scale`` only at step 2."""
    return {"count": torch.tensor(step), "scale": torch.ones(2) if step < 2 else torch.tensor([0.5, 2.0])}


def simulate() -> dict[int, dict[str, torch.Tensor]]:
    """Parameters after each step, from a real ``torch.optim.SGD`` (exact: dyadic values)."""
    params = {k: torch.nn.Parameter(v.clone()) for k, v in initial_params().items()}
    opt = torch.optim.SGD(list(params.values()), **_hyper(0.5))
    out = {0: {k: p.detach().clone() for k, p in params.items()}}
    for step, (events, lr_after, _) in sorted(_STEPS.items()):
        for lr, grads in events:
            opt.param_groups[0].update(_hyper(lr))
            for name, p in params.items():
                g = grads[name]
                p.grad = None if g is None else g.clone()
            opt.step()
        opt.param_groups[0].update(_hyper(lr_after))
        out[step] = {k: p.detach().clone() for k, p in params.items()}
    return out


def base_tree() -> dict[str, Any]:
    """The base at step 0, shaped as ``CheckpointEngine.write_base`` builds it."""
    model = {**initial_params(), **initial_buffers()}
    opt_state = {"state": {}, "param_groups": [{**_hyper(0.5), "params": [0, 1]}]}
    return {"model": model, "optimizers": [opt_state], "state": {"loop": {"step": 0, "epoch": 0}}}


def engine_records() -> list[dict[str, Any]]:
    """Records as ``CheckpointEngine.record_step`` hands them to the writer: full buffers and,
    at fingerprint steps, ``fingerprint_params`` (the writer turns them into ``fingerprint``)."""
    params = simulate()
    records = []
    for step, (events, lr_after, state) in sorted(_STEPS.items()):
        record: dict[str, Any] = {
            "step": step,
            "prev": step - 1,
            "events": [{"optimizer": 0, "groups": [_hyper(lr)],
                        "grads": [[None if grads[n] is None else grads[n].clone() for n in PARAM_NAMES]]}
                       for lr, grads in events],
            "param_groups": [[_hyper(lr_after)]],
            "buffers": buffers_at(step),
            "state": state,
        }
        if step in FINGERPRINT_STEPS:
            record["fingerprint_params"] = [params[step][n].clone() for n in PARAM_NAMES]
        records.append(record)
    return records


def stored_records() -> list[dict[str, Any]]:
    """Records exactly as the writer stores them: buffers reduced to those changed since the
    previous record of the session (all of them in the first record after a base), and
    ``fingerprint_params`` replaced by ``fingerprint``."""
    out = []
    last: dict[str, torch.Tensor] | None = None
    for record in engine_records():
        record = dict(record)
        buffers = record["buffers"]
        if last is not None:
            record["buffers"] = {k: v for k, v in buffers.items()
                                 if k not in last or not torch.equal(last[k], v)}
        last = {**(last or {}), **buffers}
        params = record.pop("fingerprint_params", None)
        if params is not None:
            record["fingerprint"] = fingerprint(params)
        out.append(record)
    return out


def segment_inputs() -> list[tuple[SegmentName, dict[str, Any], list[dict[str, Any]]]]:
    """``(name, header, records)`` of each golden segment, as the writer passes them."""
    records = {r["step"]: r for r in stored_records()}
    out = []
    for after, last in SEGMENTS:
        name = SegmentName(after, last, GEN)
        header = {"gen": GEN, "after": after, "last": last}
        out.append((name, header, [records[s] for s in range(after + 1, last + 1)]))
    return out


def commit_info(state_bytes: bytes) -> dict[str, Any]:
    """The COMMIT of the base, as ``BackgroundWriter._write_base`` builds it."""
    params = initial_params()
    return {"step": 0, "gen": GEN, "fingerprint": fingerprint([params[n] for n in PARAM_NAMES]),
            "files": {"state.safetensors": state_entry([state_bytes])}}


def run_json() -> bytes:
    """``run.json`` as ``RunStore.start_session`` writes it, with a fixed time (not byte-pinned)."""
    return json.dumps({"format": "diffckpt", "updated": 0.0, "version": FORMAT_VERSION}, sort_keys=True).encode()


def session_meta() -> dict[str, Any]:
    """``sessions/g000001.json`` as ``CheckpointEngine.start`` + ``RunStore.start_session`` write
    it, with a fixed time (not byte-pinned)."""
    return {"options": {"every_n_steps": 1, "write_batch": 2, "base_every_n_steps": None,
                        "fingerprint_every_n_steps": 2, "max_pending_bytes": 1 << 30,
                        "compression": "none", "compression_level": 1},
            "optimizer_params": [[PARAM_NAMES]],
            "resumed_from": 0,
            "optimizers": [OPTIMIZER],
            "parameters": [[k, list(v.shape)] for k, v in initial_params().items()],
            "gen": GEN,
            "started": 0.0}


# ------------------------------------------------------------------------------ sharded run
def cut(t: torch.Tensor | None, rank: int) -> torch.Tensor | None:
    """Rank ``rank``'s piece of a parameter-shaped tensor: ``torch.chunk`` along dim 0, as FSDP2."""
    return None if t is None else t.chunk(WORLD)[rank].clone()


def shard_table(rank: int) -> dict[str, dict[str, Any]]:
    """The ``shards`` entry of rank ``rank``'s session file, as ``diffckpt.sharding.shard_table``
    builds it for FSDP2 parameters."""
    table = {}
    for name, t in initial_params().items():
        rows = t.shape[0] // WORLD
        table[name] = {"shape": list(t.shape), "dtype": "float32", "placements": ["Shard(0)"],
                       "mesh": [WORLD], "coord": [rank], "local_shape": [rows, *t.shape[1:]],
                       "offset": [rank * rows] + [0] * (t.dim() - 1)}
    return table


def rank_records(rank: int) -> list[dict[str, Any]]:
    """Rank ``rank``'s records as the engine hands them to its writer: its gradient pieces, the
    whole buffers, its parameter pieces at fingerprint steps, and the state with itself as the
    only entry of ``ranks`` (each rank records its own part)."""
    out = []
    for record in engine_records():
        record = dict(record)
        record["events"] = [dict(e, grads=[[cut(g, rank) for g in group] for group in e["grads"]])
                            for e in record["events"]]
        if "fingerprint_params" in record:
            record["fingerprint_params"] = [cut(t, rank) for t in record["fingerprint_params"]]
        if record["state"] is not None:
            record["state"] = dict(record["state"], ranks=[{"rank": rank} if r == rank else None for r in range(WORLD)])
        out.append(record)
    return out


def rank_base(rank: int) -> dict[str, Any]:
    tree = base_tree()
    model = {k: cut(v, rank) if k in PARAM_NAMES else v for k, v in tree["model"].items()}
    state = dict(tree["state"], ranks=[{"rank": rank} if r == rank else None for r in range(WORLD)])
    return dict(tree, model=model, state=state)


def sharded_files(writer_cls: Any, store_cls: Any, storage_cls: Any, options: Any, root: Path) -> None:
    """Write the rank streams of ``sharded/`` under ``root`` with the real background writer."""
    for rank in (0, 1):
        store = store_cls(storage_cls(str(root / f"ranks/r{rank:05d}")))
        writer = writer_cls(store, GEN, options, after=0, narrow_grads=True)
        tree = rank_base(rank)
        writer.put_base(0, tree, [tree["model"][n] for n in PARAM_NAMES], 0)
        for record in rank_records(rank):
            writer.put_record(record, 0)
        assert writer.close() == 4


def sharded_sessions() -> dict[str, bytes]:
    """The session files of ``sharded/`` (not byte-pinned: times)."""
    root = {"options": session_meta()["options"], "resumed_from": 0, "world_size": WORLD,
            "sharded": {"world_size": WORLD, "streams": "ranks/r<rank:05d>/"}, "gen": GEN, "started": 0.0}
    files = {"sharded/run.json": run_json(),
             "sharded/sessions/g000001.json": json.dumps(root, indent=1, sort_keys=True).encode()}
    for rank in (0, 1):
        meta = dict(session_meta(), parameters=[[k, [v.shape[0] // WORLD, *v.shape[1:]]]
                                                for k, v in initial_params().items()],
                    world_size=WORLD, rank=rank, shards=shard_table(rank))
        files[f"sharded/ranks/r{rank:05d}/run.json"] = files["sharded/run.json"]
        files[f"sharded/ranks/r{rank:05d}/sessions/g000001.json"] = json.dumps(meta, indent=1, sort_keys=True).encode()
    return files


def golden_files() -> dict[str, bytes]:
    """Every byte-pinned golden file, encoded with the current code."""
    files = {"tree.safetensors": pack_tree(all_tags_tree())}
    base = BaseName(0, GEN)
    state = pack_tree(base_tree())
    files[f"run/{base.state_path}"] = state
    files[f"run/{base.commit_path}"] = encode_commit(commit_info(state))
    for name, header, records in segment_inputs():
        files[f"run/{name.path}"] = encode_segment(header, records, "none", 1)
    files.update(sharded_golden())
    assert sorted(files) == sorted(PINNED)
    return files


def sharded_golden() -> dict[str, bytes]:
    """The byte-pinned files of ``sharded/``, written by the real writer into a temporary root."""
    import tempfile

    from diffckpt.options import CheckpointOptions
    from diffckpt.runstore import RunStore
    from diffckpt.storage import FsspecStorage
    from diffckpt.writer import BackgroundWriter

    options = CheckpointOptions(write_batch=2, compression="none", base_every_n_steps=None,
                                fingerprint_every_n_steps=2)
    with tempfile.TemporaryDirectory() as tmp:
        sharded_files(BackgroundWriter, RunStore, FsspecStorage, options, Path(tmp))
        return {rel: (Path(tmp) / rel.removeprefix("sharded/")).read_bytes()
                for rel in PINNED if rel.startswith("sharded/")}


def other_files() -> dict[str, bytes]:
    """Golden files that are not byte-pinned (times; zstd output depends on the library)."""
    _name, header, records = segment_inputs()[0]
    return {
        "run/run.json": run_json(),
        "run/sessions/g000001.json": json.dumps(session_meta(), indent=1, sort_keys=True).encode(),
        "segment-zstd.seg": encode_segment(header, records, "zstd", 3),
        **sharded_sessions(),
    }


def main() -> None:
    for rel, data in {**golden_files(), **other_files()}.items():
        path = HERE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        print(f"{len(data):6d}  tests/golden/{rel}")


if __name__ == "__main__":
    main()
