"""``base_every_n_steps="bytes"`` (the default) in real engine runs: bases come once the records
since the last one add up to ``base_every_diff_bytes_ratio`` bases, from the bytes the recorder
hands its writer; a single-process loop and ``commit`` size alike; every rank of a DDP job writes
(and gathers for) its bases at the same steps; the auto-tuner holds the sized interval fixed; and
the first recorded step logs what the run will take on storage."""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from engine_runs import (
    LoopState,
    assert_state,
    make,
    optimizer_step,
    restore,
    snapshot,
    train,
    train_steps,
)
from helpers import finish_process, free_port

from diffckpt import CheckpointEngine, CheckpointOptions, TuningOptions
from diffckpt.collective import TorchCollective
from diffckpt.policies import bytes_interval
from diffckpt.runstore import RunStore

STEPS = 60


class Handed:
    """What a recorder hands its writer: each record's and each base's bytes, by step."""

    def __init__(self, engine: CheckpointEngine) -> None:
        writer = engine.recorder.writer
        assert writer is not None
        self.records: dict[int, int] = {}
        self.bases: dict[int, int] = {}
        put_record, put_base = writer.put_record, writer.put_base

        def record(record: dict[str, Any], nbytes: int, *args: Any) -> None:
            self.records[record["step"]] = nbytes
            put_record(record, nbytes, *args)

        def base(step: int, tree: Any, params: Any, nbytes: int, *args: Any) -> None:
            self.bases[step] = nbytes
            put_base(step, tree, params, nbytes, *args)

        writer.put_record, writer.put_base = record, base  # type: ignore[method-assign]


def _run(root: Path, steps: int = STEPS, **options: Any) -> tuple[CheckpointEngine, Handed, dict[int, Any]]:
    """A single-process loop (record, then a base when the engine wants one) under the defaults
    but for ``options`` (retention off, so that every step can be checked)."""
    module, optimizers = make()
    engine = CheckpointEngine(str(root), CheckpointOptions(**{"write_batch": 3, "retention": None, **options}))
    engine.start(module, optimizers, 0)
    handed = Handed(engine)
    truth = {0: snapshot(module, optimizers, 0)}
    engine.write_base(0, module.state_dict(), [o.state_dict() for o in optimizers], {"x": 0})
    train_steps(engine, module, optimizers, 1, steps, truth)
    engine.close()
    return engine, handed, truth


def test_bases_come_once_the_records_add_up_to_ratio_bases(tmp_path: Path) -> None:
    engine, handed, truth = _run(tmp_path / "run")
    ratio = engine.options.base_every_diff_bytes_ratio
    bases = sorted(handed.bases)
    assert bases[0] == 0 and len(bases) >= 4, bases  # periodic bases, not only the starting one
    for prev, nxt in itertools.pairwise(bases):
        # Sized at the first step after ``prev`` from the session's bytes per step so far and
        # the larger of the newest base and a base as it would be then.
        recorded = [handed.records[s] for s in range(1, prev + 2)]
        size = max(handed.bases[prev], handed.bases[nxt])  # state sizes are constant after step 1
        assert nxt - prev == bytes_interval(ratio, size, sum(recorded) / len(recorded)), (prev, nxt)
        # So a restore from ``prev`` reads about ``ratio`` bases of diffs, never much more.
        between = sum(handed.records[s] for s in range(prev + 1, nxt))
        assert ratio * size - 2 * max(recorded) <= between <= ratio * size, (prev, nxt, between)
    assert engine.settings.base_every_n_steps == bases[-1] - bases[-2]
    assert [b.step for b in RunStore(engine.storage).inventory().bases] == bases
    for step in (bases[1] - 1, bases[-1], STEPS):
        assert_state(truth, *restore(tmp_path / "run", step))


def test_the_ratio_scales_the_interval_and_runs_repeat_exactly(tmp_path: Path) -> None:
    one, _, _ = _run(tmp_path / "one", base_every_diff_bytes_ratio=1.0)
    eight, _, _ = _run(tmp_path / "eight", base_every_diff_bytes_ratio=8.0)
    n1, n8 = one.settings.base_every_n_steps, eight.settings.base_every_n_steps
    assert n1 is not None and n8 is not None and 7 * n1 <= n8 <= 8 * n1, (n1, n8)
    # Sizes, not times, decide: the same run twice writes its bases at the same steps.
    again, _, _ = _run(tmp_path / "again", base_every_diff_bytes_ratio=1.0)
    steps = [[b.step for b in RunStore(e.storage).inventory().bases] for e in (one, again)]
    assert steps[0] == steps[1] and len(steps[0]) > 5


@pytest.mark.parametrize(("value", "expected"), [(7, [0, 7, 14, 21, 28]), (None, [0])])
def test_an_explicit_interval_keeps_its_meaning(tmp_path: Path, value: int | None, expected: list[int]) -> None:
    engine, handed, _ = _run(tmp_path / "run", 30, base_every_n_steps=value, base_every_diff_bytes_ratio=0.5)
    assert sorted(handed.bases) == expected and engine.settings.base_every_n_steps == value


