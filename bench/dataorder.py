"""What continuing an epoch on another number of processes costs at resume: the epoch's order drawn
again and this rank's share of its rest dealt (``diffckpt.dealing``), against what torch's own
``DistributedSampler`` spends drawing and dealing one epoch for one rank (which every epoch pays).

For each dataset size, a run of N=8 ranks interrupted after a third of the epoch resumes on M=6:

- ``diffckpt``: ``drawn_order`` (the recipe a Fabric position records) + ``deal`` of the rest, for
  rank 0 of the new ranks: the work a resume adds, once;
- ``DistributedSampler``: ``list(sampler)`` for rank 0 of 6 ranks at the same epoch: a normal epoch
  start, for scale;
- peak Python memory of each (``tracemalloc``).

Each is timed ``--repeats`` times; the median is reported. Checked first: what the 8 recorded
ranks consumed is the order's prefix, and the 6 new shares hold every other sample (padding aside).

    python bench/dataorder.py [--sizes 100000 1000000 10000000] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

from torch.utils.data import DistributedSampler

from diffckpt.dealing import deal, distributed_dealing, drawn_order


def timed(fn, repeats: int) -> tuple[float, float]:
    """Median seconds and peak traced MB of ``fn()``."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1] / 1e6
    tracemalloc.stop()
    return statistics.median(times), peak


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 10_000_000])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    old, new, epoch = 8, 6, 3
    rows = ["| samples | diffckpt: order + share (s) | DistributedSampler epoch (s) | ratio | "
            "peak MB diffckpt / sampler |", "|---:|---:|---:|---:|---:|"]
    for n in args.sizes:
        recorded = DistributedSampler(range(n), num_replicas=old, rank=0, seed=5)  # type: ignore[arg-type]
        recipe = distributed_dealing(recorded, epoch)
        consumed = (n // old // 3) * old  # a third of the epoch, every rank the same count

        def resume(recipe: dict = recipe, consumed: int = consumed, rank: int = 0) -> list[int]:
            return deal(drawn_order(recipe)[consumed:], new, rank, False)

        live = DistributedSampler(range(n), num_replicas=new, rank=0, seed=5)  # type: ignore[arg-type]
        live.set_epoch(epoch)
        # What the old ranks consumed and every new rank's share together: each sample once (but padding).
        order = drawn_order(recipe)
        recorded_ranks = [DistributedSampler(range(n), num_replicas=old, rank=r, seed=5)  # type: ignore[arg-type]
                          for r in range(old)]
        consumed_by_old = set()
        for s in recorded_ranks:
            s.set_epoch(epoch)
            consumed_by_old.update(list(s)[:consumed // old])
        assert consumed_by_old == set(order[:consumed])
        shares = [i for rank in range(new) for i in resume(rank=rank)]
        assert set(shares) | consumed_by_old == set(range(n)) and len(shares) - (n - consumed) < new
        ours, ours_mb = timed(resume, args.repeats)
        base, base_mb = timed(lambda live=live: list(live), args.repeats)
        rows.append(f"| {n:,} | {ours:.3f} | {base:.3f} | {ours / base:.2f}× | {ours_mb:.0f} / {base_mb:.0f} |")
        print(rows[-1], flush=True)
    text = "\n".join(rows)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# Data order on another number of processes ({old} → {new} ranks)\n\n{text}\n")


if __name__ == "__main__":
    main()
