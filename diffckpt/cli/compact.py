"""``diffckpt compact URL``: roll a base forward from stored diffs, from any process or machine,
so that restores replay fewer steps (:func:`diffckpt.lifecycle.compaction.compact`).

On a sharded run every rank's stream is compacted to the same step, one durable on every rank
(by default the newest), so that all ranks get a base there and restores of it replay nothing."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..errors import CheckpointNotFoundError
from ..lifecycle.compaction import CompactionResult, compact, compaction_target
from ..shardedrun import Resolution
from ..units import format_bytes
from .common import open_run, progress, table, throughput
from .sharded import Sharded, open_sharded

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``compact`` command's own arguments."""
    p.add_argument("--to", type=int, metavar="STEP",
                   help="step to write a base at (a segment end; default: the newest durable step)")
    p.add_argument("--device", default=None,
                   help="replay on this device (default: the device type the run trained on, the only one "
                        "that gives a bit-exact base; refused where there is none)")
    p.add_argument("--allow-module", action="append", default=["torch."], metavar="MODULE",
                   help="also import optimizer classes from MODULE (default: torch.)")


def run(args: argparse.Namespace) -> int:
    """Write a base at ``--to`` (or the step the URL names, or the newest durable one)."""
    store, inv, step = open_run(args)
    to = args.to if args.to is not None else step
    sharded = open_sharded(store, inv)
    res = sharded.run.resolve(to) if sharded is not None else None
    if sharded is not None and res is not None:
        return _compact_ranks(sharded, res, args)
    progress(f"replaying to step {'newest' if to is None else to}")
    result = compact(store.storage, to, device=args.device, allow_modules=tuple(args.allow_module))
    progress()
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return 0
    path = f"bases/{result.step:012d}.g{result.gen:06d}"
    if not result.written:
        print(f"step {result.step} of g{result.gen} already has a base ({path}); nothing to do")
        return 0
    print(f"compacted step {result.step} of g{result.gen} from base {result.from_base}: replayed "
          f"{result.replayed} steps; wrote {path} ({format_bytes(result.bytes)})")
    print(throughput(result.replayed, result.replay_s))
    if result.verified_at_step:
        print(f"verified: it matches the fingerprint recorded in training at step {result.step}")
    elif result.verified_through is not None:
        print(f"verified: replay matched the fingerprints recorded in training through step "
              f"{result.verified_through}; step {result.step} itself has none (fingerprint_every_n_steps)")
    else:
        print("not verified: the run recorded no fingerprints on this chain")
    return 0


def _compact_ranks(sh: Sharded, res: Resolution, args: argparse.Namespace) -> int:
    """Compact each rank's stream of session ``res.gen`` to ``res.step``; every rank is checked
    first (a segment must end there on each), so that no rank gets a base the others cannot."""
    streams = sh.streams[: res.world_size]
    for st in streams:
        try:
            gen, _, _ = compaction_target(st.store, res.step)
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(f"rank {st.rank} ({st.prefix}): {exc}") from None
        if gen != res.gen:  # an unsharded stream session reaching the step: not this session's
            raise CheckpointNotFoundError(f"rank {st.rank} ({st.prefix}): step {res.step} of session g{res.gen} "
                                          f"is restored from session g{gen} there; compact another step")
    results: list[tuple[int, CompactionResult]] = []
    for st in streams:
        progress(f"rank {st.rank}: replaying to step {res.step}")
        try:
            results.append((st.rank, compact(st.store.storage, res.step, device=args.device,
                                             allow_modules=tuple(args.allow_module))))
        except Exception as exc:
            if not results:
                raise
            done = ", ".join(str(r) for r, _ in results)
            raise type(exc)(f"rank {st.rank} ({st.prefix}): {exc} (ranks {done} were compacted; their "
                            "bases are valid and kept)") from exc
    progress()
    if args.json:
        out: dict[str, Any] = {"step": res.step, "gen": res.gen, "world_size": res.world_size,
                               "ranks": [{"rank": r, **x.to_json()} for r, x in results]}
        print(json.dumps(out, indent=2))
        return 0
    path = f"bases/{res.step:012d}.g{res.gen:06d}"
    written = [x for _, x in results if x.written]
    if not written:
        print(f"step {res.step} of g{res.gen} already has a base on every rank (ranks/r*/{path}); nothing to do")
        return 0
    print(f"compacted step {res.step} of g{res.gen} on {len(written)} of {res.world_size} ranks "
          f"(durable on every rank): wrote ranks/r*/{path} ({format_bytes(sum(x.bytes for x in written))})")
    print("\n".join(table(["rank", "from base", "replayed", "size", "verified", "path"], [
        [str(r), str(x.from_base) if x.written else "-", str(x.replayed) if x.written else "-",
         format_bytes(x.bytes) if x.written else "-", _verified(x), f"{sh.streams[r].prefix}{path}"]
        for r, x in results])))
    print(throughput(sum(x.replayed for x in written), sum(x.replay_s for x in written)) + " (all ranks)")
    return 0


def _verified(x: CompactionResult) -> str:
    if not x.written:
        return "base there already"
    if x.verified_at_step:
        return f"fingerprint at step {x.step}"
    if x.verified_through is not None:
        return f"fingerprints through step {x.verified_through}"
    return "no fingerprints on this chain"
