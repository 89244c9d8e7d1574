"""The auto-tuner against a simulator (``tuning_sim``), not against its own formulas.

For each scenario the simulator finds the best settings on a grid by simulating each one (only
those that meet the constraints as simulated count); the tuner then chooses from what a
:class:`~diffckpt.tuning.meter.Meter` measured in a short simulated warm-up, as the engine lets it,
and its choice must lose, in simulation, at most 10% more than the grid's best. Online, with the
tuner reviewing every ``retune_every_n_steps``, it must follow storage that slows down within a
bounded number of steps, and not change settings back and forth under constant conditions.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Mapping
from typing import Any

import pytest
from tuning_sim import (
    Scenario,
    SimResult,
    fmt,
    grid_optimum,
    grid_settings,
    make_scenario,
    simulate,
    storage_change,
)

from diffckpt.tuning.meter import Meter
from diffckpt.tuning.model import AUTO, GRID, AutoTuner, Settings, TuningOptions

MB, GB = 1e6, 1e9
HOUR, DAY, WEEK = 3600.0, 86400.0, 7 * 86400.0
BOUND = 1.10  # the tuner's choice may lose at most 10% more than the grid's best
MAX_K = 200  # steps per segment on the grid: far past any optimum here (they are all below 60)
MAX_BASE = 50_000  # steps between bases on the grid (the search stops earlier where the loss grows)
WARMUP_STEPS = 150  # the warm-up run the tuner's first choice is measured from
ADAPT_STEPS = 200  # an online tuner is near the new optimum this many steps after storage slows
ENGINE_DEFAULTS = Settings(1, 8, 500)  # what the engine runs with until the first review


def _jitter(n: int, spread: float, seed: int) -> tuple[float, ...]:
    rng = random.Random(seed)
    return tuple(1 + spread * (2 * rng.random() - 1) for _ in range(n))


SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    # Local NVMe: writes are nearly free, the records are big and zstd is the writer's bottleneck.
    make_scenario("local-ssd", step_s=0.2, record_bytes=40 * MB, diff_ratio=0.9, latency_s=0.5e-3,
                  bandwidth_bps=2 * GB, base_bytes=120 * MB, encode_s_per_byte=2.5e-9, mtbf_s=DAY),
    # An object store with the default 256 MiB buffer: a base does not fit beside the records,
    # so training waits for every base write.
    make_scenario("object-store", step_s=0.3, record_bytes=4 * MB, diff_ratio=0.5, latency_s=0.12,
                  bandwidth_bps=100 * MB, base_bytes=400 * MB, mtbf_s=6 * HOUR),
    # The same kind of storage with room for bases in memory: base intervals trade copies
    # against replay.
    make_scenario("object-store-roomy", step_s=0.25, record_bytes=2 * MB, diff_ratio=0.6, latency_s=0.08,
                  bandwidth_bps=100 * MB, base_bytes=300 * MB, base_capture_s=0.4, update_s=0.01,
                  memory_bytes=2 * GB, mtbf_s=4 * HOUR),
    # Compressed training: records are ~1% of the dense gradients, bases are large.
    make_scenario("tiny-diffs", step_s=0.5, record_bytes=8 * MB, latency_s=0.02, bandwidth_bps=500 * MB,
                  base_bytes=2.4 * GB, mtbf_s=12 * HOUR),
    # Dense 400 MB records on fast storage: the 2 GB buffer binds segments to a few steps.
    make_scenario("huge-dense", step_s=1.0, record_bytes=400 * MB, diff_ratio=0.95, latency_s=1e-3,
                  bandwidth_bps=2 * GB, base_bytes=1.2 * GB, encode_s_per_byte=2e-10, memory_bytes=2 * GB,
                  mtbf_s=DAY),
    # Spot instances: a failure every 30 minutes.
    make_scenario("mtbf-30min", step_s=0.15, record_bytes=10 * MB, diff_ratio=0.6, latency_s=0.03,
                  bandwidth_bps=300 * MB, base_bytes=300 * MB, memory_bytes=1 * GB, mtbf_s=0.5 * HOUR),
    # A reliable machine: a failure a week.
    make_scenario("mtbf-1week", step_s=0.15, record_bytes=10 * MB, diff_ratio=0.6, latency_s=0.03,
                  bandwidth_bps=300 * MB, base_bytes=300 * MB, memory_bytes=1 * GB, mtbf_s=WEEK),
    # Step times alternating short and long (e.g. gradient accumulation boundaries).
    make_scenario("alternating-steps", step_s=0.2, record_bytes=10 * MB, diff_ratio=0.6, latency_s=0.08,
                  bandwidth_bps=150 * MB, base_bytes=300 * MB, mtbf_s=2 * HOUR, step_pattern=(0.5, 1.5)),
    # An evaluation every 100 steps that takes 20 steps' time.
    make_scenario("eval-spikes", step_s=0.1, record_bytes=5 * MB, diff_ratio=0.6, latency_s=0.02,
                  bandwidth_bps=500 * MB, base_bytes=150 * MB, mtbf_s=4 * HOUR,
                  step_pattern=(1.0,) * 99 + (20.0,)),
    # Step times jittering +-40% (data loading, variable sequence lengths).
    make_scenario("jittery-steps", step_s=0.12, record_bytes=6 * MB, diff_ratio=0.7, latency_s=0.04,
                  bandwidth_bps=200 * MB, base_bytes=200 * MB, memory_bytes=1 * GB, mtbf_s=3 * HOUR,
                  step_pattern=_jitter(97, 0.4, seed=3)),
]}


# ------------------------------------------------------------------------------ helpers
def options_for(scn: Scenario, **kw: Any) -> TuningOptions:
    return TuningOptions(mtbf_s=scn.mtbf_s, **kw)


def knobs(fixed: Mapping[str, Any]) -> dict[str, Any]:
    """The tuner's three knobs: ``"auto"`` unless fixed."""
    return {k: fixed.get(k, AUTO) for k in ("every_n_steps", "write_batch", "base_every_n_steps")}


