"""Retention and garbage collection on real runs on disk: chain-aware keeping, leftovers,
deletion order (an interruption after every single deletion leaves a restorable run), and the
background retention and compaction of a training process."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_runs import assert_state, base_dir, optimizer_step, restore, seg, train

from diffckpt import CheckpointNotFoundError, RetentionPolicy, collect_garbage
from diffckpt.lifecycle.retention import apply_gc, plan_gc
from diffckpt.runstore import RunStore
from diffckpt.storage import FsspecStorage, open_storage

STEPS = 40  # bases at 0, 10, 20, 30, 40; segments of 2 steps


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, dict[int, Any]]:
    root = tmp_path / "run"
    truth, durable = train(root, steps=STEPS, base_every_n_steps=10, write_batch=2)
    assert durable == STEPS
    return root, truth


def _restorable(root: Path, truth: dict[int, Any], steps: list[int]) -> None:
    for step in steps:
        result, module, optimizers = restore(root, step)
        assert result.step == step
        assert_state(truth, result, module, optimizers)


def _gone(root: Path, steps: list[int]) -> None:
    for step in steps:
        with pytest.raises(CheckpointNotFoundError):
            restore(root, step)


def _inv(root: Path) -> Any:
    return RunStore(open_storage(root)).inventory()


def test_policy_validation() -> None:
    for bad in ({"keep_last_bases": 0}, {"keep_every_n_steps": -1}, {"keep_last_bases": True},
                {"keep_newer_than_s": -1.0}, {"min_age_s": "1h"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RetentionPolicy(**bad)


def test_keep_last_bases_keeps_the_window_and_frees_the_rest(run: tuple[Path, dict[int, Any]]) -> None:
    root, truth = run
    before = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    plan = collect_garbage(root, RetentionPolicy(keep_last_bases=2), dry_run=True)
    assert not plan.applied and [b.step for b in plan.bases] == [0, 10, 20]
    assert [(s.after, s.last) for s in plan.segments] == [(a, a + 2) for a in range(0, 30, 2)]
    assert len(list(root.rglob("*.seg"))) == 20  # a dry run deletes nothing
    plan = collect_garbage(root, RetentionPolicy(keep_last_bases=2), dry_run=False)
    assert plan.applied and plan.objects == 15 + 3 * 2
    after = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    assert before - after == plan.bytes > 0
    assert [b.step for b in _inv(root).bases] == [30, 40]
    _restorable(root, truth, [30, 32, 36, 38, 40])  # every step of the window, bitwise
    _gone(root, [0, 10, 28])
    # Nothing more to do: a second collection deletes nothing.
    assert collect_garbage(root, RetentionPolicy(keep_last_bases=2), dry_run=False).objects == 0


def test_keep_every_n_steps_keeps_one_point_per_window(run: tuple[Path, dict[int, Any]]) -> None:
    root, truth = run
    plan = collect_garbage(root, RetentionPolicy(keep_every_n_steps=15), dry_run=False)
    kept = {k.step: k.reasons for k in plan.kept}
    # [0,15): base 0; [15,30): base 20; [30,45): base 30; plus the newest durable step.
    assert sorted(kept) == [0, 20, 30, 40]
    assert [b.step for b in _inv(root).bases] == [0, 20, 30, 40]
    _restorable(root, truth, [0, 20, 30, 40])
    _gone(root, [10, 12, 24])


def test_keep_every_n_steps_without_a_base_in_the_window_keeps_its_chain(tmp_path: Path) -> None:
    root = tmp_path / "run"
    truth, _ = train(root, steps=30, base_every_n_steps=None, write_batch=4)  # one base, at 0
    collect_garbage(root, RetentionPolicy(keep_every_n_steps=10), dry_run=False)
    # Windows [10,20) and [20,30) have no base: their first segment ends (12, 20) need base 0 and
    # the diffs up to them; the newest step (30) needs them all.
    _restorable(root, truth, [0, 12, 20, 30])


def test_keep_newer_than_keeps_young_objects_and_what_they_need(run: tuple[Path, dict[int, Any]]) -> None:
    root, truth = run
    old = time.time() - 3 * 86400
    young = {seg(root, 24, 26), seg(root, 26, 28)}
    for f in root.rglob("*"):
        if f.is_file() and f not in young and f.parent.name != "sessions":
            os.utime(f, (old, old))
    plan = collect_garbage(root, RetentionPolicy(keep_newer_than_s=86400), dry_run=False)
    assert {k.step for k in plan.kept} == {26, 28, 40}
    # Steps 26 and 28 need base 20 and the segments from it; the newest step needs base 40.
    assert [b.step for b in _inv(root).bases] == [20, 40]
    _restorable(root, truth, [20, 22, 26, 28, 40])
    _gone(root, [0, 10, 30, 32])


def test_no_keep_policy_keeps_every_step_and_removes_only_old_leftovers(run: tuple[Path, dict[int, Any]]) -> None:
    root, truth = run
    old = time.time() - 7200
    stale_tmp = root / "diffs" / ".000000000040-000000000042.g000001.seg.1a2b3c4d.tmp"
    stale_base = base_dir(root, 42) / "state.safetensors"  # a base write that never committed
    fresh_tmp = root / "diffs" / ".000000000042-000000000044.g000001.seg.5e6f7a8b.tmp"
    probe = root / "_probe" / "tune-1" / "obj-0"
    for f in (stale_tmp, stale_base, fresh_tmp, probe):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"x" * 100)
    for f in (stale_tmp, stale_base, probe):
        os.utime(f, (old, old))
    plan = collect_garbage(root, RetentionPolicy(), dry_run=False)
    assert sorted(x.path for x in plan.leftovers) == [
        "_probe/tune-1/obj-0", "bases/000000000042.g000001/state.safetensors",
        "diffs/.000000000040-000000000042.g000001.seg.1a2b3c4d.tmp"]
    assert not plan.segments and not plan.bases
    assert fresh_tmp.exists() and not stale_tmp.exists() and not stale_base.exists() and not probe.exists()
    _restorable(root, truth, [0, 2, 17 + 1, 33 + 1, 40])


def test_segments_beyond_a_gap_are_kept_not_deleted(run: tuple[Path, dict[int, Any]]) -> None:
    root, truth = run
    seg(root, 34, 36).unlink()  # a chain cut: steps after 34 cannot be rebuilt from base 30
    (base_dir(root, 40) / "COMMIT").unlink()
    plan = collect_garbage(root, RetentionPolicy(keep_last_bases=1), dry_run=False)
    assert sorted(plan.kept_beyond_gaps) == [seg(root, 36, 38).relative_to(root).as_posix(),
                                            seg(root, 38, 40).relative_to(root).as_posix()]
    assert seg(root, 36, 38).exists() and seg(root, 38, 40).exists()
    _restorable(root, truth, [30, 34])


class _Interrupted(Exception):
    pass


class _StopsAfter:
    """Storage over the real disk whose ``delete`` fails after ``n`` deletions (what a process
    killed at that point leaves)."""

    def __init__(self, root: Path, n: int) -> None:
        self.inner = FsspecStorage(str(root))
        self.url = self.inner.url
        self.n = n

    def delete(self, path: str) -> None:
        if self.n == 0:
            raise _Interrupted(path)
        self.n -= 1
        self.inner.delete(path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_interrupted_after_every_single_deletion_the_run_stays_restorable(
        tmp_path: Path, run: tuple[Path, dict[int, Any]]) -> None:
    import shutil

    root, truth = run
    # min_age_s=0: the files of a base whose COMMIT went before the interruption are as old as
    # the base in a real run, but were written a moment ago here.
    policy = RetentionPolicy(keep_last_bases=2, min_age_s=0)
    total = plan_gc(RunStore(open_storage(root)), policy).objects
    for n in range(total):
        copy = tmp_path / f"trial{n}"
        shutil.copytree(root, copy)
        store = RunStore(_StopsAfter(copy, n))  # type: ignore[arg-type]
        with pytest.raises(_Interrupted):
            apply_gc(store, plan_gc(store, policy))
        # Restorable right after the interruption: the newest step and the kept window.
        _restorable(copy, truth, [40, 30, 35 + 1])
        newest, module, optimizers = restore(copy)
        assert newest.step == 40
        assert_state(truth, newest, module, optimizers)
        # The next collection finishes the job and ends where an uninterrupted one does.
        collect_garbage(copy, policy, dry_run=False)
        assert _files(copy) == _files(_finished(tmp_path, root, policy))


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def _finished(tmp_path: Path, root: Path, policy: RetentionPolicy) -> Path:
    import shutil

    done = tmp_path / "uninterrupted"
    if not done.exists():
        shutil.copytree(root, done)
        collect_garbage(done, policy, dry_run=False)
    return done


def test_training_with_background_compaction_and_retention(tmp_path: Path) -> None:
    from engine_runs import OPTIONS, make, snapshot, train_steps

    from diffckpt import CheckpointEngine, CheckpointOptions

    root = tmp_path / "run"
    module, optimizers = make()
    options = CheckpointOptions(**{**OPTIONS, "base_every_n_steps": None, "write_batch": 4,
                                   "compact_every_n_steps": 12,
                                   "retention": RetentionPolicy(keep_last_bases=2)})
    engine = CheckpointEngine(root, options)
    engine.start(module, optimizers, 0)
    truth = {0: snapshot(module, optimizers, 0)}
    engine.write_base(0, module.state_dict(), [o.state_dict() for o in optimizers], {"x": 0})
    # Steps of ~20 ms, so that the background thread keeps up as it would beside real training.
    train_steps(engine, module, optimizers, 1, 60, truth, before_record=lambda e, s: time.sleep(0.02))
    assert engine.close() == 60
    store = RunStore(open_storage(root))
    inv = store.inventory()
    compacted = [b for b in inv.bases if store.load_base(b)[0].get("compacted")]
    assert compacted and all(store.load_base(b)[0]["compacted"]["by"] == "background compaction"
                             for b in compacted)
    assert len(inv.bases) <= 3  # the last 2 (and one that landed after the last collection)
    if len(compacted) >= 2:
        assert inv.bases[0].step > 0  # the starting base went: compacted ones replaced it
    # Training itself wrote no base after the starting one.
    assert all(b in compacted for b in inv.bases if b.step > 0)
    newest, module, optimizers = restore(root)
    assert newest.step == 60
    assert_state(truth, newest, module, optimizers)
    _restorable(root, truth, [b.step for b in inv.bases])


def test_cli_gc_without_policy_keeps_every_step_and_min_age_zero_removes_fresh_leftovers(
        run: tuple[Path, dict[int, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    from diffckpt.cli import main

    root, truth = run
    tmp = root / "diffs" / ".000000000040-000000000042.g000001.seg.0a1b2c3d.tmp"
    tmp.write_bytes(b"partial")
    assert main(["gc", str(root), "--apply"]) == 0
    assert tmp.exists()  # younger than the default min age of 1 hour: a writer may be at it
    assert "none given or recorded: every step is kept" in capsys.readouterr().out
    assert main(["gc", str(root), "--apply", "--min-age", "0"]) == 0
    out = capsys.readouterr().out
    assert not tmp.exists() and "deleted 1 object," in out and "temporary file of an interrupted write" in out
    _restorable(root, truth, [0, 1, 13 + 1, 40])


def test_maintenance_close_runs_a_last_pass_unless_interrupted(run: tuple[Path, dict[int, Any]]) -> None:
    from diffckpt.lifecycle.maintenance import Maintenance

    root, truth = run
    policy = RetentionPolicy(keep_last_bases=2)
    # What the writer reports: step 40 durable, 5 bases committed (none seen by retention yet).
    interrupted = Maintenance(open_storage(root), lambda: (40, 40, 5), compact_every_n_steps=None,
                              retention=policy)
    interrupted.close(5.0, final=False)  # SIGTERM: exit soon, delete nothing more
    assert not interrupted.collections and len(_inv(root).bases) == 5
    normal = Maintenance(open_storage(root), lambda: (40, 40, 5), compact_every_n_steps=None,
                         retention=policy)
    normal.close(30.0)  # the end of training: one last retention pass
    assert [c["bases"] for c in normal.collections] == [3]
    assert [b.step for b in _inv(root).bases] == [30, 40]
    _restorable(root, truth, [30, 40])


def test_the_last_pass_waits_for_every_rank_to_have_its_last_base(run: tuple[Path, dict[int, Any]]) -> None:
    """A sharded job's last retention pass (rank 0's) waits for the other ranks' streams to commit
    the last base, so that every stream is trimmed alike; past close's timeout it collects anyway."""
    import threading

    from diffckpt.lifecycle.maintenance import Maintenance

    root, truth = run
    policy = RetentionPolicy(keep_last_bases=2)
    ready, seen = threading.Event(), []

    def settled() -> bool:  # the other ranks catch up 0.3 s after close()
        seen.append(len(_inv(root).bases))
        return ready.is_set()

    waiting = Maintenance(open_storage(root), lambda: (40, 40, 5), compact_every_n_steps=None,
                          retention=policy, settled=settled)
    threading.Timer(0.3, ready.set).start()
    waiting.close(5.0)
    assert ready.is_set() and len(seen) > 1 and set(seen) == {5}  # it polled, deleting nothing meanwhile
    assert [c["bases"] for c in waiting.collections] == [3]  # then collected
    assert [b.step for b in _inv(root).bases] == [30, 40]
    never = Maintenance(open_storage(root), lambda: (40, 40, 5), compact_every_n_steps=None,
                        retention=policy, settled=lambda: False)
    start = time.monotonic()
    never.close(0.5)
    assert 0.4 < time.monotonic() - start < 5 and never.collections == []  # nothing left to delete
    _restorable(root, truth, [30, 40])


