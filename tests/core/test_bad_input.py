"""Bad input gets a clear error or a documented fallback, never a silent wrong state.

Damage is done for real to files of real runs (flipped bytes, truncation, deletion, garbage).
Only faults that cannot be produced for real here (a full or read-only disk: tests run as root)
go through a storage wrapper, :class:`engine_runs.FaultyStorage`. Whatever a restore returns is
compared bitwise with the true state at the step it claims.
"""

from __future__ import annotations

import errno
import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_runs import (
    FaultyStorage,
    assert_state,
    base_dir,
    flip,
    make,
    record_span,
    restore,
    seg,
    snapshot,
    train,
    train_steps,
    untouched,
)
from helpers import assert_bitwise_equal

import diffckpt.handoff as handoff_module
from diffckpt import (
    CheckpointEngine,
    CheckpointNotFoundError,
    CheckpointOptions,
    CorruptRecordError,
    DiffCkptError,
    FsspecStorage,
    IncompatibleCheckpointError,
    ReplayMismatchError,
    StorageError,
    UnsupportedConfigurationError,
    load_state,
)
from diffckpt.runstore import RunStore

Truth = dict[int, dict[str, Any]]


@pytest.fixture(scope="module")
def _runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Truth]]:
    made = {}
    for name, options in {
        # bases 0, 5, 10; segments 0-3, 3-5, 5-8, 8-10, 10-13
        "bases": {},
        # base 0 only; segments 0-3, 3-6, 6-9, 9-12, 12-13
        "chain": {"base_every_n_steps": None},
    }.items():
        root = tmp_path_factory.mktemp(name) / "run"
        truth, durable = train(str(root), **options)
        assert durable == 13
        made[name] = (root, truth)
    return made


def _copy(runs: dict[str, tuple[Path, Truth]], name: str, tmp_path: Path) -> tuple[Path, Truth]:
    src, truth = runs[name]
    dst = tmp_path / name / "run"
    shutil.copytree(src, dst)
    return dst, truth


@pytest.fixture
def chain(_runs: dict[str, tuple[Path, Truth]], tmp_path: Path) -> tuple[Path, Truth]:
    """A run with one base at 0 and a chain of segments to step 13."""
    return _copy(_runs, "chain", tmp_path)


@pytest.fixture
def bases(_runs: dict[str, tuple[Path, Truth]], tmp_path: Path) -> tuple[Path, Truth]:
    """A run with bases at 0, 5 and 10 and segments to step 13."""
    return _copy(_runs, "bases", tmp_path)


# =========================================================================================
# corrupt, truncated and missing segments
# =========================================================================================
def test_intact_runs_restore_every_step_without_warnings(chain: tuple[Path, Truth],
                                                          bases: tuple[Path, Truth]) -> None:
    layouts = {chain[0]: [(0, 3), (3, 6), (6, 9), (9, 12), (12, 13)],
               bases[0]: [(0, 3), (3, 5), (5, 8), (8, 10), (10, 13)]}
    for root, truth in (chain, bases):
        inv = RunStore(FsspecStorage(str(root))).inventory()
        assert [(s.after, s.last) for s in inv.segments] == layouts[root]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for step in (None, 0, 4, 5, 7, 13):
                result, m, o = restore(str(root), step)
                assert result.step == (13 if step is None else step)
                assert_state(truth, result, m, o)