def engine_start(fixed: Mapping[str, Any]) -> Settings:
    """The settings the engine starts with: fixed knobs as given, the others at their defaults."""
    values = ENGINE_DEFAULTS.as_dict() | dict(fixed)
    return Settings(**values)


@functools.cache
def grid_best(scn: Scenario, opts: TuningOptions, fixed: tuple[tuple[str, Any], ...] = ()
              ) -> tuple[Settings, SimResult, int]:
    """The simulated optimum over the tuner's candidate families (cached: it is the slow part)."""
    f = dict(fixed)
    cands = grid_settings(every_n_steps=f.get("every_n_steps"), write_batch=f.get("write_batch"),
                          base_every_n_steps=f.get("base_every_n_steps", "auto"), grid=GRID, max_k=MAX_K,
                          max_base=MAX_BASE)
    return grid_optimum(scn, cands, max_overhead=opts.max_overhead, rto_s=opts.rto_s)


def warmed_meter(scn: Scenario, start: Settings, steps: int = WARMUP_STEPS) -> Meter:
    """A meter fed by a short simulated run, as the engine's would be at its first review."""
    meter = Meter(int(scn.memory_bytes))
    simulate(scn, start, meter=meter, steps=steps)
    return meter


def tuner_choice(scn: Scenario, opts: TuningOptions, fixed: Mapping[str, Any] | None = None) -> Settings:
    fixed = fixed or {}
    m = warmed_meter(scn, engine_start(fixed)).snapshot(WARMUP_STEPS)
    assert m is not None, "the meter should be ready after the warm-up"
    return AutoTuner(opts, **knobs(fixed)).decide(m).settings


class TunerController:
    """Drives :meth:`AutoTuner.decide` as the engine does: the first review picks freely, later
    ones start from the settings in force."""

    def __init__(self, tuner: AutoTuner) -> None:
        self.tuner = tuner
        self.reviews = 0

    def __call__(self, meter: Meter, step: int, current: Settings) -> Settings:
        m = meter.snapshot(step)
        if m is None:
            return current
        first = self.reviews == 0
        self.reviews += 1
        return self.tuner.decide(m, None if first else current).settings


def compare(scn: Scenario, opts: TuningOptions, fixed: Mapping[str, Any] | None = None
            ) -> tuple[Settings, SimResult, Settings, SimResult]:
    """The grid's best and the tuner's choice, both simulated; asserts the 10% bound."""
    fixed = fixed or {}
    best, rbest, sims = grid_best(scn, opts, tuple(sorted(fixed.items())))
    chosen = tuner_choice(scn, opts, fixed)
    r = simulate(scn, chosen)
    detail = (f"{scn.name}: grid best {best.as_dict()} {fmt(rbest)} ({sims} runs); "
              f"tuner {chosen.as_dict()} {fmt(r)}; ratio {r.loss / rbest.loss:.3f}")
    assert r.loss <= BOUND * rbest.loss, detail
    assert r.meets(opts.max_overhead, opts.rto_s), f"the tuner's choice breaks a constraint in simulation: {detail}"
    for name, value in fixed.items():
        assert getattr(chosen, name) == value, detail
    return best, rbest, chosen, r