def test_the_default_retention_keeps_the_two_newest_chains(tmp_path: Path) -> None:
    """Every default (bases sized by bytes, retention on): old chains go once newer bases are
    durable, the newest step and everything from the older kept base on stay restorable; a
    resumed session's chains then take the place of the old session's. ``retention=None`` is
    the opt-out that keeps every step (the other tests here)."""
    from engine_runs import make, snapshot, train_steps

    from diffckpt import CheckpointEngine, CheckpointOptions

    def session(first: int, last: int, truth: dict[int, Any]) -> CheckpointEngine:
        module, optimizers = make()
        engine = CheckpointEngine(root)
        assert engine.options == CheckpointOptions()
        if first:
            engine.restore(module, optimizers, first)
        engine.start(module, optimizers, first)
        truth[first] = snapshot(module, optimizers, first)
        engine.write_base(first, module.state_dict(), [o.state_dict() for o in optimizers], {"x": first})
        train_steps(engine, module, optimizers, first + 1, last, truth)
        assert engine.close() == last  # a normal end: the last retention pass ran
        return engine

    root, truth = tmp_path / "run", {}
    engine = session(0, 80, truth)
    every = engine.settings.base_every_n_steps
    assert every is not None and 80 // every >= 4  # several chains were written
    bases = [b.step for b in _inv(root).bases]
    assert len(bases) == 2 and bases[0] > 0 and bases[1] - bases[0] == every, bases
    _restorable(root, truth, [bases[0], bases[0] + 1, bases[1], 80])
    _gone(root, [1, bases[0] - 1])
    # The session recorded its policy: `gc` without one applies it and finds nothing more to do.
    assert collect_garbage(root).objects == 0
    # A resumed session: once two of its bases are durable, the first session's chains go.
    session(80, 160, truth)
    inv = _inv(root)
    assert [b.gen for b in inv.bases] == [2, 2] and {s.gen for s in inv.segments} == {2}
    _restorable(root, truth, [inv.bases[0].step, 160])
    _gone(root, [80 - 1])


