"""A deterministic discrete-event simulator of training, the background writer, storage and
failures, to check the auto-tuner's choices against timelines rather than against its own
formulas (it never calls :func:`diffckpt.tuning.model.expected_loss`).

It mirrors ``diffckpt/writer.py`` and ``diffckpt/policies.py``: every optimizer step puts a
record into a FIFO queue bounded in bytes (``memory_bytes``; a base's bytes count too, until it
is written); while the queue is non-empty and a put would exceed the budget, training waits. The
writer moves records to ``pending`` and writes a segment (pending records up to the newest
restorable one) once ``write_batch`` are pending and the record just taken is restorable; a base
first writes such a segment, then the base (state object and COMMIT marker). A step is
restorable when ``step % every_n_steps == 0`` or it is a base step. A session starts with a base
at step 0.

The expected loss of a run is measured as ``overhead + E[lost + recovery] / mtbf`` for a
failure time uniform over the measured stretch, integrated exactly over the piecewise-constant
timeline of what is durable: lost(t) = t - (when training finished the newest step durable at
t), recovery(t) = base_load_s + replay_step_s * (that step - the newest base durable at t). For
fixed settings the stretch is whole base cycles in steady state (see :func:`simulate`): over a
short run, a base at the last step or the session's fresh starting base would otherwise count
as much as the settings themselves.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from diffckpt.tuning.meter import Meter
from diffckpt.tuning.model import Settings

__all__ = ["COMMIT_BYTES", "Controller", "Scenario", "SimResult", "fmt", "grid_optimum", "grid_settings",
           "make_scenario", "simulate", "storage_change"]

COMMIT_BYTES = 300  # a base's COMMIT marker (JSON)
WARMUP_STEPS = 10  # steps before the first call of a controller
COST_FIELDS = ("step_s", "record_s", "state_s", "diff_bytes", "record_bytes", "encode_s_per_byte", "latency_s",
               "bandwidth_bps", "base_bytes", "base_capture_s", "base_encode_s", "replay_step_s", "base_load_s",
               "memory_bytes")

# A controller gets the meter the simulator feeds, the step just finished and the settings in
# force, and returns the settings for the next step on.
Controller = Callable[[Meter, int, Settings], Settings]


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """True costs of a run (the fields of :class:`~diffckpt.tuning.model.Measurements`), its failure
    rate, its length, and changes of costs from a given step on."""

    name: str = ""
    step_s: float
    record_s: float
    state_s: float
    diff_bytes: float
    record_bytes: float
    encode_s_per_byte: float
    latency_s: float
    bandwidth_bps: float
    base_bytes: float
    base_capture_s: float
    base_encode_s: float
    replay_step_s: float
    base_load_s: float
    memory_bytes: float
    mtbf_s: float
    steps: int = 1500  # the steady state is measured over whole base cycles, see simulate()
    # (at_step, {field: new value}): in force from that step (for the writer: from the time
    # training reaches it).
    changes: tuple[tuple[int, Mapping[str, float]], ...] = ()
    # Multipliers of step_s cycled over steps (varying step times); () for constant steps.
    step_pattern: tuple[float, ...] = ()
    update_s: float = 0.0  # optimizer update time, what replay repeats (fed to the meter)

    def costs(self) -> dict[str, float]:
        return {k: float(getattr(self, k)) for k in COST_FIELDS}

    def after_changes(self) -> Scenario:
        """The scenario with every change applied from the start (the conditions a change leads to)."""
        values: dict[str, Any] = {}
        for _, change in sorted(self.changes, key=lambda c: c[0]):
            values.update(change)
        return dataclasses.replace(self, changes=(), **values)

    def mean_step_s(self) -> float:
        pattern = self.step_pattern or (1.0,)
        return self.step_s * sum(pattern) / len(pattern)


def make_scenario(name: str, *, step_s: float, record_bytes: float, diff_ratio: float = 1.0,
                  latency_s: float, bandwidth_bps: float, base_bytes: float, mtbf_s: float,
                  record_s: float | None = None, state_s: float = 1e-3, encode_s_per_byte: float = 1e-9,
                  base_capture_s: float | None = None, base_encode_s: float | None = None,
                  update_s: float = 2e-3, memory_bytes: float = 256 << 20, steps: int = 1500,
                  step_pattern: Sequence[float] = (), **extra: Any) -> Scenario:
    """A scenario whose restore costs follow from its storage: replay reads and decodes a
    step's diff and repeats the update; loading a base reads and unpacks it."""
    if record_s is None:
        record_s = record_bytes / 20e9 + 2e-4  # a device-to-host copy at ~20 GB/s
    if base_capture_s is None:
        base_capture_s = base_bytes / 10e9 + 1e-3
    if base_encode_s is None:
        base_encode_s = base_bytes / 2e9
    diff_bytes = record_bytes * diff_ratio
    replay = update_s + diff_bytes / bandwidth_bps + encode_s_per_byte * record_bytes
    load = latency_s + base_bytes / bandwidth_bps + base_encode_s
    return Scenario(name=name, step_s=step_s, record_s=record_s, state_s=state_s, diff_bytes=diff_bytes,
                    record_bytes=record_bytes, encode_s_per_byte=encode_s_per_byte, latency_s=latency_s,
                    bandwidth_bps=bandwidth_bps, base_bytes=base_bytes, base_capture_s=base_capture_s,
                    base_encode_s=base_encode_s, replay_step_s=replay, base_load_s=load,
                    memory_bytes=memory_bytes, mtbf_s=mtbf_s, steps=steps, step_pattern=tuple(step_pattern),
                    update_s=update_s, **extra)


