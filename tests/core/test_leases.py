"""Gradients taken without a copy (``diffckpt/leases.py``): every way training can touch a
gradient after ``optimizer.step()``, each run recorded every step and restored bitwise against
the true state, on the CPU and (when present) on a CUDA device."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_runs import untouched
from helpers import assert_bitwise_equal

from diffckpt import CheckpointEngine, CheckpointOptions
from diffckpt.errors import DiffCkptError
from diffckpt.leases import TRUST_AFTER, GradientLeases, copy_tensors, exclusive
from diffckpt.staging import HostStage, PinnedPool

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
STEPS = 9


def make(device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(device)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def batch(step: int, device: str) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(device)


class Loop:
    """A training loop whose handling of gradients around the step is one of ``MODES``."""

    def __init__(self, mode: str, device: str, batches: dict[int, torch.Tensor] | None = None) -> None:
        self.mode, self.device = mode, device
        self.batches = batches or {}  # made ahead (on the device), else each step's own
        self.model, self.opt = make(device)
        self.kept: list[torch.Tensor] = []
        self.flat: torch.Tensor | None = None

    def backward(self, step: int) -> None:
        x = self.batches[step] if step in self.batches else batch(step, self.device)
        loss = self.model(x).pow(2).mean()
        m, opt = self.mode, self.opt
        if m == "lightning":  # forward, then zero_grad, then backward (Lightning's closure)
            opt.zero_grad()
        elif m == "set_to_none_false":
            opt.zero_grad(set_to_none=False)
        elif m == "module_set_to_none_false":
            self.model.zero_grad(set_to_none=False)
        elif m == "module_zero_grad":
            self.model.zero_grad()
        elif m == "accumulate_after_trust" and step <= 5:
            opt.zero_grad()
        loss.backward()
        if m == "bucket_view":  # DDP's gradient_as_bucket_view: views into one reused buffer
            params = list(self.model.parameters())
            if self.flat is None:
                self.flat = torch.empty(sum(p.numel() for p in params), device=self.device)
            offset = 0
            for p in params:
                view = self.flat[offset : offset + p.numel()].view_as(p)
                view.copy_(p.grad)
                p.grad = view
                offset += p.numel()

    def after_step(self, step: int) -> None:
        m, opt = self.mode, self.opt
        if m in ("set_to_none", "bucket_view"):
            opt.zero_grad()
        elif m == "user_inplace" and step == 6:
            for p in self.model.parameters():
                p.grad.mul_(2)  # changed while the record holds it: caught
            opt.zero_grad()
        elif m == "user_inplace":
            opt.zero_grad()
        elif m == "kept_reference":
            if step == 6:
                self.kept = [p.grad for p in self.model.parameters()]
            opt.zero_grad()
            if step == 7:
                for g in self.kept:
                    g.mul_(3)  # written after training let go, through a reference it kept

    def run(self, engine: CheckpointEngine, steps: int = STEPS,
            at_step: Callable[[int], None] | None = None) -> dict[int, dict[str, Any]]:
        truth = {}
        engine.start(self.model, [self.opt], 0)
        engine.write_base(0, self.model.state_dict(), [self.opt.state_dict()], {"x": 0})
        for step in range(1, steps + 1):
            self.backward(step)
            self.opt.step()
            truth[step] = untouched(self.model, [self.opt])
            if at_step is not None:
                at_step(step)
            self.after_step(step)
            engine.record_step(step, {"x": step})
        return truth


MODES = ["set_to_none", "lightning", "module_zero_grad", "set_to_none_false", "module_set_to_none_false",
         "accumulate_after_trust", "bucket_view", "kept_reference"]


def restored(root: Path, step: int, device: str) -> dict[str, Any]:
    model, opt = make(device)
    result = CheckpointEngine(str(root)).restore(model, [opt], step)
    assert result.step == step
    return untouched(model, [opt])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_every_way_of_touching_gradients_after_the_step_restores_bitwise(tmp_path: Path, mode: str,
                                                                         device: str) -> None:
    loop = Loop(mode, device)
    engine = CheckpointEngine(str(tmp_path), CheckpointOptions(write_batch=2, base_every_n_steps=None,
                                                               fingerprint_every_n_steps=1))
    leased: dict[int, bool] = {}

    def at_step(step: int) -> None:  # did the newest record take .grad itself?
        event = engine.recorder.capture._events[-1]  # type: ignore[union-attr]
        leased[step] = event["grads"][0][0] is loop.opt.param_groups[0]["params"][0].grad

    truth = loop.run(engine, at_step=at_step)
    assert engine.close() == STEPS
    for step in (3, 6, STEPS):
        assert_bitwise_equal(truth[step], restored(tmp_path, step, device))
    never = {"set_to_none_false", "module_set_to_none_false", "bucket_view"}
    if mode in never:  # training keeps or reuses its gradients: always copied
        assert not any(leased.values()), leased
    else:  # trusted once TRUST_AFTER steps let go cleanly: the records hold .grad itself
        assert leased[TRUST_AFTER + 1], leased
        assert not any(leased[s] for s in range(1, TRUST_AFTER + 1)), leased


@pytest.mark.parametrize("device", DEVICES)
def test_a_gradient_changed_while_leased_is_never_written(tmp_path: Path, device: str) -> None:
    loop = Loop("user_inplace", device)
    engine = CheckpointEngine(str(tmp_path), CheckpointOptions(write_batch=1, base_every_n_steps=None))
    with pytest.raises(DiffCkptError, match="copy_gradients=True"):
        loop.run(engine)
    assert engine.close() == 5  # the steps before it are written
    model, opt = make(device)
    assert CheckpointEngine(str(tmp_path)).restore(model, [opt]).step == 5


@pytest.mark.parametrize("device", DEVICES)
def test_copy_gradients_records_code_that_changes_gradients_after_the_step(tmp_path: Path, device: str) -> None:
    loop = Loop("user_inplace", device)
    engine = CheckpointEngine(str(tmp_path), CheckpointOptions(write_batch=1, copy_gradients=True))
    truth = loop.run(engine)
    assert engine.close() == STEPS
    assert_bitwise_equal(truth[STEPS], restored(tmp_path, STEPS, device))


def test_a_full_queue_ends_the_leases_the_writer_waits_for(tmp_path: Path) -> None:
    """Lightning's order keeps .grad attached at the commit, so the writer waits for the lease
    while the queue (1 byte) is full: the training thread must end the lease, not deadlock."""
    loop = Loop("lightning", "cpu")
    engine = CheckpointEngine(str(tmp_path), CheckpointOptions(write_batch=1, max_pending_bytes=1,
                                                               base_every_n_steps=None))
    done: dict[str, Any] = {}

    def train() -> None:
        done["truth"] = loop.run(engine, steps=STEPS)
        done["durable"] = engine.close()

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "training and the writer wait for each other"
    assert done["durable"] == STEPS
    assert_bitwise_equal(done["truth"][STEPS], restored(tmp_path, STEPS, "cpu"))


def test_a_wait_copies_the_leases_handed_over_and_spares_the_record_being_handed_over() -> None:
    """Before training waits for the writer, the writer may be waiting for a lease of a record
    handed over before: that one ends with a copy. The record being handed over is not in the
    writer's queue yet, so its gradients stay leased (a copy would cost the training thread a
    pass over them every step the writer is behind)."""
    model, opt = make("cpu")
    leases = GradientLeases([opt])
    taken = []
    for step in range(TRUST_AFTER + 2):
        opt.zero_grad()  # set_to_none: lets go of the previous step's gradients
        model(batch(step, "cpu")).pow(2).mean().backward()
        opt.step()
        grads, lease = leases.take(0, opt, lambda g: g)
        taken.append((grads, lease))
    (_, old), (new_grads, new) = taken[-2], taken[-1]
    assert old is not None and new is not None
    assert not new.ended
    attached = [p.grad for p in model.parameters()]
    assert all(any(g is a for a in attached) for g in new_grads[0])  # leased: the tensors themselves
    leases.settle(before_change=False, resolve=True, spare=[new])
    assert old.ended and not new.ended
    assert all(any(g is a for a in attached) for g in new_grads[0])  # spared: still not copied
    leases.settle(before_change=False, resolve=True)  # a flush: nothing is spared
    assert new.ended
    assert not any(g is a for g in new_grads[0] for a in attached)  # copied, equal
    assert all(torch.equal(g, a) for g, a in zip(new_grads[0], attached))
    leases.remove()


def test_the_writer_reads_a_leased_record_at_once_and_journals_it_once_training_let_go(tmp_path: Path) -> None:
    """A loop lets go of a step's gradients when its next step begins, after the device's time.
    The writer does not wait for that to read them (it would have the host's few milliseconds of
    the next step to write the record in, and training would wait for it at the next commit);
    it journals the record only once training let go of them unchanged."""
    loop = Loop("lightning", "cpu")  # zero_grad comes before the next backward: .grad stays attached
    engine = CheckpointEngine(str(tmp_path), CheckpointOptions(write_batch=100, base_every_n_steps=None))
    last = TRUST_AFTER + 3
    truth = loop.run(engine, steps=last)
    writer = engine.recorder.writer
    deadline = time.monotonic() + 60
    while not (writer._open is not None and writer._open.steps and writer._open.steps[-1][0] == last):
        assert time.monotonic() < deadline, "the writer did not read the leased record"
        time.sleep(0.01)
    assert writer.journal is not None and writer.journaled_step == last - 1  # read, not journaled
    loop.opt.zero_grad()  # the next step begins: training lets go, unchanged
    while writer.journaled_step != last:
        assert time.monotonic() < deadline, "the record was not journaled once training let go"
        time.sleep(0.01)
    assert engine.close() == last
    assert_bitwise_equal(truth[last], restored(tmp_path, last, "cpu"))


def test_views_and_shared_storage_are_never_taken() -> None:
    flat = torch.zeros(10)
    assert exclusive(torch.zeros(3, 2))
    assert not exclusive(flat[2:8].view(3, 2))  # a bucket view
    assert not exclusive(flat[:6].view(3, 2))  # starts the buffer, but does not own all of it
    assert not exclusive(torch.zeros(2, 3).t())  # not contiguous
    assert not exclusive(torch.zeros(3, requires_grad=True))
    copies = copy_tensors([flat, torch.ones(2, 2).t()])
    assert copies[0].data_ptr() != flat.data_ptr() and torch.equal(copies[1], torch.ones(2, 2))


def test_hooks_and_zero_grad_wrapper_come_off() -> None:
    model, opt = make("cpu")
    leases = GradientLeases([opt])
    assert "zero_grad" in opt.__dict__ and all(p._backward_hooks for p in model.parameters())
    leases.remove()
    assert "zero_grad" not in opt.__dict__ and not any(p._backward_hooks for p in model.parameters())


def test_the_pinned_pool_reuses_buffers_and_stays_within_its_bound() -> None:
    pool = PinnedPool(capacity=64, pin=False)
    a = pool.take(torch.zeros(4, 2))  # 32 bytes: pooled
    b = pool.take(torch.zeros(8))  # 32 more: pooled, the pool is full
    c = pool.take(torch.zeros(4, 2))  # past the bound: ordinary memory, not kept
    assert pool.held == 64 and a.shape == (4, 2) and c.shape == (4, 2)
    pool.give_back([a, b, c])
    assert pool.take(torch.ones(4, 2)) is a and pool.take(torch.ones(8)) is b
    assert pool.take(torch.ones(4, 2)) is not c and pool.held == 64


def test_host_records_pass_the_stage_untouched() -> None:
    stage = HostStage()
    record = {"grads": [[torch.ones(2), None]], "step": 3}
    assert HostStage.mark(record) is None
    staged, buffers = stage.to_host(record, [])
    assert staged is record and buffers == []


@pytest.mark.cuda
@pytest.mark.parametrize("bf16_valued", [False, True], ids=["float32", "bf16-valued"])
def test_capture_never_synchronises_the_training_stream(tmp_path: Path, bf16_valued: bool) -> None:
    """With CUDA's sync debug mode on, every implicit synchronisation (a blocking device-to-host
    copy, ``.item()``) is reported: none may come from the training thread while it records
    every step. The mode is process-wide, and the writer thread waits for its own side stream by
    design (``staging.py``), so the mode is "warn" and each report is attributed to its thread.
    ``bf16-valued``: the first layer's gradients hold bfloat16 values (as under bf16 autocast), so
    the writer narrows them on the device (reading their flags back) while training goes on."""
    import warnings

    batches = {step: batch(step, "cuda") for step in range(1, STEPS + 1)}  # the test's own copies
    loop = Loop("set_to_none", "cuda", batches)
    if bf16_valued:
        for p in loop.model[0].parameters():
            p.register_hook(lambda g: g.to(torch.bfloat16).to(torch.float32))
    engine = CheckpointEngine(str(tmp_path), CheckpointOptions(write_batch=2, base_every_n_steps=None,
                                                               fingerprint_every_n_steps=None))
    engine.start(loop.model, [loop.opt], 0)
    engine.write_base(0, loop.model.state_dict(), [loop.opt.state_dict()], {"x": 0})
    torch.cuda.synchronize()
    reports: list[tuple[str, str]] = []
    shown = warnings.showwarning

    def attribute(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        reports.append((threading.current_thread().name, str(message)))

    training = threading.current_thread().name
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = attribute
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for step in range(1, STEPS + 1):
                loop.backward(step)
                loop.opt.step()
                loop.after_step(step)
                engine.record_step(step, {"x": step})
            loop.model[0].weight.sum().item()  # a known synchronisation: the mode is on and reports
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    # Each report says "called a synchronizing CUDA operation"; torch's one-off notice that the mode
    # is a prototype ("... does not yet detect all synchronizing operations") is not one.
    synced = [text for thread, text in reports if thread == training and "called a synchronizing" in text]
    assert len(synced) == 1, reports  # the .item() above, and nothing while the steps were recorded
    truth = {STEPS: untouched(loop.model, [loop.opt])}
    assert engine.close() == STEPS
    assert_bitwise_equal(truth[STEPS], restored(tmp_path, STEPS, "cuda"))


def test_the_wrapped_zero_grad_keeps_the_optimizers_signature() -> None:
    """Accelerate passes set_to_none only when the signature of zero_grad has it."""
    import inspect

    _, opt = make("cpu")
    leases = GradientLeases([opt])
    assert "set_to_none" in inspect.signature(opt.zero_grad).parameters
    leases.remove()