def test_flipped_byte_in_a_middle_segment_restores_the_step_before_it(chain: tuple[Path, Truth]) -> None:
    root, truth = chain
    path = seg(root, 6, 9)
    offset, length = record_span(path.read_bytes(), 8)
    flip(path, offset + length // 2)
    name = "diffs/000000000006-000000000009.g000001.seg"
    with pytest.warns(UserWarning, match=rf"{name}: record for step 8 fails its checksum.*restoring step 7"):
        result, m, o = restore(str(root))
    assert result.step == 7
    assert_state(truth, result, m, o)
    # the standalone loader shares the same path and says the same
    with pytest.warns(UserWarning, match=name):
        loaded = load_state(str(root))
    assert loaded["step"] == 7
    assert_bitwise_equal(truth[7]["model"], loaded["model"])
    # an explicit step past the damage is an error naming the object, never an older state
    for step in (8, 11, 13):
        with pytest.raises(CorruptRecordError, match=rf"cannot rebuild step {step}: {name}") as info:
            restore(str(root), step)
        assert "newest intact: 7" in str(info.value)
    # steps before the damage are unaffected, without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result, m, o = restore(str(root), 7)
    assert_state(truth, result, m, o)


def test_flipped_byte_behind_a_newer_base_does_not_affect_last(bases: tuple[Path, Truth]) -> None:
    root, truth = bases
    path = seg(root, 5, 8)
    offset, _ = record_span(path.read_bytes(), 6)
    flip(path, offset + 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result, m, o = restore(str(root))  # base 10 + 10-13 does not need the damaged segment
    assert result.step == 13
    assert_state(truth, result, m, o)
    for step in (6, 7):
        with pytest.raises(CorruptRecordError, match="000000000005-000000000008.g000001.seg"):
            restore(str(root), step)
    for step in (5, 10, 12):
        result, m, o = restore(str(root), step)
        assert_state(truth, result, m, o)


@pytest.mark.parametrize("cut", ["half", "header", "trailer"])
def test_truncated_segment(chain: tuple[Path, Truth], cut: str) -> None:
    """A segment cut short, even by its last byte only, has lost its index (at its end from
    format 3 on, docs/format.md section 4): it is unusable as a whole, and restore goes back to
    the step before it."""
    root, truth = chain
    path = seg(root, 6, 9)
    data = path.read_bytes()
    size = {"half": len(data) // 2, "header": 20, "trailer": len(data) - 1}[cut]
    path.write_bytes(data[:size])
    with pytest.warns(UserWarning, match="000000000006-000000000009.g000001.seg"):
        result, m, o = restore(str(root))
    assert result.step == 6
    assert_state(truth, result, m, o)
    with pytest.raises(CorruptRecordError, match="000000000006-000000000009.g000001.seg"):
        restore(str(root), 13)


def test_deleted_segment_is_a_gap(chain: tuple[Path, Truth]) -> None:
    root, truth = chain
    seg(root, 6, 9).unlink()
    with pytest.warns(UserWarning, match=r"after step 6 .*000000000009-000000000012.g000001.seg.*up to 13"):
        result, m, o = restore(str(root))
    assert result.step == 6
    assert_state(truth, result, m, o)
    for step in (7, 9, 13):
        with pytest.raises(CheckpointNotFoundError, match=rf"step {step} is not durable.*durable steps: g1: 0\.\.6\."):
            restore(str(root), step)
        with pytest.raises(CheckpointNotFoundError, match="g1: 0..6"):
            load_state(str(root), step)


def test_gap_behind_a_newer_base_lists_the_durable_ranges(bases: tuple[Path, Truth]) -> None:
    root, truth = bases
    seg(root, 5, 8).unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result, m, o = restore(str(root))
    assert result.step == 13
    assert_state(truth, result, m, o)
    with pytest.raises(CheckpointNotFoundError, match=r"step 7 is not durable.*g1: 0\.\.5, 10\.\.13"):
        restore(str(root), 7)


def test_missing_step_beyond_the_run(bases: tuple[Path, Truth]) -> None:
    root, _ = bases
    with pytest.raises(CheckpointNotFoundError, match=r"step 99 is not durable.*g1: 0\.\.13.*diffckpt ls"):
        restore(str(root), 99)


# =========================================================================================
# damaged bases: fall back to an older base of the same session
# =========================================================================================
def _damage_base(root: Path, step: int, how: str) -> str:
    d = base_dir(root, step)
    if how == "missing state":
        (d / "state.safetensors").unlink()
        return "state.safetensors is missing although its COMMIT exists"
    if how == "checksum":
        flip(d / "state.safetensors", 200)
        return "state.safetensors fails its checksum"
    if how == "truncated state":
        data = (d / "state.safetensors").read_bytes()
        (d / "state.safetensors").write_bytes(data[: len(data) // 2])
        return "state.safetensors fails its checksum"
    if how == "garbage commit":
        (d / "COMMIT").write_bytes(b"{not json")
        return "COMMIT: COMMIT marker is damaged"
    if how == "foreign commit":  # a valid marker of another base
        (d / "COMMIT").write_bytes((base_dir(root, 0) / "COMMIT").read_bytes())
        return "describes step 0 of session 1, not its own directory"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["missing state", "checksum", "truncated state", "garbage commit",
                                 "foreign commit"])
def test_damaged_newest_base_falls_back_to_an_older_base(bases: tuple[Path, Truth], how: str) -> None:
    root, truth = bases
    problem = _damage_base(root, 10, how)
    with pytest.warns(UserWarning, match=rf"000000000010\.g000001/.*{problem}.*older base at step 5"):
        result, m, o = restore(str(root))
    assert (result.step, result.base_step) == (13, 5)
    assert_state(truth, result, m, o)
    # an explicit step that base 10 would have served is rebuilt from base 5 as well
    for step in (10, 12):
        with pytest.warns(UserWarning, match="older base at step 5"):
            result, m, o = restore(str(root), step)
        assert (result.step, result.base_step) == (step, 5)
        assert_state(truth, result, m, o)
    # so is the standalone loader: one code path
    with pytest.warns(UserWarning, match="older base at step 5"):
        loaded = load_state(str(root))
    assert loaded["step"] == 13 and loaded["base_step"] == 5
    assert_bitwise_equal(truth[13]["model"], loaded["model"])
    assert_bitwise_equal(truth[13]["optimizers"], loaded["optimizers"])


def test_two_damaged_bases_fall_back_to_the_first(bases: tuple[Path, Truth]) -> None:
    root, truth = bases
    _damage_base(root, 10, "checksum")
    _damage_base(root, 5, "garbage commit")
    with pytest.warns(UserWarning, match=r"000000000010.*; .*000000000005.*older base at step 0"):
        result, m, o = restore(str(root))
    assert (result.step, result.base_step) == (13, 0)
    assert_state(truth, result, m, o)


def test_every_base_damaged_is_a_clear_error(bases: tuple[Path, Truth]) -> None:
    root, _ = bases
    for step in (0, 5, 10):
        _damage_base(root, step, "missing state")
    with pytest.raises(CorruptRecordError, match=r"no usable base for the newest step .*000000000010.*"
                                                 r"000000000005.*000000000000.*diffckpt verify"):
        restore(str(root))
    with pytest.raises(CorruptRecordError, match="no usable base for step 3"):
        restore(str(root), 3)


def test_an_older_base_that_reaches_less_far_is_used_with_a_warning(bases: tuple[Path, Truth]) -> None:
    root, truth = bases
    _damage_base(root, 10, "checksum")
    seg(root, 5, 8).unlink()  # base 5's chain now ends at 5; only base 10 reached 13
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result, m, o = restore(str(root))
    messages = [str(w.message) for w in caught]
    assert any("fails its checksum" in msg and "restoring step 5" in msg for msg in messages)
    assert any("after step 5" in msg for msg in messages)  # the gap is reported too
    assert (result.step, result.base_step) == (5, 5)
    assert_state(truth, result, m, o)
    with pytest.raises(CorruptRecordError, match="no usable base for step 13"):
        restore(str(root), 13)  # only base 10 reaches it


def test_damaged_only_commit_is_a_clear_error(chain: tuple[Path, Truth]) -> None:
    root, _ = chain
    (base_dir(root, 0) / "COMMIT").write_bytes(b"\x00garbage")
    with pytest.raises(CorruptRecordError, match=r"000000000000.g000001/COMMIT: COMMIT marker is damaged"):
        restore(str(root))


def test_damaged_session_file_is_a_clear_error(bases: tuple[Path, Truth]) -> None:
    root, _ = bases
    (root / "sessions" / "g000001.json").write_text("{oops")
    with pytest.raises(CorruptRecordError, match=r"sessions/g000001.json is damaged"):
        restore(str(root))
    (root / "sessions" / "g000001.json").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"sessions/g000001.json is missing"):
        restore(str(root))


# =========================================================================================
# a model or optimizer that does not match the checkpoint
# =========================================================================================
def _check_refused(root: Path, maker: Any, match: str) -> None:
    module, optimizers = maker()
    before = untouched(module, optimizers)
    with pytest.raises(IncompatibleCheckpointError, match=match):
        CheckpointEngine(str(root)).restore(module, optimizers)
    # nothing was loaded: the model and optimizers are exactly as they were
    assert_bitwise_equal(before, untouched(module, optimizers))


def _wider() -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
    return m, [torch.optim.AdamW(m.parameters(), lr=1e-2)]


def _deeper() -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1),
                            torch.nn.Linear(1, 1))
    return m, [torch.optim.AdamW(m.parameters(), lr=1e-2)]


def _double() -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    m, _ = make()
    return m.double(), [torch.optim.AdamW(m.parameters(), lr=1e-2)]


def test_different_model_is_refused_and_left_untouched(bases: tuple[Path, Truth]) -> None:
    root, _ = bases
    _check_refused(root, _wider, r"written for a different model: '2.weight' is torch.float32\[1, 16\] in the "
                                 r"checkpoint, torch.float32\[2, 16\] here")
    _check_refused(root, _deeper,
                   r"written for a different model: '3.weight' is in this model, not in the checkpoint")
    _check_refused(root, _double, r"written for a different model: .*float32.*float64")


def _sgd() -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    m, _ = make()
    return m, [torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9)]


