"""The auto-tuner: a pure policy that picks ``every_n_steps``, ``write_batch`` and
``base_every_n_steps`` from a small :class:`Measurements` object.

The cost model (``docs/tuning.md`` derives it) is the expected time lost per unit of training
time: what checkpointing costs the training thread, plus the failure rate times what a failure
costs (the work since the newest step a resume gets back, and the recovery: base load plus
replay). Without the node-local tier that step is the newest durable one; with it, the newest
restorable step journaled on the node, so a restorable point then trades its own cost (the state
gathered, its bytes) against the work a crash loses, and no longer against segment writes. The tuner
evaluates it over a grid of candidate settings, keeps those that satisfy the constraints (the
writer keeps up, buffered diffs fit in memory, overhead within ``max_overhead``, worst-case
recovery within ``rto_s``) and picks the cheapest; it switches away from the settings in force
only when that saves more than a margin (hysteresis), so settings do not flap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..policyoptions import AUTO, TuningOptions
from ..units import format_bytes, format_rate

__all__ = ["AUTO", "AutoTuner", "Decision", "Estimate", "Measurements", "Settings", "TuningOptions", "describe",
           "expected_loss", "tuning_metrics"]

WRITER_HEADROOM = 0.8  # the writer may be busy at most this share of the time
HYSTERESIS = 0.1  # switch only when the new settings lose at least 10% less
MAX_INTERVAL = 1_000_000
# The longest segment weighed with restorable points inside it (node-local tier): enough to
# amortize a write request, and a grid of n x b x base small enough to review in milliseconds.
MAX_SEGMENT = 10_000


def _grid(limit: int) -> list[int]:
    """1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 40, 50, ... up to ``limit``."""
    out, decade = [], 1
    while decade <= limit:
        out += [v * decade for v in ((1, 2, 3, 4, 5, 6, 8) if decade == 1 else (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8))]
        decade *= 10
    return sorted({int(v) for v in out if v <= limit})


GRID = _grid(MAX_INTERVAL)





@dataclass(frozen=True)
class Measurements:
    """What the cost model needs, all per optimizer step unless said otherwise (seconds, bytes).

    Attributes:
        step_s: training time of a step with checkpointing taken out.
        record_s: training-thread cost paid at every step whatever the settings (gradient
            copies, the step's record).
        state_s: training-thread cost of a restorable point (loop state, schedulers, RNG).
        diff_bytes: bytes a step's record takes on storage (encoded, compressed).
        record_bytes: bytes a step's record holds in memory until its segment is written.
        encode_s_per_byte: writer time to encode and compress a byte of records.
        latency_s: fixed time of one write request on this storage.
        bandwidth_bps: bytes per second of one write request.
        base_bytes: size of a base on storage.
        base_capture_s: training-thread time to copy a base.
        base_encode_s: writer time to serialize a base.
        replay_step_s: time to replay one step when restoring (read, decode, optimizer step).
        base_load_s: time to read and load a base when restoring.
        memory_bytes: memory the writer queue may hold (``max_pending_bytes``).
        steps: steps trained in this session (for ``base_every_n_steps=None``).
        state_bytes: bytes a restorable point adds to its step's record (the framework state).
        local_tier: records are journaled on the node as they are encoded (``local_dir``), so a
            crash loses only the steps since the newest restorable one, not the durable lag.
    """

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
    steps: int = 0
    state_bytes: float = 0.0
    local_tier: bool = False

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items()}

    @classmethod
    def slowest(cls, ms: list[Measurements]) -> Measurements:
        """What several writers of one job measured, as one writer at the worst of each (sharded
        training: every rank writes its stream, and the slowest decides when steps are durable
        and restored): the largest costs and sizes, the smallest bandwidth and memory."""
        least = {"bandwidth_bps", "memory_bytes", "steps", "local_tier"}  # a rank without the tier: off
        return cls(**{k: (min if k in least else max)(getattr(m, k) for m in ms) for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Settings:
    """The three knobs (``base_every_n_steps=None``: only the session's starting base)."""

    every_n_steps: int
    write_batch: int
    base_every_n_steps: int | None

    @property
    def segment_steps(self) -> int:
        """Steps per segment: the writer cuts a segment at the first restorable step once
        ``write_batch`` records are pending, so this is ``write_batch`` rounded up to a multiple
        of ``every_n_steps``; it is also how far apart durable steps are."""
        n = self.every_n_steps
        return n * -(-self.write_batch // n)

    def as_dict(self) -> dict[str, Any]:
        return {"every_n_steps": self.every_n_steps, "write_batch": self.write_batch,
                "base_every_n_steps": self.base_every_n_steps}


@dataclass(frozen=True)
class Estimate:
    """The cost model's prediction for one set of settings (seconds unless said otherwise)."""

    settings: Settings
    overhead: float  # share of step time taken from training (capture, base copies, stalls)
    lost_work_s: float  # expected work lost by a failure (since the newest step a resume gets back)
    recovery_s: float  # expected recovery time (base load + replay)
    worst_recovery_s: float
    writer_utilization: float
    memory_bytes: float  # peak bytes buffered for the writer
    loss: float  # expected time lost per unit of training time
    violations: tuple[str, ...] = ()
    lost_steps: float = 0.0  # lost_work_s in steps
    worst_lost_s: float = 0.0  # the most work a failure loses (just before a restorable point)
    worst_lost_steps: float = 0.0

    @property
    def feasible(self) -> bool:
        return not self.violations


def _model(n: np.ndarray, b: np.ndarray, base: np.ndarray, m: Measurements, o: TuningOptions,
           slack: float) -> dict[str, np.ndarray]:
    """The cost model over arrays of settings (``base`` is ``nan`` for no periodic bases).

    One evaluation serves one setting (:func:`expected_loss`) and the whole candidate grid
    (:meth:`AutoTuner.decide`), so both always agree."""
    T = max(m.step_s, 1e-9)
    # A step's record in memory, and its bytes on storage, with the state a restorable point adds
    # (every n-th record) spread over the steps.
    R = m.record_bytes + m.state_bytes / n
    D = m.diff_bytes + m.state_bytes / n * (m.diff_bytes / m.record_bytes if m.record_bytes > 0 else 1.0)
    S, M = m.base_bytes, m.memory_bytes
    k = n * np.ceil(b / n)
    periodic = ~np.isnan(base)
    every = np.where(periodic, base, np.maximum(k, max(m.steps, 1)))
    B = max(m.bandwidth_bps, 1.0)
    # Writer time per segment and per base; bases are two objects (state, then COMMIT).
    w_seg = m.encode_s_per_byte * k * R + m.latency_s + k * D / B
    w_base = m.base_encode_s + 2 * m.latency_s + S / B
    rho_seg = w_seg / (k * T)
    rho = rho_seg + np.where(periodic, w_base / (every * T), 0.0)
    # Memory: a segment's records wait until it is written, a base's copy until it is written.
    # At a base step the writer writes that step's segment (done at t1), then the base (done at
    # t2); the records trained meanwhile queue in what the segment and the base leave of
    # max_pending_bytes (the first one always gets in once the writer has taken the base).
    # Training waits for the writer when the next record does not fit; with the node-local tier
    # also while the record handed over before is not journaled, so then one record fits.
    pending = k * R
    stall = np.zeros_like(k)
    if m.record_bytes + m.state_bytes > 0:
        c = m.base_capture_s
        # The journal's records were encoded as they came: at a base only the commit is left.
        t1 = np.maximum(m.latency_s + k * D / B if m.local_tier else w_seg, c)
        t2 = t1 + w_base
        fit1 = np.maximum(0.0, np.floor((M - pending - S) / R))
        fit2 = np.maximum(1.0, np.floor((M - S) / R))
        if m.local_tier:
            fit1, fit2 = np.minimum(fit1, 1.0), np.ones_like(k)
        stall = np.where(periodic, np.maximum(0.0, np.maximum(t1 - c - (fit1 + 1) * T, t2 - c - (fit2 + 1) * T)),
                         0.0)
    overhead_s = m.record_s + m.state_s / n + np.where(periodic, (m.base_capture_s + stall) / every, 0.0)
    # A failure loses the work since the newest step a resume gets back, and the time that step
    # takes to get where a resume finds it. Without the node-local tier that is the newest
    # durable step: half a segment on average, the newest segment's write, and the delay a base
    # write adds to the segments queued behind it (they drain at the writer's spare rate). With
    # it, the newest restorable step journaled on the node: half of every_n_steps, and the
    # encoding of one record (training waits while the record before is not journaled, so a
    # base write stalls training, counted above, instead of adding to the loss); resuming then
    # commits the journaled records (half a segment on average) as one segment first.
    if m.local_tier:
        gap, lag, late = n, m.encode_s_per_byte * R, np.zeros_like(k)
        merge = m.latency_s + k * D / B  # at worst a whole segment; half of it on average
        merge_avg = m.latency_s + k * D / (2 * B)
    else:
        spare = np.maximum(1 - rho_seg, 1e-12)
        gap, lag, merge, merge_avg = k, w_seg, 0.0, 0.0
        late = np.where(periodic & (rho_seg < 1), w_base * w_base / (2 * spare * every * T), 0.0)
    lost = gap * (T + overhead_s) / 2 + lag + late
    worst_lost = gap * (T + overhead_s) + lag + np.where(periodic & (late > 0), w_base, 0.0)
    recovery = m.base_load_s + m.replay_step_s * np.maximum(0.0, every - gap) / 2 + merge_avg
    worst = m.base_load_s + m.replay_step_s * every + merge
    return {
        "overhead": overhead_s / T, "lost": lost, "recovery": recovery, "worst": worst, "rho": rho,
        "worst_lost": worst_lost, "step": T + overhead_s,
        "memory": pending + np.where(periodic, S + w_base / T * R, 0.0),
        "loss": overhead_s / T + (lost + recovery) / o.mtbf_s,
        "writer": rho > WRITER_HEADROOM * slack,
        "pending": pending > M / 2 * slack,
        # The gradient copies (record_s) are paid whatever the settings: when they alone exceed
        # the budget, the budget cannot be met and only the expected loss decides.
        "budget": (overhead_s / T > o.max_overhead * slack) & (m.record_s / T < o.max_overhead),
        "rto": worst > (o.rto_s * slack if o.rto_s is not None else np.inf),
    }


def _arrays(settings: list[Settings]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (np.array([s.every_n_steps for s in settings], dtype=float),
            np.array([s.write_batch for s in settings], dtype=float),
            np.array([np.nan if s.base_every_n_steps is None else s.base_every_n_steps for s in settings],
                     dtype=float))


def expected_loss(s: Settings, m: Measurements, o: TuningOptions, slack: float = 1.0) -> Estimate:
    """Evaluate the cost model (``docs/tuning.md`` gives the formulas and their reasoning).

    ``slack`` widens every limit by that factor: settings in force count as meeting a limit they
    exceed only by noise, so that measurements wobbling around a limit do not flip them."""
    r = {key: float(v[0]) for key, v in _model(*_arrays([s]), m, o, slack).items()}
    violations = []
    if r["writer"]:
        violations.append(f"writer busy {r['rho']:.0%} of the time (limit {WRITER_HEADROOM:.0%})")
    if r["pending"]:
        violations.append("a segment's records exceed half of max_pending_bytes")
    if r["budget"]:
        violations.append(f"overhead {r['overhead']:.1%} > max_overhead {o.max_overhead:.1%}")
    if r["rto"]:
        violations.append(f"worst-case recovery {r['worst']:.0f}s > rto_s {o.rto_s:.0f}s")
    return Estimate(s, r["overhead"], r["lost"], r["recovery"], r["worst"], r["rho"], r["memory"], r["loss"],
                    tuple(violations), r["lost"] / r["step"], r["worst_lost"], r["worst_lost"] / r["step"])


@dataclass(frozen=True)
class Decision:
    """What :meth:`AutoTuner.decide` chose and why."""

    settings: Settings
    estimate: Estimate
    current: Estimate | None
    changed: bool
    reason: str


@dataclass
class AutoTuner:
    """Chooses the knobs left on ``"auto"``; fixed knobs stay as given.

    Args:
        options: MTBF, overhead budget, recovery-time objective.
        every_n_steps, write_batch, base_every_n_steps: ``"auto"`` or the fixed value.
    """

    options: TuningOptions = field(default_factory=TuningOptions)
    every_n_steps: int | str = AUTO
    write_batch: int | str = AUTO
    base_every_n_steps: int | str | None = AUTO
    _grid: tuple[bool, list[Settings], tuple[np.ndarray, np.ndarray, np.ndarray]] | None = field(
        default=None, init=False, repr=False, compare=False)

    def fix_base_every(self, base_every_n_steps: int | None) -> None:
        """Hold ``base_every_n_steps`` fixed at a value decided elsewhere (``"bytes"``: the
        interval sized from the bytes recorded; see ``tuning/online.py``)."""
        if base_every_n_steps != self.base_every_n_steps:
            self.base_every_n_steps = base_every_n_steps
            self._grid = None

    def candidates(self, local_tier: bool = False) -> list[Settings]:
        """The settings to weigh. ``local_tier``: a crash resumes from the newest restorable step
        journaled on the node, so restorable points between two writes are worth their cost."""
        n_fixed, b_fixed, m_fixed = (v != AUTO for v in (self.every_n_steps, self.write_batch,
                                                          self.base_every_n_steps))
        pairs: list[tuple[int, int]] = []
        if not n_fixed and not b_fixed and local_tier:  # segments of whole restorable intervals
            pairs = [(n, n * j) for n in GRID for j in GRID if j == 1 or n * j <= MAX_SEGMENT]
        elif not n_fixed and not b_fixed:  # restorable points only where they become durable
            pairs = [(k, k) for k in GRID]
        elif not n_fixed:
            pairs = [(n, int(self.write_batch)) for n in GRID]
        elif not b_fixed:
            n = int(self.every_n_steps)
            pairs = [(n, n * j) for j in GRID if n * j <= MAX_INTERVAL]
        else:
            pairs = [(int(self.every_n_steps), int(self.write_batch))]
        out = []
        for n, b in pairs:
            k = n * -(-b // n)
            if m_fixed:
                out.append(Settings(n, b, self.base_every_n_steps))  # type: ignore[arg-type]
            else:
                out += [Settings(n, b, k * j) for j in GRID if k * j <= MAX_INTERVAL]
        return out

    def decide(self, m: Measurements, current: Settings | None = None) -> Decision:
        """Pick the settings with the least expected loss among those meeting every constraint
        (or, if none does, the one with the fewest and mildest violations), and keep ``current``
        unless it breaks a constraint the choice meets or loses ``HYSTERESIS`` more."""
        if self._grid is None or self._grid[0] != m.local_tier:
            candidates = self.candidates(m.local_tier)
            self._grid = (m.local_tier, candidates, _arrays(candidates))
        _, candidates, arrays = self._grid
        r = _model(*arrays, m, self.options, 1.0)
        count = r["writer"].astype(int) + r["pending"] + r["budget"] + r["rto"]
        # Feasible first, by expected loss; among infeasible ones, fewer violations, then the
        # least expected loss with the writer's excess counted as stall (a writer that cannot
        # keep up makes training wait), then the least overhead.
        score = np.where(count == 0, r["loss"], r["loss"] + np.maximum(0.0, r["rho"] - WRITER_HEADROOM))
        best = expected_loss(candidates[int(np.lexsort((r["overhead"], score, count))[0])], m, self.options)
        if current is None:
            return Decision(best.settings, best, None, True, "first choice")
        now = expected_loss(current, m, self.options, slack=1 + HYSTERESIS)
        if now.settings == best.settings:
            return Decision(current, now, now, False, "already the best")
        if now.feasible or not best.feasible:
            if now.loss <= best.loss * (1 + HYSTERESIS) and len(now.violations) <= len(best.violations):
                return Decision(current, now, now, False, "within the hysteresis margin")
            reason = f"expected loss {now.loss:.3%} -> {best.loss:.3%}"
        else:
            reason = "; ".join(now.violations)
        return Decision(best.settings, best, now, True, reason)


def tuning_metrics(decision: Decision, m: Measurements) -> dict[str, float]:
    """A review as flat ``diffckpt/*`` metrics for experiment loggers."""
    e = decision.estimate
    out = {f"diffckpt/{k}": float(v if v is not None else 0) for k, v in decision.settings.as_dict().items()}
    out.update({"diffckpt/expected_loss": e.loss, "diffckpt/overhead": e.overhead,
                "diffckpt/lost_work_s": e.lost_work_s, "diffckpt/lost_steps": e.lost_steps,
                "diffckpt/worst_lost_steps": e.worst_lost_steps, "diffckpt/recovery_s": e.recovery_s,
                "diffckpt/writer_utilization": e.writer_utilization})
    out.update({f"diffckpt/measured/{k}": float(v) for k, v in m.as_dict().items()})
    return out


def describe(m: Measurements) -> str:
    """One line of the measurements behind a decision, for logs."""
    return (f"step {m.step_s * 1e3:.1f} ms, capture {m.record_s * 1e3:.2f} ms + state {m.state_s * 1e3:.2f} ms, "
            f"diff {format_bytes(m.diff_bytes)}, "
            f"write {m.latency_s * 1e3:.1f} ms + {format_rate(m.bandwidth_bps)}, "
            f"base {format_bytes(m.base_bytes)} (copy {m.base_capture_s * 1e3:.1f} ms), "
            f"replay {m.replay_step_s * 1e3:.2f} ms/step + load {m.base_load_s:.2f} s")

