"""GradientCompressor as a real DDP communication hook without any framework: 2 processes over
gloo, each codec. The payloads are identical on both ranks, both ranks step with the same
gradients, and rank 0's records replay in a single process to the trained state bit for bit."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import assert_bitwise_equal, finish_process, free_port

from diffckpt import CheckpointEngine, CheckpointOptions, GradientCompressor
from diffckpt.codecs import LowPrecision, PowerSGD, TopK
from diffckpt.planning import plan

CODECS = {"topk": lambda: TopK(0.05), "topk-ef": lambda: TopK(0.05, error_feedback=True),
          "powersgd": lambda: PowerSGD(rank=2), "bf16": lambda: LowPrecision("bf16")}
STEPS = 6


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 24), torch.nn.Linear(24, 1))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def worker(rank: int, port: int, codec: str, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    module, opt = make()
    ddp = torch.nn.parallel.DistributedDataParallel(module)
    compressor = GradientCompressor(CODECS[codec](), module, check_every=1)
    compressor.register_ddp(ddp)
    compressor.set_clipping("norm", 0.5)
    engine = CheckpointEngine(root, CheckpointOptions(write_batch=2, base_every_n_steps=None))
    if rank == 0:
        engine.start(module, [opt], 0, compressor=compressor)
        engine.write_base(0, module.state_dict(), [opt.state_dict()], {"x": 0})
    for step in range(1, STEPS + 1):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(100 * step + rank))  # per-rank data
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 0.5)
        opt.step()
        if rank == 0:
            engine.record_step(step, {"x": step})
    if rank == 0:
        engine.close()
    torch.save({"model": module.state_dict(), "optimizer": opt.state_dict()}, f"{root}.rank{rank}.pt")
    # Tear down together: a rank that destroys its group while the other is still flushing has
    # been seen to abort in gloo ("terminate called without an active exception").
    dist.barrier()
    finish_process()  # no interpreter finalization, which aborts a gloo process now and then


@pytest.mark.parametrize("codec", CODECS)
def test_ddp_hook_payloads_replay_exactly(tmp_path, codec: str) -> None:
    root = str(tmp_path / "run")
    sys.path.insert(0, os.path.dirname(__file__))  # the spawned processes import this module
    mp.spawn(worker, args=(free_port(), codec, root), nprocs=2, join=True)
    ranks = [torch.load(f"{root}.rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert_bitwise_equal(ranks[0], ranks[1])  # both ranks consumed the same decoded gradients
    store = CheckpointEngine(root).recorder.store
    events = [r["events"][0] for r, _ in store.read_records(plan(store, STEPS))]
    assert len(events) == STEPS and all("payloads" in e for e in events)  # checked every step
    if codec.startswith("topk"):
        assert events[0]["payloads"][0][0]["values"].shape[0] == 2  # both ranks' entries
    module, opt = make()
    result = CheckpointEngine(root).restore(module, [opt], STEPS)  # one process, rank 0's records
    assert result.step == STEPS
    assert_bitwise_equal(ranks[0], {"model": module.state_dict(), "optimizer": opt.state_dict()})