def _two_groups() -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    m, _ = make()
    return m, [torch.optim.AdamW([{"params": m[0].parameters()},
                                  {"params": [*m[1].parameters(), *m[2].parameters()]}], lr=1e-2)]


def _two_optimizers() -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    m, _ = make()
    return m, [torch.optim.AdamW(m[0].parameters()),
               torch.optim.AdamW([*m[1].parameters(), *m[2].parameters()])]


def _subset() -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    m, _ = make()
    return m, [torch.optim.AdamW(m[2].parameters())]


def test_different_optimizer_is_refused_and_left_untouched(bases: tuple[Path, Truth]) -> None:
    root, _ = bases
    _check_refused(root, _sgd, r"optimizer 0 of class torch.optim.adamw.AdamW, not torch.optim.sgd.SGD")
    _check_refused(root, _two_groups, r"optimizer 0 \(AdamW\) had 1 param group\(s\) in training, 2 now")
    _check_refused(root, _two_optimizers, r"holds 1 optimizer\(s\) but 2 were given")
    _check_refused(root, _subset, r"param group 0 of optimizer 0 had 6 parameters in training, 2 now")


class _Pair(torch.nn.Module):
    """Two same-shaped layers whose registration order can be swapped."""

    def __init__(self, swap: bool = False) -> None:
        super().__init__()
        if swap:
            self.b = torch.nn.Linear(8, 8)
            self.a = torch.nn.Linear(8, 8)
        else:
            self.a = torch.nn.Linear(8, 8)
            self.b = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))[:, :1]


