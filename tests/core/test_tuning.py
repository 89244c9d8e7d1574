"""Unit tests of the auto-tuner's policy (``diffckpt.tuning.model``) and its measurements
(``diffckpt.tuning.meter``, ``diffckpt.tuning.probe``): option checks, the candidate grid under
fixed knobs, hysteresis, how each constraint moves the choice, the write-cost fit, and when the
meter is ready.

``test_tuner_sim.py`` checks the choices against a simulator; these check the pieces.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from diffckpt.tuning.meter import SKIPPED_STEPS, Meter
from diffckpt.tuning.model import (
    HYSTERESIS,
    WRITER_HEADROOM,
    AutoTuner,
    Estimate,
    Measurements,
    Settings,
    TuningOptions,
    expected_loss,
)
from diffckpt.tuning.probe import fit_write_cost

MB = 1e6


def meas(**kw: Any) -> Measurements:
    """A mid-sized job on network storage; keywords override."""
    values: dict[str, Any] = {
        "step_s": 0.2, "record_s": 1e-3, "state_s": 2e-3, "diff_bytes": 5 * MB, "record_bytes": 10 * MB,
        "encode_s_per_byte": 1e-9, "latency_s": 0.01, "bandwidth_bps": 500 * MB, "base_bytes": 500 * MB,
        "base_capture_s": 0.05, "base_encode_s": 0.25, "replay_step_s": 0.02, "base_load_s": 1.5,
        "memory_bytes": 1e9, "steps": 0}
    values.update(kw)
    return Measurements(**values)


def choose(m: Measurements, **options: Any) -> Estimate:
    return AutoTuner(TuningOptions(**options)).decide(m).estimate


def unconstrained_best(m: Measurements, **options: Any) -> Estimate:
    """The candidate with the least expected loss, constraints ignored."""
    o = TuningOptions(**options)
    return min((expected_loss(s, m, o) for s in AutoTuner(o).candidates()), key=lambda e: e.loss)


# --------------------------------------------------------------------------- options
@pytest.mark.parametrize("kw, field", [
    ({"mtbf_s": 0}, "mtbf_s"), ({"mtbf_s": -5.0}, "mtbf_s"), ({"mtbf_s": "1d"}, "mtbf_s"),
    ({"max_overhead": 0}, "max_overhead"), ({"max_overhead": 1.0}, "max_overhead"),
    ({"max_overhead": -0.1}, "max_overhead"), ({"max_overhead": "3%"}, "max_overhead"),
    ({"rto_s": 0}, "rto_s"), ({"rto_s": -1.0}, "rto_s"), ({"rto_s": "1m"}, "rto_s"),
    ({"retune_every_n_steps": 0}, "retune_every_n_steps"), ({"retune_every_n_steps": 2.5}, "retune_every_n_steps"),
])
def test_options_reject_bad_values(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TuningOptions(**kw)


def test_options_accept_good_values() -> None:
    o = TuningOptions(mtbf_s=1800, max_overhead=0.5, rto_s=60, retune_every_n_steps=1)
    assert (o.mtbf_s, o.max_overhead, o.rto_s, o.retune_every_n_steps) == (1800, 0.5, 60, 1)


# ------------------------------------------------------------------------ candidates
def test_segment_steps_rounds_write_batch_up_to_restorable_points() -> None:
    assert Settings(3, 8, None).segment_steps == 9
    assert Settings(4, 4, 100).segment_steps == 4
    assert Settings(5, 1, 100).segment_steps == 5


def test_candidates_all_auto_put_restorable_points_where_segments_end() -> None:
    cands = AutoTuner().candidates()
    assert len({c.every_n_steps for c in cands}) > 10
    for c in cands:
        assert c.every_n_steps == c.write_batch
        assert c.base_every_n_steps is not None and c.base_every_n_steps % c.segment_steps == 0


@pytest.mark.parametrize("fixed", [
    {"every_n_steps": 4}, {"write_batch": 16}, {"base_every_n_steps": 1000}, {"base_every_n_steps": None},
    {"every_n_steps": 3, "write_batch": 8}, {"every_n_steps": 2, "base_every_n_steps": 300},
    {"every_n_steps": 5, "write_batch": 10, "base_every_n_steps": 700},
])
def test_candidates_respect_fixed_knobs(fixed: dict[str, Any]) -> None:
    tuner = AutoTuner(TuningOptions(), **fixed)
    cands = tuner.candidates()
    assert cands
    for c in cands:
        for name, value in fixed.items():
            assert getattr(c, name) == value
    if "every_n_steps" in fixed and "write_batch" not in fixed:  # segments end at restorable points
        assert all(c.write_batch % c.every_n_steps == 0 for c in cands)
    if len(fixed) == 3:
        assert cands == [Settings(5, 10, 700)]
    choice = tuner.decide(meas()).settings
    assert all(getattr(choice, name) == value for name, value in fixed.items())


# ------------------------------------------------------------------------ hysteresis
def _feasible_estimates(m: Measurements, o: TuningOptions) -> list[Estimate]:
    return [e for e in (expected_loss(s, m, o) for s in AutoTuner(o).candidates()) if e.feasible]


def test_hysteresis_keeps_slightly_worse_settings() -> None:
    m, o = meas(), TuningOptions()
    best = AutoTuner(o).decide(m)
    near = [e for e in _feasible_estimates(m, o) if best.estimate.loss * 1.02 < e.loss < best.estimate.loss * 1.08
            and expected_loss(e.settings, m, o, slack=1 + HYSTERESIS).feasible]
    assert near, "the grid should hold settings within a few percent of the best"
    d = AutoTuner(o).decide(m, near[0].settings)
    assert (d.settings, d.changed) == (near[0].settings, False)


def test_hysteresis_switches_for_a_much_better_choice() -> None:
    m, o = meas(), TuningOptions()
    best = AutoTuner(o).decide(m)
    far = [e for e in _feasible_estimates(m, o) if e.loss > best.estimate.loss * (1 + 3 * HYSTERESIS)]
    assert far
    d = AutoTuner(o).decide(m, far[0].settings)
    assert d.changed and d.settings == best.settings


def test_a_broken_constraint_switches_even_within_the_margin() -> None:
    """Settings whose writer cannot keep up lose less on paper (one-step segments lose little
    work) but must be left, whatever the margin."""
    m, o = meas(latency_s=0.3, state_s=1e-4), TuningOptions(mtbf_s=600)
    current = Settings(1, 1, 120)
    now = expected_loss(current, m, o)
    assert now.writer_utilization > WRITER_HEADROOM * (1 + HYSTERESIS)
    d = AutoTuner(o).decide(m, current)
    assert now.loss < d.estimate.loss * (1 + HYSTERESIS)  # within the margin, by loss alone
    assert d.changed and d.estimate.feasible and "writer busy" in d.reason


def test_the_best_settings_stay() -> None:
    m, o = meas(), TuningOptions()
    best = AutoTuner(o).decide(m).settings
    d = AutoTuner(o).decide(m, best)
    assert (d.settings, d.changed) == (best, False)


# ----------------------------------------------------------------------- constraints
def test_writer_headroom_lengthens_segments() -> None:
    """Frequent failures favour one-step segments; on high-latency storage the writer could not
    keep up with them, so segments grow until it can."""
    kw = {"state_s": 1e-4}
    fast, slow = meas(latency_s=1e-3, **kw), meas(latency_s=0.3, **kw)
    free = unconstrained_best(slow, mtbf_s=600)
    assert free.writer_utilization > WRITER_HEADROOM  # the constraint binds
    e_fast, e_slow = choose(fast, mtbf_s=600), choose(slow, mtbf_s=600)
    assert e_slow.feasible and e_slow.writer_utilization <= WRITER_HEADROOM
    assert e_slow.settings.segment_steps > max(e_fast.settings.segment_steps, free.settings.segment_steps)


def test_memory_caps_segments() -> None:
    """Dense records: a segment's records may take at most half of max_pending_bytes."""
    kw = {"record_bytes": 200 * MB, "diff_bytes": 190 * MB, "latency_s": 0.05, "bandwidth_bps": 2e9,
          "encode_s_per_byte": 0.0, "state_s": 4e-3}
    roomy, tight = meas(memory_bytes=16e9, **kw), meas(memory_bytes=1.2e9, **kw)
    assert unconstrained_best(tight).settings.segment_steps * tight.record_bytes > tight.memory_bytes / 2
    e_roomy, e_tight = choose(roomy), choose(tight)
    assert e_tight.feasible
    assert e_tight.settings.segment_steps * tight.record_bytes <= tight.memory_bytes / 2
    assert e_tight.settings.segment_steps < e_roomy.settings.segment_steps


