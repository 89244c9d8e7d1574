"""``diffckpt export URL --step N -o FILE``: a step of a run as a plain checkpoint file
(Lightning, torch or safetensors; :func:`diffckpt.export.export_checkpoint` does the work)."""

from __future__ import annotations

import argparse
import json
import warnings

from ..export import FORMATS, export_checkpoint
from ..units import format_bytes
from .common import open_run, progress, reemit, throughput

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``export`` command's own arguments (the step and the device come with replaying ones)."""
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="file or URL to write")
    p.add_argument("--format", choices=FORMATS,
                   help="default from FILE: .ckpt lightning, .safetensors safetensors, else torch")
    p.add_argument("--no-verify", action="store_true", help="skip the fingerprint checks")


def run(args: argparse.Namespace) -> int:
    """Replay the step and write it to ``args.output``."""
    store, _, step = open_run(args)
    progress(f"replaying step {'newest' if step is None else step}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        done = export_checkpoint(store.storage, args.output, step, format=args.format, device=args.device,
                                 verify=not args.no_verify, allow_modules=tuple(args.allow_module))
    progress()
    reemit(caught)
    if args.json:
        print(json.dumps(done, indent=2))
        return 0
    print(f"wrote {args.output}: step {done['step']} ({done['format']}, {format_bytes(done['bytes'])}, "
          f"{done['bytes']} B; base {done['base_step']} + {done['replayed']} replayed steps)")
    print(throughput(done["replayed"], done["replay_s"]))
    return 0