# -------------------------------------------------------------------------------- tests
def test_simulator_timeline_by_hand() -> None:
    """The simulator against a timeline worked out by hand: 1 s steps (+10 ms record copy), a
    segment per step taking 0.2 s to write, a 100 MB base every 100 steps taking 10.2 s, and a
    2.5 MB buffer. At a base step the writer writes the step's segment (0.2 s), then the base;
    the next record gets in (the queue is empty), the one after waits for the base: a stall of
    0.2 + 10.20003 - 2 * 1.01 s (8.18003 s for the session's base, which has no segment before it).
    The base at the last step stalls nothing."""
    scn = Scenario(name="by-hand", step_s=1.0, record_s=0.01, state_s=0.0, diff_bytes=1e6, record_bytes=1e6,
                   encode_s_per_byte=0.0, latency_s=0.1, bandwidth_bps=1e7, base_bytes=100e6, base_capture_s=0.0,
                   base_encode_s=0.0, replay_step_s=0.5, base_load_s=3.0, memory_bytes=2.5e6, mtbf_s=3600.0,
                   steps=1000)
    w_base = 2 * 0.1 + 100e6 / 1e7 + 300 / 1e7
    stall = 0.2 + w_base - 2 * 1.01
    r = simulate(scn, Settings(1, 1, 100))
    cycle = 100 * 1.01 + stall  # wall time from a base step to the next
    assert (r.segments, r.steps) == (1000, 900)  # measured: steps 100..1000
    assert r.stall_s == pytest.approx(w_base - 2 * 1.01 + 9 * stall)
    assert r.overhead == pytest.approx(cycle / 100 - 1)
    assert r.writer_busy == pytest.approx((100 * 0.2 + w_base) / cycle)
    assert r.max_recovery_s == pytest.approx(3.0 + 0.5 * 100)
    roomy = simulate(dataclasses.replace(scn, memory_bytes=1e9), Settings(1, 1, 100))
    assert roomy.stall_s == 0 and roomy.overhead == pytest.approx(0.01)
    # Lost work with room in memory: step j of a cycle (finished at j * 1.01 s after the base
    # step) is durable 0.2 s after its segment starts, which is when it finished or, behind the
    # base write, when the writer gets to it; a failure between two durable steps loses the time
    # since the older one finished.
    done, free = [0.2], 0.2 + w_base
    for j in range(1, 100):
        free = max(free, j * 1.01) + 0.2
        done.append(free)
    done.append(100 * 1.01 + 0.2)
    lost = sum(((done[j + 1] - j * 1.01) ** 2 - (done[j] - j * 1.01) ** 2) / 2 for j in range(100))
    assert roomy.lost_s == pytest.approx(lost / (100 * 1.01))
    assert roomy.lost_s > 0.2 + 1.01 / 2 + 0.4  # the base's delay counts


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_choice_within_10pct_of_grid_optimum(name: str) -> None:
    """From warm-up measurements alone, the tuner's settings lose at most 10% more than the
    best settings on the grid, in simulation."""
    scn = SCENARIOS[name]
    compare(scn, options_for(scn))


@pytest.mark.parametrize("fixed", [{"write_batch": 16}, {"every_n_steps": 4}, {"base_every_n_steps": 400},
                                   {"every_n_steps": 2, "base_every_n_steps": 1000}],
                         ids=["write_batch", "every_n_steps", "base_every_n_steps", "two-fixed"])
def test_fixed_knobs(fixed: dict[str, Any]) -> None:
    """Fixed knobs stay as given and the free ones are still near the best the grid finds with
    the same knobs fixed."""
    scn = SCENARIOS["mtbf-30min"]
    compare(scn, options_for(scn), fixed)