def test_parameters_in_another_order_are_refused_or_matched_by_name(tmp_path: Path) -> None:
    def trained() -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        torch.manual_seed(0)
        m = _Pair()
        return m, [torch.optim.Adam(m.parameters(), lr=1e-2)]

    def swapped() -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        torch.manual_seed(1)
        m = _Pair(swap=True)
        return m, [torch.optim.Adam(m.parameters(), lr=1e-2)]

    def swapped_in_training_order() -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        torch.manual_seed(1)
        m = _Pair(swap=True)
        return m, [torch.optim.Adam([*m.a.parameters(), *m.b.parameters()], lr=1e-2)]

    root = tmp_path / "run"
    truth, _ = train(str(root), maker=trained)
    # Same names and shapes, but optimizer state is matched by position: refused, untouched.
    _check_refused(root, swapped, r"param group 0 of optimizer 0 holds 'b.weight' at position 0, but "
                                  r"'a.weight' in training")
    # With the optimizer built in the training order, the registration order does not matter.
    for step in (None, 7):
        result, m, o = restore(str(root), step, maker=swapped_in_training_order)
        assert result.step == (13 if step is None else step)
        assert_state(truth, result, m, o)


class ScaledSGD(torch.optim.Optimizer):
    """Plain SGD whose step size depends on something its state_dict does not hold."""

    def __init__(self, params: Any, lr: float, scale: float = 1.0) -> None:
        super().__init__(params, {"lr": lr})
        self.scale = scale

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * self.scale)


