"""``diffckpt export URL --step N -o FILE``: a step of a run as a plain checkpoint file
(Lightning, torch or safetensors), or as a folder a transformers ``Trainer`` resumes from
(``--format hf-trainer``; :mod:`diffckpt.export` does the work). A sharded run is
rebuilt from every rank's stream and written as full tensors, as :func:`diffckpt.load_state`
returns them; damage met in a rank's stream names the rank."""

from __future__ import annotations

import argparse
import json
import warnings

from ..export import FORMATS, output_target, write_checkpoint
from ..loading import load_state
from ..units import format_bytes
from .common import open_run, progress, reemit, throughput
from .sharded import open_sharded

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``export`` command's own arguments (the step and the device come with replaying ones)."""
    p.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="file or URL to write (hf-trainer: a new local folder, e.g. out/checkpoint-1200)")
    p.add_argument("--format", choices=FORMATS,
                   help="default from FILE: .ckpt lightning, .safetensors safetensors, else torch; "
                        "hf-trainer: a checkpoint-N folder for Trainer.train(resume_from_checkpoint=...)")
    p.add_argument("--no-verify", action="store_true", help="skip the fingerprint checks")


def run(args: argparse.Namespace) -> int:
    """Replay the step and write it to ``args.output``."""
    store, inv, step = open_run(args)
    fmt, output = output_target(args.output, args.format)  # usage errors before the replay
    sharded = open_sharded(store, inv)
    res = sharded.run.resolve(step) if sharded is not None else None
    progress(f"replaying step {'newest' if step is None else step}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = load_state(store.storage, step, device=args.device, verify=not args.no_verify,
                            allow_modules=tuple(args.allow_module))
        done = write_checkpoint(result, output, format=fmt)
    progress()
    reemit(caught)
    if res is not None:
        done["world_size"] = res.world_size
    if args.json:
        print(json.dumps(done, indent=2))
        return 0
    ranks = f", full tensors from {res.world_size} rank streams" if res is not None else ""
    files = f"{len(done['files'])} files, " if "files" in done else ""  # a folder (hf-trainer)
    print(f"wrote {args.output}: step {done['step']} ({done['format']}, {files}{format_bytes(done['bytes'])}, "
          f"{done['bytes']} B; " + (f"base {done['base_step']} + {done['replayed']} replayed steps"
                                     if done["replayed"] else "a base, no replay") + f"{ranks})")
    if done["replayed"]:
        print(throughput(done["replayed"], done["replay_s"]))
    return 0
