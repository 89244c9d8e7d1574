"""The every-process engine calls in a plain DDP loop on two gloo processes: begin, commit, end,
resume and agree, with the engine (not the loop) deciding who writes and exchanging what ranks
share. The resumed run is compared bitwise, on every rank, with a run that never used diffckpt."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from engine_runs import LoopState
from helpers import finish_process, free_port
from torch.nn.parallel import DistributedDataParallel as DDP

from diffckpt.collective import LocalCollective, TorchCollective
from diffckpt.engine import CheckpointEngine
from diffckpt.leases import exclusive
from diffckpt.options import CheckpointOptions
from diffckpt.rng import set_rng_state

STEPS, STOP = 9, 5
OPTIONS = CheckpointOptions(write_batch=2, base_every_n_steps=4)


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    return m, opt, torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)


def train(ddp: Any, opt: Any, sched: Any, rank: int, first: int, last: int, engine: Any = None) -> None:
    bucket_view = getattr(ddp, "gradient_as_bucket_view", False)  # False: no DDP wrapper
    for step in range(first + 1, last + 1):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(100 * step + rank))  # per-rank data
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        # gradient_as_bucket_view: .grad are views into DDP's buckets, which the next all-reduce
        # overwrites; a record must copy them, never take them.
        assert all(exclusive(p.grad) != bucket_view for p in ddp.parameters())
        opt.step()
        sched.step()
        if engine is not None:
            done = engine.commit(step, LoopState(sched))
            assert done.restorable  # every_n_steps=1


def everything(module: Any, opt: Any, sched: Any) -> dict[str, Any]:
    return {"model": module.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "rng": torch.get_rng_state()}


def worker(rank: int, port: int, root: str, out: str, bucket_view: bool) -> None:
    # With bucket views, no base after the first, so the resume replays steps whose gradients
    # the next all-reduce overwrote in the buckets (a record must hold copies of them).
    options = CheckpointOptions(write_batch=2, base_every_n_steps=None) if bucket_view else OPTIONS
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.new_group([0, 1])  # an explicit group: the collective must map its ranks
    torch.manual_seed(rank)

    # The reference: the whole run, no diffckpt.
    module, opt, sched = make()
    torch.manual_seed(1000 + rank)
    train(DDP(module, gradient_as_bucket_view=bucket_view), opt, sched, rank, 0, STEPS)
    reference = everything(module, opt, sched)

    # Checkpointed, stopped at STOP.
    module, opt, sched = make()
    torch.manual_seed(1000 + rank)
    engine = CheckpointEngine(root, options, collective=TorchCollective(group))
    assert engine.rank == rank and engine.world_size == 2 and engine.is_main_process == (rank == 0)
    assert engine.resume(module, [opt], missing_ok=True) is None  # nothing there yet
    engine.begin(module, [opt], 0, LoopState(sched), meta={"framework": "plain DDP loop"})
    train(DDP(module, gradient_as_bucket_view=bucket_view), opt, sched, rank, 0, STOP, engine)
    assert engine.agree(rank == 1) and not engine.agree(False)
    durable = engine.end("stopped for the test")
    assert durable == (STOP if rank == 0 else None)

    # Resumed in fresh objects, continued to the end.
    torch.manual_seed(4242)  # whatever the RNG is now, the resume restores this rank's
    module, opt, sched = make()
    engine = CheckpointEngine(root, options, collective=TorchCollective(group))
    result = engine.resume(module, [opt])
    assert result is not None and result.step == STOP
    sched.load_state_dict(result.state["scheduler"])
    set_rng_state(engine.own(result.state["ranks"])["rng"])
    engine.begin(module, [opt], STOP, LoopState(sched))
    train(DDP(module, gradient_as_bucket_view=bucket_view), opt, sched, rank, STOP, STEPS, engine)
    engine.end()
    torch.save({"reference": reference, "resumed": everything(module, opt, sched)}, f"{out}.rank{rank}.pt")
    dist.barrier()
    finish_process()  # no interpreter finalization, which aborts a gloo process now and then


@pytest.mark.parametrize("bucket_view", [False, True], ids=["own-grads", "gradient_as_bucket_view"])
def test_plain_ddp_loop_resumes_bit_exact_on_every_rank(tmp_path, bucket_view: bool) -> None:
    root, out = str(tmp_path / "run"), str(tmp_path / "state")
    sys.path.insert(0, os.path.dirname(__file__))  # the spawned processes import this module
    mp.spawn(worker, args=(free_port(), root, out, bucket_view), nprocs=2, join=True)
    for rank in (0, 1):
        saved = torch.load(f"{out}.rank{rank}.pt", weights_only=False)
        ref, res = saved["reference"], saved["resumed"]
        assert ref["scheduler"] == res["scheduler"]
        assert torch.equal(ref["rng"], res["rng"]), f"rank {rank}: RNG differs"
        for name, tensor in ref["model"].items():
            assert torch.equal(tensor, res["model"][name]), f"rank {rank}: {name} differs"
        for pid, state in ref["optimizer"]["state"].items():
            for key, value in state.items():
                assert torch.equal(value, res["optimizer"]["state"][pid][key]), f"rank {rank}: {pid}.{key}"
    meta = CheckpointEngine(root).recorder.store.session_meta(1)
    assert meta["world_size"] == 2 and meta["framework"] == "plain DDP loop"


def test_single_process_collective_exchanges_with_itself() -> None:
    local = LocalCollective()
    assert (local.rank, local.world_size) == (0, 1)
    assert local.gather({"a": 1}) == [{"a": 1}] and local.broadcast(7) == 7
    assert local.any(True) and not local.any(False)
    local.barrier()
    assert isinstance(CheckpointEngine("memory://collective-default").collective, LocalCollective)


def test_torch_collective_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        TorchCollective()


def test_commit_before_begin_and_twice_are_refused(tmp_path) -> None:
    from diffckpt.errors import DiffCkptError

    module, opt, sched = make()
    engine = CheckpointEngine(str(tmp_path / "run"), OPTIONS)
    with pytest.raises(DiffCkptError, match=r"begin\(\) must be called"):
        engine.commit(1, LoopState(sched))
    engine.begin(module, [opt], 0, LoopState(sched))
    with pytest.raises(DiffCkptError, match=r"begin\(\) called twice"):
        engine.begin(module, [opt], 0, LoopState(sched))
    train(module, opt, sched, 0, 0, 1, engine)
    with pytest.raises(DiffCkptError, match="steps must increase"):
        engine.commit(1, LoopState(sched))
    assert engine.end() == 1
    with pytest.raises(ValueError, match="step must be None, 'last' or a step number"):
        engine.resume(module, [opt], "first")  # type: ignore[arg-type]
    result = engine.resume(module, [opt], "last")
    assert result is not None and result.step == 1
