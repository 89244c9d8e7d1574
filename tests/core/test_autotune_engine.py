"""The engine with settings on "auto": reviews, decisions on storage, segments that follow the
settings in force, the storage probe, and exact restores (no framework)."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest
from engine_runs import assert_state, make, restore, snapshot, train_steps

from diffckpt import CheckpointEngine, CheckpointOptions, TuningOptions
from diffckpt.runstore import RunStore
from diffckpt.tuning.model import Settings
from diffckpt.tuning.online import WARMUP_STEPS


def _review_when_due(engine: CheckpointEngine, step: int) -> None:
    if engine.recorder.review_due(step):
        engine.recorder.review(step)


def _train_auto(root: Path | Any, steps: int, drive: Any = _review_when_due, **options: Any
                ) -> tuple[CheckpointEngine, dict]:
    """Train as an adapter does: ``drive(engine, step)`` (by default a review when one is due),
    then record (with state at restorable steps) and base when the settings in force say so."""
    module, optimizers = make()
    engine = CheckpointEngine(str(root) if isinstance(root, Path) else root, CheckpointOptions(**{
        "every_n_steps": "auto", "write_batch": "auto", "base_every_n_steps": "auto",
        "tuning": TuningOptions(mtbf_s=60, retune_every_n_steps=10, max_overhead=0.5), **options}))
    engine.start(module, optimizers, 0)
    truth = {0: snapshot(module, optimizers, 0)}
    engine.write_base(0, module.state_dict(), [o.state_dict() for o in optimizers], {"x": 0})
    # The tuner decides once a write and a base are timed. Steps of this model take a millisecond:
    # on a loaded machine a whole run could end before the writer thread wrote the starting base
    # and the probe, and no review would find enough measured.
    engine.flush()
    train_steps(engine, module, optimizers, 1, steps, truth, every=None, before_record=drive)
    engine.close()
    return engine, truth


def test_first_review_after_warmup_is_recorded_with_its_measurements(tmp_path):
    engine, truth = _train_auto(tmp_path / "run", 60)
    store = RunStore(engine.storage)
    log = store.tuning_log(1)
    # The first review with a write timed (the session-start probe runs on the writer thread);
    # without one it looks again a warm-up later.
    assert log and log[0]["step"] % WARMUP_STEPS == 0 and log[0]["reason"] == "first choice"
    m = log[0]["measurements"]
    assert m["step_s"] > 0 and m["record_bytes"] > 0 and m["bandwidth_bps"] > 0 and m["base_bytes"] > 0
    assert engine.settings.as_dict() == log[-1]["settings"]
    # The probe cleaned up after itself.
    assert not list((tmp_path / "run").glob("_probe/*"))
    # The newest durable step (and every restorable one) replays to the truth.
    result, module, optimizers = restore(tmp_path / "run")
    assert_state(truth, result, module, optimizers)


def test_segments_follow_the_settings_in_force_from_the_next_restorable_step(tmp_path):
    """After a change, the next restorable step cuts a segment, so durable steps are at most one
    new interval apart at once (not nearly two, from records left pending)."""
    changes = {12: Settings(5, 5, 100), 31: Settings(7, 7, 100)}

    def drive(engine: CheckpointEngine, step: int) -> None:
        if step in changes:
            engine.recorder.adopt(changes[step], next_review=10**9)

    engine, truth = _train_auto(tmp_path / "run", 50, drive=drive, tuning=TuningOptions(retune_every_n_steps=10**6))
    inv = RunStore(engine.storage).inventory()
    ends = sorted(s.last for s in inv.segments)
    # Before step 12 the starting settings (1, 8) cut at 8; the record of step 12 has no state
    # under every 5, so the first cut after the change is at 15, then every 5 until 31 changes
    # it: the next multiple of 7 (35) cuts, then every 7 (42, 49); close() writes the rest.
    assert [e for e in ends if e <= 49] == [8, 15, 20, 25, 30, 35, 42, 49], ends
    for step in (15, 30, 35, 49):
        result, module, optimizers = restore(tmp_path / "run", step)
        assert_state(truth, result, module, optimizers)


def test_fixed_knobs_stay_as_given(tmp_path):
    engine, _ = _train_auto(tmp_path / "run", 40, every_n_steps=4, base_every_n_steps=20)
    assert engine.settings.every_n_steps == 4 and engine.settings.base_every_n_steps == 20
    log = RunStore(engine.storage).tuning_log(1)
    assert log and all(d["settings"]["every_n_steps"] == 4 for d in log)


@pytest.mark.parametrize("knob", ["every_n_steps", "write_batch", "base_every_n_steps"])
def test_auto_is_accepted_per_knob_and_other_strings_are_refused(knob):
    assert CheckpointOptions(**{knob: "auto"}).auto
    with pytest.raises(ValueError, match="'auto'"):
        CheckpointOptions(**{knob: "fast"})
    with pytest.raises(ValueError, match="positive integer"):
        CheckpointOptions(fingerprint_every_n_steps="auto")  # not a tuned knob


class _NoProbes:
    """A storage that refuses the tuner's probe objects, as a bucket policy might (a fault
    injected through a storage wrapper): the probe fails, checkpointing must not."""

    def __init__(self, root: str) -> None:
        from diffckpt import FsspecStorage

        self.inner = FsspecStorage(root)
        self.url = self.inner.url
        self.refused = 0

    def write(self, path: str, data: Any) -> None:
        if path.startswith("_probe/"):
            self.refused += 1
            raise PermissionError(13, "writes under _probe/ are not allowed here")
        self.inner.write(path, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_refused_probe_only_warns_and_the_tuner_measures_the_checkpoint_writes(tmp_path, caplog):
    storage = _NoProbes(str(tmp_path / "run"))
    engine, truth = _train_auto(storage, 40)
    assert storage.refused == 1
    assert "could not probe" in caplog.text
    log = RunStore(engine.storage).tuning_log(1)
    assert log and log[0]["measurements"]["bandwidth_bps"] > 0
    result, module, optimizers = restore(tmp_path / "run")
    assert_state(truth, result, module, optimizers)


def test_ls_shows_the_decisions_and_survives_a_damaged_tuning_log(tmp_path, capsys):
    from diffckpt.cli import main

    _train_auto(tmp_path / "run", 30)
    assert main(["ls", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"g1 auto-tuned: step \d+: every_n_steps=\d+", out) and "tuning.mtbf_s=60" in out
    # What each decision risks per failure, with the node-local tier (on by default) since the
    # newest restorable step journaled on the node.
    assert re.search(r"\(risks [\d.]+ steps \([\d.e-]+s\) per failure, at most \d+ \([\d.e-]+s\), since the newest "
                     r"restorable step journaled on this node\)", out), out
    assert main(["ls", str(tmp_path / "run"), "--json"]) == 0
    risk = json.loads(capsys.readouterr().out)["sessions"][0]["tuning"][0]["loss_per_failure"]
    assert risk["since"] == "restorable" and 0 < risk["steps"] <= risk["worst_steps"]
    (tmp_path / "run" / "sessions" / "g000001.tuning.json").write_text("{not json")
    assert main(["ls", str(tmp_path / "run")]) == 0
    assert "g1 auto-tuned:" not in capsys.readouterr().out


def test_a_new_spacing_starts_from_a_restorable_point(tmp_path):
    """Through ``begin``/``commit`` (what adapters call): the step where a review changes
    ``every_n_steps`` is restorable, so no crash loses more than the new spacing (with the old
    spacing's last point kept, a change to every 7 at step 10 would leave steps 9..14 bare)."""
    import torch
    from engine_runs import LoopState, optimizer_step

    from diffckpt.tuning.model import Decision, expected_loss

    module, optimizers = make()
    sched = torch.optim.lr_scheduler.StepLR(optimizers[0], 10)
    engine = CheckpointEngine(str(tmp_path / "run"), CheckpointOptions(
        every_n_steps="auto", write_batch="auto", base_every_n_steps="auto", local_dir=str(tmp_path / "local"),
        tuning=TuningOptions(retune_every_n_steps=10)))
    tuner = engine.recorder.tuning.tuner
    assert tuner is not None
    chosen = Settings(7, 14, 500)

    def decide(m, current=None):  # the tuner's choice, whatever this machine measured
        estimate = expected_loss(chosen, m, tuner.options)
        return Decision(chosen, estimate, None, current != chosen, "chosen by the test")

    tuner.decide = decide  # type: ignore[method-assign]
    engine.begin(module, optimizers, 0, LoopState(sched))
    restorable = [0]
    for step in range(1, 41):
        optimizer_step(module, optimizers, step)
        sched.step()
        if engine.commit(step, LoopState(sched)).restorable:
            restorable.append(step)
    engine.end()
    changed = RunStore(engine.storage).tuning_log(1)[0]["step"]
    assert changed % 7 and changed in restorable, (changed, restorable)
    after = [s for s in restorable if s >= changed]
    assert all(b - a <= 7 for a, b in itertools.pairwise(after)), restorable