def storage_change(s: Scenario, *, latency_s: float | None = None,
                   bandwidth_bps: float | None = None) -> dict[str, float]:
    """The changed fields when storage gets slower or faster: writes, and the restore costs
    that read from it (as :func:`make_scenario` derives them)."""
    lat = s.latency_s if latency_s is None else latency_s
    bw = s.bandwidth_bps if bandwidth_bps is None else bandwidth_bps
    return {"latency_s": lat, "bandwidth_bps": bw,
            "replay_step_s": s.replay_step_s - s.diff_bytes / s.bandwidth_bps + s.diff_bytes / bw,
            "base_load_s": s.base_load_s - s.latency_s - s.base_bytes / s.bandwidth_bps + lat + s.base_bytes / bw}


@dataclass
class SimResult:
    """What one simulated run measured (seconds unless said otherwise)."""

    wall_s: float  # of the whole run
    window_s: float  # wall time of the steps measured (whole base cycles, or the whole run)
    steps: int  # steps measured
    compute_s: float  # their training time without checkpointing
    overhead: float  # (window - compute) / compute
    writer_busy: float  # share of the window the writer was writing
    max_recovery_s: float  # worst base load + replay over the run
    lost_s: float  # expected work lost by a failure uniform in the run
    recovery_s: float  # expected recovery time of such a failure
    loss: float  # overhead + (lost + recovery) / mtbf
    stall_s: float  # training's waits for the writer over the whole run
    segments: int  # writes started by the end of training
    bases: int
    history: list[tuple[int, Settings]] = field(default_factory=list)  # (from step, settings)

    def meets(self, max_overhead: float, rto_s: float | None, writer_headroom: float = 0.8) -> bool:
        """Whether the run met the tuner's constraints, as measured."""
        return (self.writer_busy <= writer_headroom and self.overhead <= max_overhead
                and (rto_s is None or self.max_recovery_s <= rto_s))

    def settings_at(self, step: int) -> Settings:
        """The settings in force at ``step``."""
        current = self.history[0][1]
        for at, s in self.history:
            if at > step:
                break
            current = s
        return current

    @property
    def changes(self) -> int:
        """How many times the settings changed during the run."""
        return len(self.history) - 1


