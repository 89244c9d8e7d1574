"""A training process for crash-consistency trials: trained, killed with SIGKILL, resumed.

Modes:
- ``truth``: train ``--steps`` steps without diffckpt; save every step's true state to ``--out``.
- ``train``: train with a :class:`CheckpointEngine` writing to ``--url``. Prints ``STEP n`` after
  each step (once ``record_step(n)`` and any base of step ``n`` were handed over: with the
  journal on, the record of step ``n - 1`` is then in the node-local tier), ``DURABLE n``
  whenever the durable step advances, and ``BEGIN``/``END`` around every
  storage write, so the test knows what was in flight when it killed the process. With
  ``--pause-after PATTERN`` it stops forever after writing a matching object (``PAUSED path``);
  with ``--pause-before PATTERN`` before writing one.
- ``resume``: restore the newest durable step, check it bitwise against ``--truth``, train on to
  ``--steps`` in a new session, check the end state again, print ``RESTORED n`` and ``OK``.

``--local-dir``: the engine's ``CheckpointOptions.local_dir`` (a folder, ``auto``, or ``none``: no
journal); a resume must name the folder the killed process used to take its journal back.

Every step's batch comes from a generator seeded with the step number, so any resume sees the
data the uninterrupted run saw.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helpers import assert_bitwise_equal

from diffckpt import (
    CheckpointEngine,
    CheckpointNotFoundError,
    CheckpointOptions,
    FsspecStorage,
    RetryPolicy,
)

_say = threading.Lock()


def say(line: str) -> None:
    """One whole line per call: the training and writer threads both report."""
    with _say:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def make() -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.BatchNorm1d(512), torch.nn.ReLU(),
                            torch.nn.Linear(512, 64))
    return m, [torch.optim.AdamW(m.parameters(), lr=1e-3)]


def step_once(m: torch.nn.Module, opts: list[torch.optim.Optimizer], step: int) -> None:
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step))
    for o in opts:
        o.zero_grad()
    m(x).pow(2).mean().backward()
    for o in opts:
        o.step()


def state(m: torch.nn.Module, opts: list[torch.optim.Optimizer]) -> dict[str, Any]:
    return copy.deepcopy({"model": m.state_dict(), "optimizers": [o.state_dict() for o in opts]})


class Tracing:
    """Storage wrapper that reports writes on stdout and can stop the process around one."""

    def __init__(self, inner: FsspecStorage, pause_before: str | None, pause_after: str | None) -> None:
        self.inner = inner
        self.url = inner.url
        self.local = inner.local
        self.before = re.compile(pause_before) if pause_before else None
        self.after = re.compile(pause_after) if pause_after else None

    def write(self, path: str, data: Any) -> None:
        if self.before is not None and self.before.search(path):
            say(f"PAUSED before {path}")
            time.sleep(3600)
        say(f"BEGIN {path}")
        self.inner.write(path, data)
        say(f"END {path}")
        if self.after is not None and self.after.search(path):
            say(f"PAUSED after {path}")
            time.sleep(3600)

    def spool(self, hint: str, folder: str | None = None) -> Any:
        # as the storage places it: on a local run root beside its segment (committed by a rename)
        return self.inner.spool(hint, folder)

    def create(self, path: str, data: bytes) -> bool:
        return self.inner.create(path, data)

    def read(self, path: str) -> bytes:
        return self.inner.read(path)

    def list(self, prefix: str) -> dict[str, int]:
        return self.inner.list(prefix)

    def delete(self, path: str) -> None:
        self.inner.delete(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)


def options(args: argparse.Namespace) -> CheckpointOptions:
    local_dir = None if args.local_dir == "none" else args.local_dir
    return CheckpointOptions(write_batch=args.write_batch, base_every_n_steps=args.base_every,
                             fingerprint_every_n_steps=3, local_dir=local_dir, durability=args.durability,
                             retry=RetryPolicy(budget_s=20, initial_backoff_s=0.05, max_backoff_s=0.5))


def train(engine: CheckpointEngine, m: torch.nn.Module, opts: list[torch.optim.Optimizer], first: int,
          last: int) -> None:
    durable = engine.durable_step
    for step in range(first, last + 1):
        step_once(m, opts, step)
        engine.record_step(step, {"step": step})
        if engine.wants_base(step):
            engine.write_base(step, m.state_dict(), [o.state_dict() for o in opts], {"step": step})
        say(f"STEP {step}")
        if engine.durable_step != durable:
            durable = engine.durable_step
            say(f"DURABLE {durable}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["truth", "train", "resume"])
    p.add_argument("--url")
    p.add_argument("--storage-options", default="{}")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--write-batch", type=int, default=4)
    p.add_argument("--base-every", type=int, default=10)
    p.add_argument("--part-size", type=int, default=32 << 20)
    p.add_argument("--local-dir", default="auto", help="a folder, 'auto' or 'none' (no journal)")
    p.add_argument("--durability", default="paced", choices=["paced", "every_step"])
    p.add_argument("--pause-before")
    p.add_argument("--pause-after")
    p.add_argument("--truth")
    p.add_argument("--out")
    args = p.parse_args(argv)
    storage_options = json.loads(args.storage_options)
    m, opts = make()
    if args.mode == "truth":
        truth = {0: state(m, opts)}
        for step in range(1, args.steps + 1):
            step_once(m, opts, step)
            truth[step] = state(m, opts)
        torch.save(truth, args.out)
        return
    storage = FsspecStorage(args.url, part_size=args.part_size, multipart_threshold=args.part_size,
                            **storage_options)
    if args.mode == "train":
        engine = CheckpointEngine(Tracing(storage, args.pause_before, args.pause_after), options(args))
        engine.start(m, opts, 0)
        engine.write_base(0, m.state_dict(), [o.state_dict() for o in opts], {"step": 0})
        say("STARTED")
        train(engine, m, opts, 1, args.steps)
        say(f"DURABLE {engine.close()}")
        return
    truth = torch.load(args.truth, weights_only=True)
    engine = CheckpointEngine(storage, options(args))
    try:
        step = engine.restore(m, opts).step
    except CheckpointNotFoundError:  # killed before the first base was committed: start over
        step = 0
    say(f"RESTORED {step}")
    assert_bitwise_equal(truth[step], state(m, opts))
    engine.start(m, opts, step)
    engine.write_base(step, m.state_dict(), [o.state_dict() for o in opts], {"step": step})
    train(engine, m, opts, step + 1, args.steps)
    assert engine.close() == args.steps
    assert_bitwise_equal(truth[args.steps], state(m, opts))
    say("OK")


if __name__ == "__main__":
    main()