def test_base_memory_stall_makes_bases_rarer() -> None:
    """A base that does not fit beside the records makes training wait for its write: the model
    charges that stall, so bases get rarer than when memory has room for them."""
    kw = {"base_bytes": 400 * MB, "bandwidth_bps": 100 * MB, "base_capture_s": 0.04}
    roomy, tight = meas(memory_bytes=4e9, **kw), meas(memory_bytes=256 * 2**20, **kw)
    s = Settings(10, 10, 500)
    o = TuningOptions()
    assert expected_loss(s, tight, o).overhead > expected_loss(s, roomy, o).overhead + 0.01
    assert choose(tight).settings.base_every_n_steps > 2 * choose(roomy).settings.base_every_n_steps


def test_overhead_budget_binds() -> None:
    """Costly restorable points and frequent failures favour short segments; a tight budget
    forces longer ones, at a higher expected loss."""
    m = meas(state_s=0.02, latency_s=1e-3, record_s=1e-4)
    loose, tight = choose(m, mtbf_s=600, max_overhead=0.5), choose(m, mtbf_s=600, max_overhead=0.005)
    assert tight.feasible and tight.overhead <= 0.005 < loose.overhead
    assert tight.settings.every_n_steps > loose.settings.every_n_steps
    assert tight.loss > loose.loss