class _Writer:
    """The writer thread, advanced lazily: items are taken in FIFO order when the writer is free,
    each taking the service time its kind and the current costs give."""

    def __init__(self, costs: dict[str, float], meter: Meter | None) -> None:
        self.c = costs
        self.meter = meter
        self.queue: collections.deque[tuple[float, bool, int, float, float, bool]] = collections.deque()
        self.free_at = 0.0  # busy until
        self.frees: collections.deque[tuple[float, float]] = collections.deque()  # (time, bytes)
        self.queued = 0.0  # bytes counted against the budget (queued, pending, base in flight)
        self.pending: list[tuple[int, float, float]] = []  # (step, record bytes, encoded bytes)
        self.last_restorable = 0  # len of pending up to the newest restorable record
        self.write_batch = 1
        self.busy: list[tuple[float, float]] = []
        self.durable: list[tuple[float, int, bool]] = []  # (time, step, is a base)
        self.meter_events: collections.deque[tuple[float, Callable[..., None], tuple[Any, ...]]] = collections.deque()
        self.segments = self.bases = 0

    def advance(self, t: float) -> None:
        """Take every item the writer starts by time ``t``; apply frees done by then."""
        q = self.queue
        while q:
            enq, is_base, step, nbytes, diff, restorable = q[0]
            start = max(enq, self.free_at)
            if start > t:
                break
            q.popleft()
            if is_base:
                self._base(start, step, nbytes)
            else:
                self.pending.append((step, nbytes, diff))
                if restorable:
                    self.last_restorable = len(self.pending)
                    if len(self.pending) >= self.write_batch:
                        self.free_at = self._segment(start)
        frees = self.frees
        while frees and frees[0][0] <= t:
            self.queued -= frees.popleft()[1]

    def put(self, t: float, is_base: bool, step: int, nbytes: float, diff: float, restorable: bool,
            budget: float) -> float:
        """Queue an item at ``t``; return when the training thread got it in (after any wait)."""
        self.advance(t)
        while self.queue and self.queued + nbytes > budget:
            nxt = self.free_at
            if self.frees and self.frees[0][0] < nxt:
                nxt = self.frees[0][0]
            t = max(t, nxt)
            self.advance(t)
        self.queue.append((t, is_base, step, nbytes, diff, restorable))
        self.queued += nbytes
        return t

    def _segment(self, start: float) -> float:
        cut = self.last_restorable
        if not cut:
            return start
        records = self.pending[:cut]
        del self.pending[:cut]
        self.last_restorable = 0
        c = self.c
        raw = sum(r for _, r, _ in records)
        enc = sum(d for _, _, d in records)
        encode_s = c["encode_s_per_byte"] * raw
        write_s = c["latency_s"] + enc / c["bandwidth_bps"]
        end = start + encode_s + write_s
        self.busy.append((start, end))
        self.frees.append((end, raw))
        self.durable.append((end, records[-1][0], False))
        self.segments += 1
        if self.meter is not None:
            self.meter_events.append((end, self.meter.add_segment, (int(raw), int(enc), encode_s)))
            self.meter_events.append((end, self.meter.add_write, (int(enc), write_s)))
        return end

    def _base(self, start: float, step: int, nbytes: float) -> None:
        t = self._segment(start)
        c = self.c
        state_s = c["latency_s"] + nbytes / c["bandwidth_bps"]
        commit_s = c["latency_s"] + COMMIT_BYTES / c["bandwidth_bps"]
        end = t + c["base_encode_s"] + state_s + commit_s
        self.busy.append((t, end))
        self.frees.append((end, nbytes))
        self.durable.append((end, step, True))
        self.free_at = end
        self.bases += 1
        if self.meter is not None:
            m = self.meter
            self.meter_events.append((end, m.add_base, (int(nbytes), c["base_encode_s"])))
            self.meter_events.append((end, m.add_write, (int(nbytes), state_s)))
            self.meter_events.append((end, m.add_write, (COMMIT_BYTES, commit_s)))

    def feed_meter(self, t: float) -> None:
        """Report to the meter the writes finished by ``t`` (as the writer thread would)."""
        ev = self.meter_events
        while ev and ev[0][0] <= t:
            _, fn, args = ev.popleft()
            fn(*args)


