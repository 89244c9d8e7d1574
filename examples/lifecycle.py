"""A run whose training never writes a full checkpoint after the first, kept bounded on storage,
and its weights taken out as standard files.

1. Lightning trains the small GPT of ``gpt.py`` with ``DiffCheckpoint(base_every_n_steps=None,
   options=CheckpointOptions(compact_every_n_steps=..., retention=RetentionPolicy(...)))``: a background thread rolls bases
   forward by replaying the stored diffs, and deletes what the policy no longer keeps.
2. ``diffckpt ls`` shows the compacted bases, ``diffckpt gc`` (a dry run) what a stricter policy
   would delete, and ``diffckpt compact`` rolls a base to the newest step from this process, as
   any other process or machine could.
3. ``diffckpt export`` writes the last step as a Lightning ``.ckpt`` and as safetensors; the
   ``.ckpt`` loads with ``GPT.load_from_checkpoint``, and both are compared with the trained model
   with ``torch.equal``.

Exit status 1 if an exported file differs from the trained model.
Run: ``.venv/bin/python examples/lifecycle.py [--steps 200] [--run-dir DIR]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import lightning as L
import safetensors.torch
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt import GPT, make_loader

from diffckpt import CheckpointOptions, RetentionPolicy
from diffckpt.cli import main as diffckpt
from lightning_ckpt import DiffCheckpoint, DiffCheckpointIO


def storage_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--compact-every", type=int, default=40)
    ap.add_argument("--run-dir", help="keep the run here (default: a temporary directory)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="diffckpt-lifecycle-")
    run = args.run_dir or os.path.join(work, "run")
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    torch.use_deterministic_algorithms(True)

    print(f"1. training {args.steps} steps; bases only by background compaction, keeping the last 2")
    model = GPT("demo", total_steps=args.steps)
    ckpt = DiffCheckpoint(run, write_batch=8, base_every_n_steps=None, options=CheckpointOptions(
        compact_every_n_steps=args.compact_every, retention=RetentionPolicy(keep_last_bases=2)))
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=False, deterministic=True,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[ckpt],
                        plugins=[DiffCheckpointIO()])
    trainer.fit(model, train_dataloaders=make_loader("demo"))
    trained = {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}
    print(f"   on storage: {storage_bytes(run) / 2**20:.1f} MiB (2 bases and the diffs after the "
          f"older one; everything before it was deleted)\n")

    print("2. the run, a stricter policy as a dry run, and a compaction from outside the trainer")
    diffckpt(["ls", run])
    print()
    diffckpt(["gc", run, "--keep-last-bases", "1"])
    print()
    diffckpt(["compact", run])
    print()

    print("3. the last step as files that load without diffckpt")
    ckpt_file, st_file = os.path.join(work, "last.ckpt"), os.path.join(work, "model.safetensors")
    diffckpt(["export", run, "-o", ckpt_file])
    diffckpt(["export", run, "-o", st_file])
    loaded = GPT.load_from_checkpoint(ckpt_file, map_location="cpu").state_dict()
    tensors = safetensors.torch.load_file(st_file)
    same = all(torch.equal(trained[k], loaded[k]) and torch.equal(trained[k], tensors[k]) for k in trained)
    print(f"   GPT.load_from_checkpoint and safetensors equal the trained model ({len(trained)} tensors, "
          f"torch.equal): {'yes' if same else 'NO'}")
    if not args.run_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