def test_rto_bounds_the_base_interval() -> None:
    m = meas()
    free = choose(m)
    rto = free.worst_recovery_s / 4
    bound = choose(m, rto_s=rto)
    assert free.worst_recovery_s > rto >= bound.worst_recovery_s
    assert bound.settings.base_every_n_steps < free.settings.base_every_n_steps
    assert bound.feasible


def test_shorter_mtbf_checkpoints_more_often() -> None:
    m = meas()
    day, hour = choose(m, mtbf_s=86400), choose(m, mtbf_s=1800)
    assert hour.settings.segment_steps < day.settings.segment_steps
    assert hour.settings.base_every_n_steps < day.settings.base_every_n_steps


def test_infeasible_everywhere_picks_the_mildest() -> None:
    """Storage too slow for any setting: the choice still comes, with its violations said."""
    m = meas(bandwidth_bps=10 * MB, diff_bytes=5 * MB)  # 0.5 s of transfer per 0.2 s step
    e = choose(m)
    assert not e.feasible and any("writer busy" in v for v in e.violations)


# -------------------------------------------------------------------- write-cost fit
def test_fit_recovers_an_exact_line() -> None:
    lat, bw = 0.035, 180 * MB
    samples = [(n, lat + n / bw) for n in (1_000, 300_000, 4_000_000, 25_000_000, 1_000)]
    got_lat, got_bw = fit_write_cost(samples)
    assert math.isclose(got_lat, lat, rel_tol=1e-9) and math.isclose(got_bw, bw, rel_tol=1e-9)


def test_fit_same_sizes_uses_the_prior_bandwidth() -> None:
    lat, bw = 0.02, 250 * MB
    samples = [(4_000_000, lat + 4_000_000 / bw)] * 6
    got_lat, got_bw = fit_write_cost(samples, prior_bandwidth=bw)
    assert got_bw == bw and math.isclose(got_lat, lat, rel_tol=1e-9)
    # Sizes too close to separate latency from bandwidth count as the same size.
    close = [(4_000_000, 0.05), (4_001_000, 0.05)]
    assert fit_write_cost(close, prior_bandwidth=bw)[1] == bw


def test_fit_ignores_a_negative_slope() -> None:
    """Bigger writes that happened to be faster (noise) say nothing about bandwidth."""
    lat, bw = fit_write_cost([(1_000, 0.5), (10_000_000, 0.1)], prior_bandwidth=50 * MB)
    assert bw == 50 * MB and lat >= 0


def test_fit_needs_samples() -> None:
    with pytest.raises(ValueError):
        fit_write_cost([])


# ---------------------------------------------------------------------------- meter
def test_meter_snapshot_none_until_ready() -> None:
    meter = Meter(256 << 20)
    assert meter.snapshot() is None
    for _ in range(SKIPPED_STEPS + 3):
        meter.add_step(0.1, 1e-3, 1_000_000)
    assert meter.snapshot() is None  # no write yet
    meter.add_write(1 << 20, 0.011)
    assert meter.snapshot() is None  # no base yet
    meter.add_base(50_000_000, 0.2)
    assert meter.snapshot(7) is not None