def simulate(scn: Scenario, policy: Settings | Controller, *, initial: Settings | None = None,
             retune_every_n_steps: int = 50, meter: Meter | None = None, steps: int | None = None) -> SimResult:
    """Simulate ``scn`` under fixed settings or a controller.

    Under fixed settings with periodic bases and no changes, the figures are those of the steady
    state: measured from the first periodic base to the last one, whole base cycles, so that
    neither the session's starting base nor a base just before the end skews them; the run is
    lengthened to two cycles where ``scn.steps`` holds fewer. Without periodic bases they cover
    the last two thirds of the run; under a controller or changes, the whole run.

    Args:
        policy: fixed :class:`Settings`, or a controller called after step ``WARMUP_STEPS`` and
            every ``retune_every_n_steps`` steps after it, whose settings apply from the next step.
        initial: the settings before a controller's first call (default: the engine's defaults).
        meter: fed with the simulated timings (a new one is made for a controller if not given).
        steps: simulate exactly this many steps instead.
    """
    controller: Controller | None = None
    if isinstance(policy, Settings):
        settings = policy
    else:
        controller = policy
        settings = initial or Settings(1, 8, 500)
        if meter is None:
            meter = Meter(int(scn.memory_bytes))
    steady = controller is None and not scn.changes and settings.base_every_n_steps is not None
    if steps is not None:
        n_steps = steps
    else:
        n_steps = max(scn.steps, 2 * settings.base_every_n_steps) if steady else scn.steps  # type: ignore[operator]
    c = scn.costs()
    writer = _Writer(c, meter)
    writer.write_batch = settings.write_batch
    change_at = {at: dict(ch) for at, ch in scn.changes}
    restore_costs: list[tuple[float, float, float]] = [(0.0, c["base_load_s"], c["replay_step_s"])]
    pattern = scn.step_pattern or (1.0,)
    history = [(0, settings)]
    if meter is not None:
        # The engine's storage probe at the session's start: its writes, then the bandwidth seed.
        lat, bw = c["latency_s"], c["bandwidth_bps"]
        probe = [(size, lat + size / bw) for size in (1 << 10, 1 << 20)] * 2
        for nbytes, seconds in probe:
            meter.add_write(nbytes, seconds)
        meter.add_probe(probe)

    # Step 0: the session's base.
    t = c["base_capture_s"]
    if meter is not None:
        meter.add_base_capture(c["base_capture_s"], int(c["base_bytes"]))
    t = writer.put(t, True, 0, c["base_bytes"], 0.0, True, c["memory_bytes"])
    finished = [t]  # wall time at which training finished each step
    computed = [0.0]  # training time without checkpointing, up to each step
    bases: list[int] = []  # periodic base steps
    last_base = 0
    compute = 0.0
    stall = 0.0
    put = writer.put
    step_s0, record_s, state_s, record_bytes, diff_bytes, budget = (
        c["step_s"], c["record_s"], c["state_s"], c["record_bytes"], c["diff_bytes"], c["memory_bytes"])
    n_pattern = len(pattern)
    for i in range(1, n_steps + 1):
        if i in change_at:
            writer.advance(t)
            c.update(change_at[i])
            restore_costs.append((t, c["base_load_s"], c["replay_step_s"]))
            step_s0, record_s, state_s, record_bytes, diff_bytes, budget = (
                c["step_s"], c["record_s"], c["state_s"], c["record_bytes"], c["diff_bytes"], c["memory_bytes"])
        step_s = step_s0 * pattern[i % n_pattern]
        t += step_s
        compute += step_s
        every = settings.base_every_n_steps
        base = every is not None and i - last_base >= every
        restorable = base or i % settings.every_n_steps == 0
        t += record_s + state_s if restorable else record_s
        got = put(t, False, i, record_bytes, diff_bytes, restorable, budget)
        stall += got - t
        t = got
        if base:
            t += c["base_capture_s"]
            got = put(t, True, i, c["base_bytes"], 0.0, True, budget)
            stall += got - t
            t = got
            last_base = i
            bases.append(i)
        finished.append(t)
        computed.append(compute)
        if meter is not None:
            meter.add_step(step_s, record_s, int(record_bytes))
            meter.add_update(max(0.0, c["replay_step_s"] - diff_bytes / c["bandwidth_bps"]
                                 - c["encode_s_per_byte"] * record_bytes))
            if restorable:
                meter.add_state(state_s)
            if base:
                meter.add_base_capture(c["base_capture_s"], int(c["base_bytes"]))
        if controller is not None and i >= WARMUP_STEPS and (i - WARMUP_STEPS) % retune_every_n_steps == 0:
            writer.advance(t)
            writer.feed_meter(t)
            assert meter is not None
            new = controller(meter, i, settings)
            if new != settings:
                settings = new
                writer.write_batch = new.write_batch
                history.append((i + 1, new))
    writer.advance(t)
    if meter is not None:  # what the writer finished by the end of the run
        writer.feed_meter(t)
    if steady and len(bases) >= 2:
        first, last = bases[0], bases[-1]
    elif controller is None and not scn.changes and settings.base_every_n_steps is None:
        first, last = n_steps // 3, n_steps  # past the session's starting base
    else:
        first, last = 0, n_steps
    return _measure(scn, writer, finished, restore_costs, (first, last), computed[last] - computed[first],
                    stall, history)


