"""``diffckpt compact URL``: roll a base forward from stored diffs, from any process or machine,
so that restores replay fewer steps (:func:`diffckpt.lifecycle.compaction.compact`)."""

from __future__ import annotations

import argparse
import json

from ..lifecycle.compaction import compact
from ..units import format_bytes
from .common import open_run, progress, throughput

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``compact`` command's own arguments."""
    p.add_argument("--to", type=int, metavar="STEP",
                   help="step to write a base at (a segment end; default: the newest durable step)")
    p.add_argument("--device", default="cpu",
                   help="replay on this device; use the device type training ran on for a bit-exact base")
    p.add_argument("--allow-module", action="append", default=["torch."], metavar="MODULE",
                   help="also import optimizer classes from MODULE (default: torch.)")


def run(args: argparse.Namespace) -> int:
    """Write a base at ``--to`` (or the step the URL names, or the newest durable one)."""
    store, _, step = open_run(args)
    to = args.to if args.to is not None else step
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