def test_meter_snapshot_values() -> None:
    """Writes fitted as latency + bytes / bandwidth; replay and base load derived from them
    until a restore is measured."""
    lat, bw = 0.01, 200 * MB
    meter = Meter(1 << 30)
    for n in (1 << 10, 1 << 20, 8_000_000, 50_000_000):
        meter.add_write(n, lat + n / bw)
    for _ in range(5):
        meter.add_step(0.3, 2e-3, 10_000_000)
        meter.add_state(1e-3)
        meter.add_update(4e-3)
    meter.add_segment(10_000_000, 4_000_000, 0.02)
    meter.add_base(50_000_000, 0.1)
    meter.add_base_capture(0.05, 50_000_000)
    m = meter.snapshot(42)
    assert m is not None
    assert m.steps == 42 and m.memory_bytes == 1 << 30
    assert math.isclose(m.latency_s, lat, rel_tol=1e-9) and math.isclose(m.bandwidth_bps, bw, rel_tol=1e-9)
    assert math.isclose(m.diff_bytes, 4_000_000) and math.isclose(m.encode_s_per_byte, 2e-9)
    assert math.isclose(m.replay_step_s, 4e-3 + 4_000_000 / bw + 2e-9 * 10_000_000)
    assert math.isclose(m.base_load_s, lat + 50_000_000 / bw + 0.1)
    meter.add_restore(3.0, 0.05)
    m2 = meter.snapshot()
    assert m2 is not None and (m2.base_load_s, m2.replay_step_s) == (3.0, 0.05)


def test_meter_same_size_writes_use_the_probe_bandwidth() -> None:
    """Segments all of one size cannot separate latency from bandwidth; the probe's fit does."""
    lat, bw = 0.05, 80 * MB
    meter = Meter(1 << 30)
    probe = [(n, lat + n / bw) for n in (1 << 10, 1 << 20)] * 2
    for n, t in probe:
        meter.add_write(n, t)
    meter.add_probe(probe)
    for _ in range(40):  # pushes the probe's writes out of the window
        meter.add_write(3_000_000, lat + 3_000_000 / bw)
    for _ in range(SKIPPED_STEPS + 3):
        meter.add_step(0.1, 0.0, 3_000_000)
    meter.add_base(10_000_000, 0.0)
    m = meter.snapshot()
    assert m is not None
    assert math.isclose(m.bandwidth_bps, bw, rel_tol=1e-6) and math.isclose(m.latency_s, lat, rel_tol=1e-6)


def test_measurements_round_trip() -> None:
    m = meas(steps=5)
    assert Measurements(**{k: (int(v) if k == "steps" else v) for k, v in m.as_dict().items()}) == m
    assert dataclasses.replace(m, latency_s=1.0).latency_s == 1.0


def test_meter_leaves_out_a_sessions_first_step_timings() -> None:
    """The first steps warm up caches and allocators; they would inflate the step time."""
    meter = Meter(1 << 30)
    for _ in range(SKIPPED_STEPS):
        meter.add_step(3.0, 1e-3, 1_000_000)
    for _ in range(5):
        meter.add_step(0.1, 1e-3, 1_000_000)
    meter.add_write(1 << 20, 0.01)
    meter.add_base(10_000_000, 0.0)
    m = meter.snapshot()
    assert m is not None and math.isclose(m.step_s, 0.1)


# ------------------------------------------------------------------ node-local tier
def test_with_the_local_tier_a_failure_loses_the_restorable_spacing_not_the_durable_lag() -> None:
    """The journal keeps every record on the node: a crash resumes from the newest restorable
    step journaled, half of every_n_steps back on average, whatever the segments and their lag."""
    o, s = TuningOptions(), Settings(4, 40, 400)
    journaled = expected_loss(s, meas(local_tier=True), o)
    durable = expected_loss(s, meas(), o)
    step = 0.2 * (1 + journaled.overhead)
    assert math.isclose(journaled.lost_work_s, 4 * step / 2 + 1e-9 * 10 * MB, rel_tol=1e-6)
    assert 2 <= journaled.lost_steps < 2.1 and 4 <= journaled.worst_lost_steps < 4.1
    assert durable.lost_steps > 20 and durable.worst_lost_steps > 40
    # The journaled records are committed as one segment before replay: recovery pays that.
    assert journaled.recovery_s > expected_loss(s, meas(), o).recovery_s - 0.02 * 18


def test_candidates_with_the_local_tier_put_restorable_points_inside_segments() -> None:
    tuner = AutoTuner()
    plain, tiered = set(tuner.candidates()), set(tuner.candidates(local_tier=True))
    assert all(s.every_n_steps == s.write_batch for s in plain)
    assert plain <= tiered and Settings(1, 8, 8) in tiered and Settings(5, 50, 500) in tiered
    assert all(s.write_batch % s.every_n_steps == 0 for s in tiered)