def test_steps_framework_saves_name_outlive_the_default_retention(tmp_path: Path) -> None:
    """A framework's save of a step (a ModelCheckpoint reference, Accelerate's ``save_state``)
    names it: retention keeps it restorable for as long as the session runs, however many newer
    bases come."""
    from engine_runs import LoopState, make

    from diffckpt import CheckpointEngine
    from diffckpt.lifecycle.retention import recorded_policy

    root = tmp_path / "run"
    module, optimizers = make()
    sched = torch.optim.lr_scheduler.StepLR(optimizers[0], 10)
    engine = CheckpointEngine(root)  # the default retention
    engine.begin(module, optimizers, 0, LoopState(sched))
    saved, truth = [], {}
    for step in range(1, 81):
        optimizer_step(module, optimizers, step)
        sched.step()
        engine.commit(step, LoopState(sched))
        if step in (6, 7):
            truth[step] = {k: v.clone() for k, v in module.state_dict().items()}
        if step == 6:
            engine.when_restorable(6, lambda: saved.append(6), name="epoch=0-step=6.ckpt")
        if step == 7:
            engine.keep(7, "save_state(out/step7)")
    plan = plan_gc(RunStore(open_storage(root)), recorded_policy(RunStore(open_storage(root))) or RetentionPolicy(),
                   also=[(1, 6, "saved as epoch=0-step=6.ckpt")])
    engine.end()
    assert saved == [6]
    assert any("saved as epoch=0-step=6.ckpt" in k.reasons for k in plan.kept)
    every = engine.settings.base_every_n_steps
    bases = [b.step for b in _inv(root).bases]
    # The base that 6 and 7 restore from stays, besides the two newest.
    assert every is not None and bases[0] <= 6 and len(bases) == 3 and bases[1] > 8, bases
    for step in (6, 7):
        result, restored, _ = restore(root, step)
        assert result.step == step and all(torch.equal(v, restored.state_dict()[k]) for k, v in truth[step].items())
    _gone(root, [bases[1] - 1])  # past the saved steps, an old chain went