def test_rto_binds() -> None:
    """A recovery-time objective tighter than the unconstrained choice's worst recovery: the
    choice meets it in simulation, and is still within 10% of the best that meets it."""
    scn = SCENARIOS["local-ssd"]
    free = simulate(scn, tuner_choice(scn, options_for(scn)))
    rto = free.max_recovery_s / 3
    _, rbest, _chosen, r = compare(scn, options_for(scn, rto_s=rto))
    assert r.max_recovery_s <= rto < free.max_recovery_s
    assert rbest.max_recovery_s <= rto


def _slowed(kind: str) -> Scenario:
    """Storage that slows from step 1000 on: latency x50 (a throttled store: segments must grow
    for the writer to keep up) or bandwidth /20 (a base write no longer fits beside the records in
    memory: bases must become rarer)."""
    if kind == "latency":
        scn = make_scenario("slows-latency", step_s=1.0, record_bytes=40 * MB, latency_s=0.04, bandwidth_bps=200 * MB,
                            base_bytes=400 * MB, encode_s_per_byte=5e-9, memory_bytes=2 * GB, mtbf_s=0.5 * HOUR,
                            steps=3000)
        change = storage_change(scn, latency_s=scn.latency_s * 50)
    else:
        scn = make_scenario("slows-bandwidth", step_s=0.2, record_bytes=4 * MB, diff_ratio=0.5, latency_s=0.01,
                            bandwidth_bps=1 * GB, base_bytes=1 * GB, memory_bytes=1.2 * GB, mtbf_s=2 * HOUR,
                            steps=3000)
        change = storage_change(scn, bandwidth_bps=scn.bandwidth_bps / 20)
    return dataclasses.replace(scn, changes=((1000, change),))


@pytest.mark.parametrize("kind", ["latency", "bandwidth"])
def test_follows_storage_that_slows(kind: str) -> None:
    """Online, the settings in force are within 10% of the new grid optimum from at most
    ADAPT_STEPS steps after storage slows (and stay there), while the settings before the change
    would not be."""
    scn = _slowed(kind)
    at = scn.changes[0][0]
    after = scn.after_changes()
    opts = options_for(scn)
    best_new, rbest_new, _ = grid_best(after, opts)
    run = simulate(scn, TunerController(AutoTuner(opts)), initial=ENGINE_DEFAULTS,
                   retune_every_n_steps=opts.retune_every_n_steps)
    before = run.settings_at(at - 1)
    stale = simulate(after, before)
    assert stale.loss > BOUND * rbest_new.loss or not stale.meets(opts.max_overhead, opts.rto_s), \
        f"the change should matter: {before.as_dict()} {fmt(stale)} vs best {best_new.as_dict()} {fmt(rbest_new)}"
    spans = [(at, run.settings_at(at))] + [(step, st) for step, st in run.history if step > at]
    adapted: int | None = None  # start of the last run of good settings
    for step, settings in spans:
        r = simulate(after, settings)
        good = r.loss <= BOUND * rbest_new.loss and r.meets(opts.max_overhead, opts.rto_s)
        adapted = (step if adapted is None else adapted) if good else None
    history = [(s, st.as_dict()) for s, st in run.history]
    assert adapted is not None, f"never near the new optimum {best_new.as_dict()} {fmt(rbest_new)}: {history}"
    assert adapted - at <= ADAPT_STEPS, f"took {adapted - at} steps: {history}"


@pytest.mark.parametrize("name", ["local-ssd", "object-store-roomy", "huge-dense"])
def test_no_flapping_under_constant_conditions(name: str) -> None:
    """Noise-free measurements of constant conditions: the first review may change the engine's
    defaults and one more review may refine it, nothing more."""
    scn = SCENARIOS[name]
    controller = TunerController(AutoTuner(options_for(scn)))
    run = simulate(scn, controller, initial=ENGINE_DEFAULTS, steps=3000)
    assert controller.reviews >= 50
    assert run.changes <= 2, [(s, st.as_dict()) for s, st in run.history]


@pytest.mark.parametrize("name", ["jittery-steps", "eval-spikes"])
def test_no_flapping_with_noisy_step_times(name: str) -> None:
    """Step times vary, so the measured step time moves at every review (without hysteresis the
    tuner changes settings dozens of times in these runs): the settings hardly move."""
    scn = SCENARIOS[name]
    controller = TunerController(AutoTuner(options_for(scn)))
    run = simulate(scn, controller, initial=ENGINE_DEFAULTS, steps=3000)
    assert controller.reviews >= 50
    assert run.changes <= 3, [(s, st.as_dict()) for s, st in run.history]
