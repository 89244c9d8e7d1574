"""One restore of an existing run, or its limit, timed in this process: what issue 37's A/B ran.

    python bench/restore_step.py RUN_ROOT --step N [--size 124m]          # diffckpt restore of step N
    python bench/restore_step.py FULL.pt --limit --replayed N [--size 124m]  # torch.load + N bare steps

Builds ``bench/gpu_scale.py``'s model of ``--size`` (one thread), then restores onto it and
prints the seconds, what was replayed, how long replay waited for reads, and the peak RSS
(``ru_maxrss``) with the RSS before the restore. The run root comes from ``bench/scale.py``'s train
child (``--child train --config diffckpt --rundir DIR``, kept). Run the configurations to compare
interleaved, each in a fresh process; to compare two commits, run this file from a worktree of
each (``git worktree add``).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", help="a run root, or with --limit a torch.save file of the full state")
    ap.add_argument("--step", type=int, help="the step to restore (default: the newest durable one)")
    ap.add_argument("--limit", action="store_true")
    ap.add_argument("--replayed", type=int, default=0, help="with --limit: bare optimizer steps after the load")
    ap.add_argument("--size", default="124m")
    args = ap.parse_args()
    import torch
    from gpu_scale import build, load_and_step

    torch.set_num_threads(1)
    model, opt = build(argparse.Namespace(size=args.size, device="cpu"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1000  # kB, as the logged figures took it
    if args.limit:
        grads = [torch.randn_like(p) for p in model.parameters()]
        t0 = time.perf_counter()
        load_and_step(model, opt, args.root, "cpu", grads, args.replayed)
        what = f"limit {time.perf_counter() - t0:.3f} s  replayed {args.replayed}"
    else:
        from diffckpt import CheckpointEngine

        t0 = time.perf_counter()
        r = CheckpointEngine(args.root).restore(model, [opt], args.step)
        what = (f"diffckpt {time.perf_counter() - t0:.3f} s step {r.step} base {r.base_step} replayed {r.replayed} "
                f"replay_s {r.replay_s:.3f} wait {r.read_wait_s:.3f}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1000
    print(f"{what}  peak RSS {peak / 1e9:.2f} GB (before {before / 1e9:.2f})")


if __name__ == "__main__":
    main()
