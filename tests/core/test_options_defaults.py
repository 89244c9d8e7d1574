"""The defaults that keep a run safe at real model sizes: bases sized by bytes, retention on,
compaction on the training device, and the storage projection logged at the first step. Pure
checks; the engine runs behind them are in test_base_by_bytes.py, test_retention.py and
test_compaction.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diffckpt import CheckpointOptions, RetentionPolicy
from diffckpt.lifecycle.compaction import training_device
from diffckpt.lifecycle.footprint import projection, retained_bytes
from diffckpt.options import (
    BY_BYTES,
    DEFAULT_BASE_EVERY_DIFF_BYTES_RATIO,
    DEFAULT_RETENTION,
    NOT_GIVEN_BASE_EVERY_N_STEPS,
    NOT_GIVEN_EVERY_N_STEPS,
    NOT_GIVEN_WRITE_BATCH,
    merge_options,
)
from diffckpt.policies import bytes_interval
from diffckpt.tuning.model import AutoTuner, Measurements, Settings
from diffckpt.tuning.online import AUTO_START_BASE_EVERY_N_STEPS, OnlineTuning

MiB = 1 << 20


def test_the_defaults() -> None:
    o = CheckpointOptions()
    assert o.base_every_n_steps == BY_BYTES == "bytes"
    assert o.base_every_diff_bytes_ratio == DEFAULT_BASE_EVERY_DIFF_BYTES_RATIO == 4.0
    # Retention keeps the newest base's chain and the one before it; None is the opt-out.
    assert o.retention == DEFAULT_RETENTION == RetentionPolicy(keep_last_bases=2)
    assert not o.retention.keeps_everything
    assert CheckpointOptions(retention=None).retention is None
    assert o.compact_device is None  # the parameters' device, decided when a session starts
    assert not o.auto
    # A session records them as plain JSON values.
    recorded = dataclasses.asdict(o)
    assert recorded["base_every_n_steps"] == "bytes" and recorded["retention"]["keep_last_bases"] == 2


def test_base_every_n_steps_keeps_integers_none_and_auto() -> None:
    for value in (1, 500, None, "auto", "bytes"):
        assert CheckpointOptions(base_every_n_steps=value).base_every_n_steps == value
    for bad in (0, -3, "steps", 2.5, True):
        with pytest.raises(ValueError, match="base_every_n_steps must be a positive integer, None, 'auto' or 'bytes'"):
            CheckpointOptions(base_every_n_steps=bad)
    for bad in (0, -1.0, float("inf"), float("nan"), True, "4"):
        with pytest.raises(ValueError, match="base_every_diff_bytes_ratio must be a positive number"):
            CheckpointOptions(base_every_diff_bytes_ratio=bad)
    assert CheckpointOptions(base_every_diff_bytes_ratio=0.5).base_every_diff_bytes_ratio == 0.5
    for bad in ("", 3):
        with pytest.raises(ValueError, match="compact_device must be a device name or None"):
            CheckpointOptions(compact_device=bad)


def test_adapter_keyword_left_out_takes_the_byte_default_or_the_options() -> None:
    knobs = {"every_n_steps": NOT_GIVEN_EVERY_N_STEPS, "write_batch": NOT_GIVEN_WRITE_BATCH}
    assert repr(NOT_GIVEN_BASE_EVERY_N_STEPS) == "'bytes'"  # what signatures and help() show
    merged = merge_options(None, {}, base_every_n_steps=NOT_GIVEN_BASE_EVERY_N_STEPS, **knobs)
    assert merged.base_every_n_steps == "bytes" and merged.retention == DEFAULT_RETENTION
    given = CheckpointOptions(base_every_n_steps=500, base_every_diff_bytes_ratio=2.0)
    assert merge_options(given, {}, base_every_n_steps=NOT_GIVEN_BASE_EVERY_N_STEPS, **knobs) == given
    # An explicit keyword wins, the byte sentinel included.
    assert merge_options(given, {}, base_every_n_steps="bytes", **knobs).base_every_n_steps == "bytes"
    assert merge_options(None, {}, base_every_n_steps=None, **knobs).base_every_n_steps is None


def test_bytes_interval() -> None:
    # GPT-2 small with AdamW: a base of about 1.5 GB (weights and two moments), 500 MB of gradients
    # per step: a base every 12 steps bounds a restore to about 4 bases' worth of diffs.
    base, step = 124e6 * 4 * 3, 124e6 * 4
    assert bytes_interval(4.0, base, step) == 12
    assert bytes_interval(4.0, base, step * 0.01) == 1200  # TopK(0.01)-sized payloads
    assert bytes_interval(0.1, base, step) == 1  # never below one step
    assert bytes_interval(4.0, base, 0) is None and bytes_interval(4.0, 0, step) is None


def test_online_tuning_sizes_after_each_base_and_agrees_across_ranks() -> None:
    """The sizing state machine alone: due once per base, at the first commit after a step was
    recorded since it; rank 0 sizes, another rank adopts and is no longer due."""

    class Writer:  # what OnlineTuning needs of a writer without a tuner
        def retarget(self, write_batch: int) -> None:
            pass

    options = CheckpointOptions()
    rank0, rank1 = OnlineTuning(options), OnlineTuning(options)
    rank0.start(0, Writer(), lambda: 3 * MiB)  # type: ignore[arg-type]
    rank1.join(0)
    for t in (rank0, rank1):
        t.based(0, MiB if t is rank0 else 0)  # the starting base: no optimizer state yet
        assert t.settings.base_every_n_steps is None and not t.review_due(1)
    rank0.stepped(1, MiB // 2)
    rank1.stepped(1)
    assert rank0.review_due(2) and rank1.review_due(2)  # every rank agrees without an exchange
    assert rank0.review(2) is None  # no tuner: nothing to decide, only the interval
    assert rank0.settings.base_every_n_steps == 24  # 4 x 3 MiB (a base now) / 0.5 MiB per step
    rank1.adopt(rank0.settings, rank0.next_review)
    assert rank1.settings == rank0.settings and not rank0.review_due(3) and not rank1.review_due(3)
    # A new base: sized again from the session's bytes per step and the newest base.
    for t in (rank0, rank1):
        t.stepped(24, 23 * MiB // 2 if t is rank0 else 0)
        t.based(24, 4 * MiB if t is rank0 else 0)
        assert not t.review_due(25)
        t.stepped(25, MiB // 2 if t is rank0 else 0)
        assert t.review_due(26)
    rank0.review(26)
    assert rank0.settings.base_every_n_steps == 32  # 4 x 4 MiB / 0.5 MiB
    # A new session starts unsized.
    rank0.join(30)
    assert rank0.settings.base_every_n_steps is None
    # One that continues step 30 resting on the base at 24 writes none at 30: it is sized from its
    # own first record, and the next base is counted from 24.
    rank0.join(30, 24)
    assert not rank0.sizing_due and rank0.settings.base_every_n_steps is None
    rank0.stepped(31, MiB // 2)
    assert rank0.sizing_due
    rank0.size_bases()
    assert rank0.settings.base_every_n_steps == 24 and not rank0.sizing_due  # 4 x 3 MiB now / 0.5 MiB


def test_fixed_and_auto_intervals_are_never_sized() -> None:
    for value, start in ((7, 7), (None, None), ("auto", AUTO_START_BASE_EVERY_N_STEPS)):
        t = OnlineTuning(CheckpointOptions(base_every_n_steps=value))
        t.join(0)
        t.stepped(1, MiB)
        assert t.base_ratio is None and not t.sizing_due and t.settings.base_every_n_steps == start


def test_the_tuner_holds_a_byte_sized_interval_fixed() -> None:
    tuning = OnlineTuning(CheckpointOptions(every_n_steps="auto", write_batch="auto"))
    assert tuning.tuner is not None and tuning.tuner.base_every_n_steps is None  # not sized yet
    tuner = AutoTuner(every_n_steps="auto", write_batch="auto", base_every_n_steps=None)
    tuner.candidates()
    tuner.fix_base_every(40)
    assert {s.base_every_n_steps for s in tuner.candidates()} == {40}
    assert Settings(8, 8, 40) in tuner.candidates()
    m = Measurements(step_s=0.1, record_s=1e-3, state_s=1e-3, diff_bytes=MiB, record_bytes=MiB,
                     encode_s_per_byte=1e-9, latency_s=0.01, bandwidth_bps=500 * MiB, base_bytes=3 * MiB,
                     base_capture_s=1e-3, base_encode_s=1e-3, replay_step_s=0.01, base_load_s=0.1,
                     memory_bytes=256 * MiB)
    assert tuner.decide(m).settings.base_every_n_steps == 40


def test_training_device_is_where_the_parameters_are() -> None:
    assert training_device(torch.nn.Linear(2, 2)) == "cpu"
    assert training_device(torch.nn.Linear(2, 2, device="meta")) == "meta"
    assert training_device(torch.nn.ReLU()) == "cpu"  # no parameters


def test_projection_line() -> None:
    line = projection(500e6, 1.5e9, 12, DEFAULT_RETENTION)
    assert line.startswith("projected storage: ")
    assert "per 1,000 steps" in line and "476.8 MiB recorded per step" in line and "every 12 steps" in line
    # 1000 records and 1000/12 bases; three chains (base + 12 records) at the peak.
    assert f"{(1000 * 500e6 + 1000 / 12 * 1.5e9) / 2**30:.1f} GiB per 1,000 steps" in line
    assert retained_bytes(DEFAULT_RETENTION, 500e6, 1.5e9, 12) == 3 * (1.5e9 + 12 * 500e6)
    assert "the 2 newest bases: about 21.0 GiB on disk at most" in line
    assert "in each of 4 rank streams" in projection(500e6, 1.5e9, 12, DEFAULT_RETENTION, streams=4)
    assert "no retention (retention=None): storage grows" in projection(1e6, 1e7, 40, None)
    assert "no retention: storage grows" in projection(1e6, 1e7, 40, RetentionPolicy())
    assert "newest chain never ends" in projection(1e6, 1e7, None, DEFAULT_RETENTION)
    assert "windows of steps or of time" in projection(1e6, 1e7, 40, RetentionPolicy(keep_last_bases=2,
                                                                                      keep_every_n_steps=100))