def _measure(scn: Scenario, writer: _Writer, finished: list[float], restore_costs: list[tuple[float, float, float]],
             window: tuple[int, int], compute: float, stall: float, history: list[tuple[int, Settings]]) -> SimResult:
    """Integrate lost work and recovery over the timeline of durable steps, exactly, for a
    failure uniform in the time training took from step ``window[0]`` to ``window[1]``."""
    ta = finished[window[0]] if window[0] else 0.0
    tb = finished[window[1]]
    # Breakpoints: durability events and changes of restore costs, in time order.
    events: list[tuple[float, int, int, bool]] = [(t, 1, s, b) for t, s, b in writer.durable]
    events += [(t, 0, k, False) for k, (t, _, _) in enumerate(restore_costs) if k]
    events.sort(key=lambda e: (e[0], e[1]))
    load, replay = restore_costs[0][1], restore_costs[0][2]
    durable: int | None = None
    base: int | None = None
    lost = recovery = 0.0
    worst = 0.0
    prev = 0.0

    def integrate(a: float, b: float) -> None:
        nonlocal lost, recovery, worst
        a, b = max(a, ta), min(b, tb)
        if b <= a:
            return
        if durable is None or base is None:  # nothing to restore: start over
            lost += (b * b - a * a) / 2
            return
        lost += (b * b - a * a) / 2 - finished[durable] * (b - a)
        r = load + replay * (durable - base)
        recovery += r * (b - a)
        worst = max(worst, r)

    for te, kind, value, is_base in events:
        if te >= tb:
            break
        integrate(prev, te)
        prev = te
        if kind == 0:
            load, replay = restore_costs[value][1], restore_costs[value][2]
        else:
            durable = value if durable is None else max(durable, value)
            if is_base:
                base = value
    integrate(prev, tb)
    span = tb - ta
    busy = sum(min(e, tb) - max(s, ta) for s, e in writer.busy if s < tb and e > ta)
    overhead = (span - compute) / compute
    lost_s, recovery_s = lost / span, recovery / span
    return SimResult(wall_s=finished[-1], window_s=span, steps=window[1] - window[0], compute_s=compute,
                     overhead=overhead, writer_busy=busy / span, max_recovery_s=worst, lost_s=lost_s,
                     recovery_s=recovery_s, loss=overhead + (lost_s + recovery_s) / scn.mtbf_s, stall_s=stall,
                     segments=writer.segments, bases=writer.bases, history=history)