def _session(root: Path, first: int, last: int, truth: dict[int, Any], saves: dict[int, str],
             keeps: dict[int, str] | None = None, **options: Any) -> Any:
    """One training session (a plain loop through CheckpointEngine) from ``first`` (resumed when
    above 0) to ``last``; at each step of ``saves`` a framework save names it, at each step of
    ``keeps`` :meth:`CheckpointEngine.keep` keeps it (as Accelerate's ``save_state`` does)."""
    from engine_runs import LoopState, make

    from diffckpt import CheckpointEngine, CheckpointOptions

    module, optimizers = make()
    sched = torch.optim.lr_scheduler.StepLR(optimizers[0], 10)
    engine = CheckpointEngine(root, CheckpointOptions(base_every_n_steps=5, write_batch=2, **options))
    if first:
        assert engine.resume(module, optimizers, first).step == first
    engine.begin(module, optimizers, first, LoopState(sched))
    for step in range(first + 1, last + 1):
        optimizer_step(module, optimizers, step)
        sched.step()
        engine.commit(step, LoopState(sched))
        truth[step] = {k: v.clone() for k, v in module.state_dict().items()}
        if step in saves:
            engine.when_restorable(step, lambda: None, name=saves[step])
        if step in (keeps or {}):
            engine.keep(step, (keeps or {})[step])
    engine.end()
    return engine