def test_commit_sizes_at_its_review_as_a_plain_loop_does(tmp_path: Path) -> None:
    """Through ``begin``/``commit`` (what adapters call) the interval is sized at the review of the
    second commit after each base, from the same bytes a plain loop would size it from."""
    module, optimizers = make()
    sched = torch.optim.lr_scheduler.StepLR(optimizers[0], 10)
    engine = CheckpointEngine(str(tmp_path / "run"), CheckpointOptions(write_batch=3, retention=None))
    engine.begin(module, optimizers, 0, LoopState(sched))
    handed, based = Handed(engine), []
    for step in range(1, STEPS + 1):
        optimizer_step(module, optimizers, step)
        sched.step()
        if engine.commit(step, LoopState(sched)).base:
            based.append(step)
    engine.end()
    n = engine.settings.base_every_n_steps
    assert n is not None and len(based) >= 3 and sorted(handed.bases) == based
    # The first interval is sized from step 1 alone and a base without its state; once a
    # periodic base is written, from its size (and the records' average) for good.
    assert based[0] <= n and all(b - a == n for a, b in itertools.pairwise(based[1:])), (n, based)
    per_step = sum(handed.records[s] for s in range(1, based[0] + 2)) / (based[0] + 1)
    assert based[1] - based[0] == bytes_interval(4.0, handed.bases[based[0]], per_step)


def test_the_tuner_keeps_the_byte_sized_interval(tmp_path: Path) -> None:
    """``every_n_steps`` and ``write_batch`` on "auto" with bases sized by bytes: the tuner
    chooses the two, and its decisions carry the interval sized from bytes."""
    module, optimizers = make()
    engine = CheckpointEngine(str(tmp_path / "run"), CheckpointOptions(
        every_n_steps="auto", write_batch="auto", retention=None,
        tuning=TuningOptions(mtbf_s=60, retune_every_n_steps=10, max_overhead=0.5)))
    engine.start(module, optimizers, 0)
    truth = {0: snapshot(module, optimizers, 0)}
    engine.write_base(0, module.state_dict(), [o.state_dict() for o in optimizers], {"x": 0})
    engine.flush()  # the tuner decides once a write is timed

    def review(engine: CheckpointEngine, step: int) -> None:
        if engine.recorder.review_due(step):
            engine.recorder.review(step)

    train_steps(engine, module, optimizers, 1, STEPS, truth, every=None, before_record=review)
    engine.close()
    log = RunStore(engine.storage).tuning_log(1)
    n = engine.settings.base_every_n_steps
    assert log and n is not None and n >= 1
    assert all(d["settings"]["base_every_n_steps"] == n for d in log[-1:])
    bases = [b.step for b in RunStore(engine.storage).inventory().bases]
    assert len(bases) >= 3, bases
    assert_state(truth, *restore(tmp_path / "run"))


def test_the_first_record_logs_the_projected_storage(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="diffckpt"):
        train(tmp_path / "run", 12, base_every_n_steps="bytes", retention=CheckpointOptions().retention)
    lines = [r.getMessage() for r in caplog.records if r.name == "diffckpt" and "projected storage" in r.getMessage()]
    assert len(lines) == 1, lines  # once per session, at its first record
    line = lines[0]
    assert "per 1,000 steps" in line and "recorded per step" in line and " base every " in line
    assert "retention keeps the chains of the 2 newest bases" in line and "on disk at most" in line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="diffckpt"):
        train(tmp_path / "other", 3, base_every_n_steps=None)  # retention=None in these runs
    (line,) = [r.getMessage() for r in caplog.records if "projected storage" in r.getMessage()]
    assert "no periodic bases" in line and "no retention (retention=None)" in line


# ---------------------------------------------------------------------------------- DDP
def _ddp_worker(rank: int, port: int, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    module, optimizers = make()
    sched = torch.optim.lr_scheduler.StepLR(optimizers[0], 10)
    engine = CheckpointEngine(root, CheckpointOptions(write_batch=3), collective=TorchCollective())
    engine.begin(module, optimizers, 0, LoopState(sched))
    based, sizes = [], []
    for step in range(1, 41):
        for o in optimizers:
            o.zero_grad()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        module(x).pow(2).mean().backward()
        for p in module.parameters():  # what DDP does: every rank steps on the same gradients
            if p.grad is not None:
                dist.all_reduce(p.grad)
        for o in optimizers:
            o.step()
        sched.step()
        if engine.commit(step, LoopState(sched)).base:
            based.append(step)
        sizes.append(engine.settings.base_every_n_steps)
    engine.end()
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"based": based, "sizes": sizes, "wrote": engine.recorder.writer is not None
                   or engine.recorder.durable_step is not None}, f)
    dist.barrier()
    finish_process()  # no interpreter finalization, which aborts a gloo process now and then


def test_every_ddp_rank_bases_at_the_steps_rank_0_sized(tmp_path: Path) -> None:
    """Only rank 0 records, so only it knows the bytes: the interval it sizes reaches rank 1 with
    the review's broadcast, and both commit the same bases (whose gathers would otherwise hang)."""
    port = free_port()
    root, out = str(tmp_path / "run"), str(tmp_path / "out")
    sys.path.insert(0, os.path.dirname(__file__))  # the spawned processes import this module
    mp.spawn(_ddp_worker, args=(port, root, out), nprocs=2, join=True)
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["wrote"] and not ranks[1]["wrote"]
    assert ranks[0]["based"] == ranks[1]["based"] and len(ranks[0]["based"]) >= 2, ranks
    assert ranks[0]["sizes"] == ranks[1]["sizes"] and ranks[0]["sizes"][0] is None  # sized from step 2 on
    bases = [b.step for b in RunStore(CheckpointEngine(root).storage).inventory().bases]
    assert set(bases) <= {0, *ranks[0]["based"]} and len(bases) <= 3  # the default retention at work