def grid_settings(*, every_n_steps: int | None = None, write_batch: int | None = None,
                  base_every_n_steps: int | str | None = "auto", grid: Sequence[int], max_k: int,
                  max_base: int) -> list[Settings]:
    """The settings the tuner's candidate families span, over ``grid`` (free knobs), bounded:
    restorable points where segments end (``every_n_steps = write_batch = k``) unless a knob is
    fixed, and bases every ``j`` segments."""
    pairs: list[tuple[int, int]]
    if every_n_steps is None and write_batch is None:
        pairs = [(k, k) for k in grid if k <= max_k]
    elif every_n_steps is None:
        assert write_batch is not None
        pairs = [(n, write_batch) for n in grid if n <= max_k]
    elif write_batch is None:
        pairs = [(every_n_steps, every_n_steps * j) for j in grid if every_n_steps * j <= max_k]
    else:
        pairs = [(every_n_steps, write_batch)]
    out = []
    for n, b in pairs:
        if base_every_n_steps != "auto":
            out.append(Settings(n, b, base_every_n_steps))  # type: ignore[arg-type]
            continue
        k = n * -(-b // n)
        out += [Settings(n, b, k * j) for j in grid if k * j <= max_base]
    return out


def grid_optimum(scn: Scenario, candidates: Sequence[Settings], *, max_overhead: float,
                 rto_s: float | None, stop_above: float = 1.01) -> tuple[Settings, SimResult, int]:
    """The candidate with the least simulated loss among those meeting the constraints as
    simulated; returns it, its result and how many runs were simulated.

    A branch-and-bound over the grid, to keep it fast without missing the optimum. Candidates
    are grouped by ``(every_n_steps, write_batch)``; each pair is first simulated without
    periodic bases, which bounds what any base interval can do: bases only add to the overhead,
    the writer's load and the work lost, and a recovery costs at least a base load. A pair that
    breaks a limit that way, or whose bound is no better than the best found, is skipped; pairs
    are tried from the lowest bound up. Within a pair the base intervals are tried in increasing
    order, stopping once the loss exceeds ``stop_above`` times the least seen for the pair (past
    its optimum the loss only grows with the interval: replay grows linearly, base copies shrink
    as its inverse) or the recovery bound is broken (the worst recovery grows with it too).
    """
    pairs: dict[tuple[int, int], list[Settings]] = {}
    for s in candidates:
        pairs.setdefault((s.every_n_steps, s.write_batch), []).append(s)
    simulated = 0
    bounds: list[tuple[float, tuple[int, int]]] = []
    for key, group in pairs.items():
        group.sort(key=lambda s: math.inf if s.base_every_n_steps is None else s.base_every_n_steps)
        if len(group) == 1:
            bounds.append((0.0, key))
            continue
        bare = simulate(scn, Settings(*key, None))
        simulated += 1
        if bare.meets(max_overhead, None):
            load = min(scn.base_load_s, scn.after_changes().base_load_s)
            bounds.append((bare.overhead + (bare.lost_s + load) / scn.mtbf_s, key))
    best: tuple[Settings, SimResult] | None = None
    for bound, key in sorted(bounds):
        if best is not None and bound >= best[1].loss:
            break
        pair_best = math.inf
        for s in pairs[key]:
            r = simulate(scn, s)
            simulated += 1
            if rto_s is not None and r.max_recovery_s > rto_s:
                break
            if not r.meets(max_overhead, rto_s):
                continue
            if best is None or r.loss < best[1].loss:
                best = (s, r)
            if r.loss > stop_above * pair_best:
                break
            pair_best = min(pair_best, r.loss)
    if best is None:
        raise AssertionError(f"{scn.name}: no candidate meets the constraints in simulation")
    return best[0], best[1], simulated


def fmt(r: SimResult) -> str:
    """One line for failure messages."""
    return (f"J={r.loss:.4%} overhead={r.overhead:.3%} busy={r.writer_busy:.0%} lost={r.lost_s:.2f}s "
            f"rec={r.recovery_s:.2f}s worst_rec={r.max_recovery_s:.1f}s stall={r.stall_s:.2f}s")