def test_replay_that_diverges_from_training_raises_naming_the_step(tmp_path: Path) -> None:
    def maker(scale: float) -> Any:
        def build() -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
            m, _ = make()
            return m, [ScaledSGD(m.parameters(), lr=1e-2, scale=scale)]
        return build

    root = tmp_path / "run"
    truth, _ = train(str(root), maker=maker(1.0))
    result, m, o = restore(str(root), maker=maker(1.0))
    assert_state(truth, result, m, o)
    # Same class and state, different behaviour: replay drifts, and the fingerprints recorded in
    # training (every 2 steps) catch it at the first one after the base.
    with pytest.raises(ReplayMismatchError, match="replayed parameters at step 12 do not match"):
        restore(str(root), maker=maker(2.0))
    with pytest.raises(ReplayMismatchError, match="step 2 do not match"):
        restore(str(root), 4, maker=maker(2.0))


# =========================================================================================
# unreadable locations
# =========================================================================================
def test_dirpath_is_a_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "model.ckpt"
    path.write_bytes(b"not a run")
    with pytest.raises(CheckpointNotFoundError, match="model.ckpt is a file, not a run directory"):
        restore(str(path))
    with pytest.raises(CheckpointNotFoundError, match="is a file"):
        load_state(str(path))
    m, o = make()
    engine = CheckpointEngine(str(path))
    with pytest.raises(StorageError, match="is a file, not a directory: point dirpath at a directory"):
        engine.start(m, o, 0)
    with pytest.raises(StorageError, match="not a directory"):
        CheckpointEngine(str(path / "run")).start(m, o, 0)
    assert path.read_bytes() == b"not a run"


@pytest.mark.parametrize("url", ["{tmp}/does/not/exist", "memory://diffckpt-tests/no-such-run"])
def test_missing_run_root(tmp_path: Path, url: str) -> None:
    url = url.format(tmp=tmp_path)
    with pytest.raises(CheckpointNotFoundError, match=r"nothing under .*: the path does not exist or is empty"):
        restore(url)
    with pytest.raises(FileNotFoundError):  # also a built-in FileNotFoundError
        load_state(url, 3)


def test_directory_that_is_not_a_run(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointNotFoundError, match="is not a diffckpt run .*run.json"):
        restore(str(tmp_path))


def test_run_without_a_committed_base(tmp_path: Path) -> None:
    m, o = make()
    engine = CheckpointEngine(str(tmp_path / "run"))
    engine.start(m, o, 0)
    assert engine.close() is None
    with pytest.raises(CheckpointNotFoundError, match="never committed a base, so no step is durable"):
        restore(str(tmp_path / "run"))