def test_with_the_local_tier_slow_storage_batches_writes_not_restorable_points() -> None:
    """A request costs 4 s: the writer keeps up only with long segments. Without the tier
    that spaced restorable points as far apart (a crash lost the segment); with it they stay as
    close as their own cost warrants, and what a failure risks shrinks with them."""
    m = meas(latency_s=4.0, state_s=2e-4)
    o = {"mtbf_s": 3600.0}
    durable, journaled = choose(m, **o), choose(dataclasses.replace(m, local_tier=True), **o)
    assert durable.settings.every_n_steps == durable.settings.segment_steps >= 25
    assert journaled.settings.segment_steps >= 25 and journaled.feasible
    assert journaled.settings.every_n_steps * 4 <= journaled.settings.segment_steps
    assert journaled.worst_lost_steps < durable.worst_lost_steps / 4


def test_a_free_restorable_point_with_the_local_tier_comes_every_step() -> None:
    """When a restorable point costs nothing, nothing justifies losing more than a step: the
    tuner loses as little as every_n_steps=1 does, writing segments as storage wants."""
    e = choose(meas(state_s=0.0, local_tier=True))
    assert e.settings.every_n_steps == 1 and e.worst_lost_steps < 1.1


def test_a_costlier_restorable_point_is_spaced_further_apart() -> None:
    """Young's trade: 16 times the cost of a restorable point, about 4 times the spacing."""
    m = meas(local_tier=True, latency_s=1e-3)
    cheap, dear = choose(dataclasses.replace(m, state_s=1e-4)), choose(dataclasses.replace(m, state_s=1.6e-3))
    ratio = dear.settings.every_n_steps / cheap.settings.every_n_steps
    assert 2.5 <= ratio <= 6, (cheap.settings, dear.settings)
    assert dear.lost_steps > cheap.lost_steps


def test_a_restorable_points_bytes_load_the_writer() -> None:
    """Framework state is written with its record: every step, it may be more than the diff."""
    o, m = TuningOptions(), meas(local_tier=True)
    light = expected_loss(Settings(1, 8, 400), m, o)
    heavy = expected_loss(Settings(1, 8, 400), dataclasses.replace(m, state_bytes=20 * MB), o)
    sparse = expected_loss(Settings(8, 8, 400), dataclasses.replace(m, state_bytes=20 * MB), o)
    assert heavy.writer_utilization > light.writer_utilization + 0.15
    assert light.writer_utilization < sparse.writer_utilization < heavy.writer_utilization


def test_with_the_local_tier_a_base_write_stalls_training() -> None:
    """Training waits while the record before is not journaled, and the writer journals nothing
    while it writes a base: a slow base write stalls training instead of queueing records."""
    m = meas(base_bytes=500 * MB, bandwidth_bps=25 * MB, memory_bytes=4e9)  # a 20 s base write, 0.2 s steps
    o, s = TuningOptions(), Settings(10, 10, 1000)
    queued, stalled = expected_loss(s, m, o), expected_loss(s, dataclasses.replace(m, local_tier=True), o)
    assert stalled.overhead > queued.overhead + 15 / 1000 / 0.2


def test_risk_states_what_the_choice_loses() -> None:
    from diffckpt.tuning.risk import risk, say_risk

    m = meas(local_tier=True)
    e = choose(m)
    r = risk(e, m)
    assert r["since"] == "restorable" and 0 < r["steps"] <= r["worst_steps"]
    assert r["worst_steps"] >= e.settings.every_n_steps and r["seconds"] <= r["worst_seconds"]
    assert f"at most {r['worst_steps']} " in say_risk(r) and "journaled on this node" in say_risk(r)
    assert risk(choose(meas()), meas())["since"] == "durable"


def test_meter_measures_a_restorable_points_bytes_and_passes_the_tier_on() -> None:
    meter = Meter(1 << 30, local_tier=True)
    for _ in range(SKIPPED_STEPS + 3):
        meter.add_step(0.1, 1e-3, 1_000_000)
    meter.add_write(1 << 20, 0.01)
    meter.add_base(10_000_000, 0.0)
    for _ in range(3):  # every step restorable so far: against the step's own bytes
        meter.add_encoded(1_030_000, True)
    m = meter.snapshot()
    assert m is not None and m.local_tier and math.isclose(m.state_bytes, 30_000)
    for _ in range(20):
        meter.add_encoded(1_010_000, False)
    m = meter.snapshot()
    assert m is not None and math.isclose(m.state_bytes, 20_000, rel_tol=1e-3)
    assert Measurements.slowest([m, dataclasses.replace(m, local_tier=False)]).local_tier is False