def test_steps_framework_saves_name_stay_kept_in_later_sessions_and_gc(tmp_path: Path) -> None:
    """A save's step is recorded in the run root (``kept/``): a resumed session's retention and
    ``diffckpt gc`` in a fresh process keep it however many bases come after, until the
    framework removes the save; then its step goes at the next collection."""
    import subprocess
    import sys

    from helpers import subprocess_env

    root, truth = tmp_path / "run", {}
    tight = {"retention": RetentionPolicy(keep_last_bases=1)}
    _session(root, 0, 20, truth, {6: "epoch=0-step=6.ckpt"}, **tight)
    assert len(list((root / "kept").glob("*.json"))) == 1
    # A new process's session: 8 more bases.
    engine = _session(root, 20, 60, truth, {}, {42: "save_state(out/step42)"}, **tight)
    assert [b.step for b in _inv(root).bases] == [5, 40, 60]  # bases 5 and 40 stay, for steps 6 and 42
    for step in (6, 42):
        result, module, _ = restore(root, step)
        assert result.step == step
        assert all(torch.equal(v, module.state_dict()[k]) for k, v in truth[step].items())
    # `diffckpt gc` in a fresh process, with a policy that keeps only the newest base, keeps both.
    proc = subprocess.run([sys.executable, "-m", "diffckpt", "gc", str(root), "--keep-last-bases", "1",
                           "--apply", "--json"], capture_output=True, text=True, env=subprocess_env(),
                          timeout=120, check=True)
    import json

    kept = {k["step"]: k["reasons"] for k in json.loads(proc.stdout)["kept"]}
    assert kept[6] == ["saved as epoch=0-step=6.ckpt"] and kept[42] == ["save_state(out/step42)"], kept
    assert restore(root, 6)[0].step == 6
    # The framework removes its saves: their steps are kept no more.
    removed: list[str] = []
    engine.when_removed(lambda: removed.append("file"), name="epoch=0-step=6.ckpt")
    engine.release("save_state(out/step42)")
    assert removed == ["file"] and not list((root / "kept").glob("*.json"))
    plan = collect_garbage(root, dry_run=False)  # the policy the newest session recorded
    assert [b.step for b in _inv(root).bases] == [60] and plan.objects > 0
    _gone(root, [6, 42])


def test_a_damaged_kept_marker_keeps_every_step(run: tuple[Path, dict[int, Any]], caplog: Any) -> None:
    """A marker that cannot be read names a step nobody can tell: nothing is deleted for it."""
    from diffckpt.keptsteps import kept_path

    root, truth = run
    marker = root / kept_path("saved as best.ckpt")
    marker.parent.mkdir()
    marker.write_bytes(b'{"format": 3, "gen": 1, "step": ')  # torn
    plan = collect_garbage(root, RetentionPolicy(keep_last_bases=1), dry_run=False)
    assert plan.objects == 0 and "kept marker is damaged" in caplog.text
    why = f"every step is kept: {marker.relative_to(root)}: kept marker is damaged (not a JSON object) (repair or delete it)"
    assert plan.kept and all(why in k.reasons for k in plan.kept), plan.kept
    _restorable(root, truth, [2, 13])
    from diffckpt.cli import main

    assert main(["verify", str(root)]) != 0  # verify names it, as damage
    marker.write_bytes(b'{"format": 99, "gen": 1, "step": 2, "why": "x"}')  # a newer diffckpt's
    assert collect_garbage(root, RetentionPolicy(keep_last_bases=1)).objects == 0
    marker.unlink()  # deleted by hand: the policy applies again
    assert collect_garbage(root, RetentionPolicy(keep_last_bases=1)).objects > 0