# =========================================================================================
# full or read-only disk (storage wrapper: cannot be produced for real as root)
# =========================================================================================
HINTS = {errno.ENOSPC: "the disk is full: free space or point dirpath at a larger volume",
         errno.EROFS: "read-only file system: make it writable or choose another dirpath"}


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
@pytest.mark.parametrize("fail_at", [5, 7, 8, 12])  # a segment, a base's state, a COMMIT, later
def test_write_failure_surfaces_on_the_training_thread(tmp_path: Path, code: int, fail_at: int) -> None:
    root = tmp_path / "run"
    storage = FaultyStorage(str(root), fail_at=fail_at, code=code)
    m, o = make()
    engine = CheckpointEngine(storage, CheckpointOptions(write_batch=3, base_every_n_steps=5,
                                                         fingerprint_every_n_steps=2))
    truth: Truth = {}
    engine.start(m, o, 0)
    truth[0] = snapshot(m, o, 0)
    engine.write_base(0, m.state_dict(), [x.state_dict() for x in o], {"x": 0})
    with pytest.raises(DiffCkptError, match=HINTS[code]) as info:
        train_steps(engine, m, o, 1, 13, truth)
        engine.flush()
    # raised on this thread, from the writer thread's error, with the real cause kept
    assert isinstance(info.value.__cause__, StorageError)
    assert info.value.__cause__.__cause__.errno == code
    # the write failed in the background: the writer's thread, or its commit thread for a segment
    assert len(storage.failed_on) == 1 and storage.failed_on[0] in ("diffckpt-writer-g1", "diffckpt-commit-g1")
    assert storage.failed[0] in str(info.value)
    # the error is kept: the next step and close() raise it again, and close() still tears down
    with pytest.raises(DiffCkptError, match=HINTS[code]):
        engine.record_step(99, {"x": 99})
    with pytest.raises(DiffCkptError, match=HINTS[code]):
        engine.close()
    assert not engine.started
    assert len(storage.failed) == 1, "nothing was written after the failure"
    # what was committed before the failure restores exactly, and nothing after it is claimed
    committed = [p for p in storage.written if p.endswith((".seg", "/COMMIT"))]
    newest = max(int(p.split("/")[1][:12]) if p.endswith("COMMIT") else int(p[19:31]) for p in committed)
    assert engine.durable_step == newest < 13
    assert RunStore(storage).inventory().newest_step(1) == newest
    result, m2, o2 = restore(str(root), options=CheckpointOptions(local_dir=None))  # the run root alone
    assert result.step == newest
    assert_state(truth, result, m2, o2)
    # the failed writer kept its journaled spools: a resume on this node takes their steps back
    result, m2, o2 = restore(str(root))
    assert newest <= result.step <= max(truth)
    if fail_at == 5:  # the failed segment's records were journaled before its write failed
        assert result.step > newest
    assert_state(truth, result, m2, o2)


def test_read_only_disk_at_start_is_raised_at_once(tmp_path: Path) -> None:
    storage = FaultyStorage(str(tmp_path / "run"), fail_at=1, code=errno.EROFS)
    m, o = make()
    with pytest.raises(StorageError, match=HINTS[errno.EROFS]):
        CheckpointEngine(storage).start(m, o, 0)


# =========================================================================================
# backpressure: a slow store makes training wait, and nothing is dropped
# =========================================================================================
def test_slow_storage_makes_training_wait_and_drops_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handoff_module, "_WARN_AFTER_S", 0.0)  # the waits here are short ones
    root = tmp_path / "run"
    storage = FaultyStorage(str(root), latency=0.05)
    with caplog.at_level(logging.WARNING, logger="diffckpt"):
        truth, durable = train(storage, write_batch=1, max_pending_bytes=1)
    waits = [r for r in caplog.records if r.name == "diffckpt" and "training waits" in r.getMessage()]
    assert waits, "no warning that training waited for storage"
    assert "max_pending_bytes" in waits[0].getMessage()  # and what to change
    assert durable == 13
    inv = RunStore(storage).inventory()
    assert [s.last for s in inv.segments] == list(range(1, 14))  # one segment per step: none dropped
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(14):
            result, m, o = restore(str(root), step)
            assert result.step == step
            assert_state(truth, result, m, o)


# =========================================================================================
# configurations that cannot be replayed are refused at start
# =========================================================================================
def test_lbfgs_is_refused_at_start(tmp_path: Path) -> None:
    m, _ = make()
    engine = CheckpointEngine(str(tmp_path / "run"))
    with pytest.raises(UnsupportedConfigurationError, match="LBFGS re-evaluates the loss .* closure"):
        engine.start(m, [torch.optim.LBFGS(m.parameters())], 0)
    assert not (tmp_path / "run").exists()  # nothing written
    assert not engine.started


def test_a_refused_optimizer_leaves_no_hook_on_the_accepted_ones(tmp_path: Path) -> None:
    m, _ = make()
    good = torch.optim.SGD(m.parameters(), lr=0.1)
    engine = CheckpointEngine(str(tmp_path / "run"))
    with pytest.raises(UnsupportedConfigurationError, match="LBFGS"):
        engine.start(m, [good, torch.optim.LBFGS(m.parameters())], 0)
    assert not (tmp_path / "run").exists()
    assert not good._optimizer_step_post_hooks  # no hook left behind on the accepted one either
