"""How many replicas each pool should have: a pure policy over a window of measured work
(DESIGN.md section 8, rebalance). `kvfleet rebalance` (services/cli/rebalance_cmd.py) feeds it
what it measures on a fleet; the simulator's loop (services/planner/rebalance_sim.py) feeds it the
simulated workers' busy seconds.

Per pool (prefill, decode, or mixed for a co-located fleet), from one window:

  demand       replica-seconds of engine work per second = busy seconds / window seconds (the
               busy seconds of the replicas that served in the window: a worker still starting
               is no replica yet, so its warm-up is not load). A decode pool's busy seconds are
               first weighted by its steps' share of the ITL target (`decode_work_s`): a decode
               replica is busy whenever one sequence runs, whatever its batch
  utilization  demand / replicas
  wanted       ceil(demand / target_utilization): the replicas that run at the target
  tail         TTFT p99 over its target pushes prefill (mixed: either tail), ITL p99 over its
               target pushes decode: at least one replica more, and never fewer while it breaks

  up      utilization > target + band, or the tail breaks its target
  down    utilization < target - band and the tail holds, and the pool stays at or under the
          target after it (down only to what `wanted` says), in `down_windows` windows in a row
          (ups act at once, downs wait: a noisy window does not shrink a pool): the hysteresis
          that keeps a load from flapping between two sizes
  step    at most max(1, floor(max_step_fraction x replicas)) replicas per decision
  budget  the recommended total never exceeds `budget` (more than one pool wants up: the one
          under most pressure first, a breaking tail before a high utilization); a fleet already
          over the budget is recommended one step down on its least loaded pool
  cool-down  no change until `cooldown_s` after the last one (a new worker's start-up, and a
          window of its own load, must pass before its effect is judged)

`decide` returns one `Decision` per pool and the state after it; it reads no clock of its own.
"""
from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

POOLS = ("prefill", "decode", "mixed")


class Reason(str, enum.Enum):
    """Why a pool's recommendation is what it is (exported as a label, written to the audit log)."""

    HOLD = "hold"                       # inside the band, tail fine
    UTILIZATION_HIGH = "utilization_high"
    UTILIZATION_LOW = "utilization_low"
    TTFT_P99 = "ttft_p99"               # TTFT p99 over its target
    ITL_P99 = "itl_p99"                 # ITL p99 over its target
    COOLDOWN = "cooldown"               # a change is too recent
    BUDGET = "budget"                   # wanted more, the budget had no room
    OVER_BUDGET = "over_budget"         # the fleet is larger than the budget
    NO_DATA = "no_data"                 # no replica served in the window
    MANUAL = "manual"                   # an operator set the size (kvfleet rebalance --replicas)
    STABILIZING = "stabilizing"         # wants fewer, not yet for down_windows windows in a row


@dataclass(frozen=True)
class RebalanceConfig:
    target_utilization: float = 0.70    # as the capacity model plans a replica (constants.py)
    band: float = 0.15                  # hysteresis: no move while |utilization - target| <= band
    max_step_fraction: float = 0.25     # per decision: max(1, floor(this x replicas))
    cooldown_s: float = 120.0           # no change this long after the last one
    budget: int = 8                     # most replicas, all pools together
    min_replicas: int = 1               # per pool
    ttft_p99_target_s: float = 1.0      # DESIGN section 2, interactive class
    itl_p99_target_s: float = 0.100
    down_windows: int = 3               # a pool shrinks only after this many low windows in a row

    def __post_init__(self) -> None:
        problems = []
        if not 0 < self.target_utilization <= 1:
            problems.append(f"target_utilization must be in (0, 1], got {self.target_utilization}")
        if not 0 <= self.band < self.target_utilization:
            problems.append(f"band must be in [0, target_utilization), got {self.band}")
        if not 0 < self.max_step_fraction <= 1:
            problems.append(f"max_step_fraction must be in (0, 1], got {self.max_step_fraction}")
        if not (self.cooldown_s >= 0 and math.isfinite(self.cooldown_s)):
            problems.append(f"cooldown_s must be a finite number >= 0, got {self.cooldown_s}")
        if self.down_windows < 1:
            problems.append(f"down_windows must be >= 1, got {self.down_windows}")
        if self.min_replicas < 1:
            problems.append(f"min_replicas must be >= 1, got {self.min_replicas}")
        if self.budget < self.min_replicas:
            problems.append(f"budget must be >= min_replicas ({self.min_replicas}), got {self.budget}")
        if not (self.ttft_p99_target_s > 0 and self.itl_p99_target_s > 0):
            problems.append("the tail targets must be > 0")
        if problems:
            raise ValueError("rebalance config: " + "; ".join(problems))

    def max_step(self, replicas: int) -> int:
        return max(1, math.floor(self.max_step_fraction * replicas))


@dataclass(frozen=True)
class PoolWindow:
    """What one pool did over one window."""

    replicas: int                       # serving now (a draining or starting worker is not)
    busy_s: float                       # engine busy seconds of its replicas in the window
    window_s: float
    ttft_p99_s: float | None = None     # None: not measured (no requests in the window)
    itl_p99_s: float | None = None

    def __post_init__(self) -> None:
        if self.replicas < 0 or self.busy_s < 0 or not self.window_s > 0:
            raise ValueError(f"pool window: replicas and busy_s must be >= 0 and window_s > 0, "
                             f"got {self.replicas}, {self.busy_s}, {self.window_s}")

    @property
    def demand(self) -> float:
        """Replicas' worth of work per second."""
        return self.busy_s / self.window_s

    @property
    def utilization(self) -> float:
        return self.demand / self.replicas if self.replicas else 0.0


@dataclass(frozen=True)
class Decision:
    pool: str
    current: int
    recommended: int
    reason: Reason
    utilization: float
    demand: float

    @property
    def delta(self) -> int:
        return self.recommended - self.current

    def as_dict(self) -> dict:
        return {"pool": self.pool, "current": self.current, "recommended": self.recommended,
                "reason": self.reason.value, "utilization": round(self.utilization, 4),
                "demand": round(self.demand, 4)}


@dataclass(frozen=True)
class RebalanceState:
    last_change_s: float | None = None  # when a decision last changed a pool (None: never)
    low: tuple[tuple[str, int], ...] = ()   # (pool, windows in a row it wanted fewer)

    def low_windows(self, pool: str) -> int:
        return dict(self.low).get(pool, 0)


@dataclass(frozen=True)
class Outcome:
    decisions: tuple[Decision, ...]
    state: RebalanceState
    at_s: float
    changed: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "changed", any(d.delta for d in self.decisions))

    def recommended(self) -> dict[str, int]:
        return {d.pool: d.recommended for d in self.decisions}


def _tail_breach(pool: str, w: PoolWindow, cfg: RebalanceConfig) -> Reason | None:
    ttft = w.ttft_p99_s is not None and w.ttft_p99_s > cfg.ttft_p99_target_s
    itl = w.itl_p99_s is not None and w.itl_p99_s > cfg.itl_p99_target_s
    if ttft and pool in ("prefill", "mixed"):
        return Reason.TTFT_P99
    if itl and pool in ("decode", "mixed"):
        return Reason.ITL_P99
    return None


def _wanted(pool: str, w: PoolWindow, cfg: RebalanceConfig) -> tuple[int, Reason]:
    """The pool's size before the step limit and the budget, and why."""
    r = w.replicas
    if r == 0:
        return max(cfg.min_replicas, r), Reason.NO_DATA
    at_target = max(cfg.min_replicas, math.ceil(w.demand / cfg.target_utilization - 1e-9))
    breach = _tail_breach(pool, w, cfg)
    if breach is not None:
        return max(r + 1, at_target), breach
    if w.utilization > cfg.target_utilization + cfg.band and at_target > r:
        return at_target, Reason.UTILIZATION_HIGH
    if w.utilization < cfg.target_utilization - cfg.band and at_target < r:
        return at_target, Reason.UTILIZATION_LOW
    return r, Reason.HOLD


def _pressure(reason: Reason, w: PoolWindow) -> tuple[int, float]:
    return (1 if reason in (Reason.TTFT_P99, Reason.ITL_P99) else 0, w.utilization)


def decide(windows: Mapping[str, PoolWindow], cfg: RebalanceConfig, state: RebalanceState,
           now_s: float) -> Outcome:
    """One decision over every pool's window (module docstring)."""
    unknown = set(windows) - set(POOLS)
    if unknown:
        raise ValueError(f"unknown pools {sorted(unknown)}; expected some of {POOLS}")
    pools = sorted(windows)
    current = {p: windows[p].replicas for p in pools}

    def hold(reason_of) -> Outcome:
        return Outcome(tuple(Decision(p, current[p], current[p], reason_of(p),
                                      windows[p].utilization, windows[p].demand) for p in pools),
                       state, now_s)

    if state.last_change_s is not None and now_s - state.last_change_s < cfg.cooldown_s:
        return hold(lambda p: Reason.COOLDOWN)
    total = sum(current.values())
    if total > cfg.budget:
        return _trim(windows, cfg, current, state, now_s)
    wanted = {p: _wanted(p, windows[p], cfg) for p in pools}
    low = {p: state.low_windows(p) + 1 if wanted[p][0] < current[p] else 0 for p in pools}
    rec, reason = {}, {}
    for p in pools:                     # downs first: what they free the ups may take
        n, why = wanted[p]
        step = cfg.max_step(current[p])
        rec[p] = max(n, current[p] - step) if n < current[p] else current[p]
        reason[p] = why
        if rec[p] < current[p] and low[p] < cfg.down_windows:
            rec[p], reason[p] = current[p], Reason.STABILIZING
    ups = sorted((p for p in pools if wanted[p][0] > current[p]),
                 key=lambda p: _pressure(wanted[p][1], windows[p]), reverse=True)
    for p in ups:
        room = cfg.budget - sum(rec.values())
        grant = min(wanted[p][0] - current[p], cfg.max_step(current[p]), max(0, room))
        rec[p] = current[p] + grant
        if grant == 0:
            reason[p] = Reason.BUDGET
    decisions = tuple(Decision(p, current[p], rec[p], reason[p], windows[p].utilization,
                               windows[p].demand) for p in pools)
    if any(d.delta for d in decisions):
        return Outcome(decisions, RebalanceState(now_s), now_s)
    return Outcome(decisions, RebalanceState(state.last_change_s,
                                             tuple((p, n) for p, n in low.items() if n)), now_s)


def _trim(windows: Mapping[str, PoolWindow], cfg: RebalanceConfig, current: dict[str, int],
          state: RebalanceState, now_s: float) -> Outcome:
    """A fleet over the budget: one step down on its least loaded pool that can shrink (a pool
    whose tail breaks its target last)."""
    shrinkable = [p for p in current if current[p] > cfg.min_replicas]
    victim = min(shrinkable, default=None, key=lambda p: (
        _tail_breach(p, windows[p], cfg) is not None, windows[p].utilization))
    decisions = []
    for p in sorted(current):
        n = current[p]
        if p == victim:
            n = max(cfg.min_replicas, current[p] - cfg.max_step(current[p]),
                    current[p] - (sum(current.values()) - cfg.budget))
        decisions.append(Decision(p, current[p], n, Reason.OVER_BUDGET, windows[p].utilization,
                                  windows[p].demand))
    changed = any(d.delta for d in decisions)
    return Outcome(tuple(decisions), RebalanceState(now_s if changed else state.last_change_s),
                   now_s)


def decode_work_s(busy_s: float, steps: int, itl_target_s: float) -> float:
    """A decode pool's busy seconds as load: a decode replica steps whenever one sequence runs,
    so its busy seconds say nothing of how many more it could batch. Each busy second is weighted
    by how much of the ITL target its steps took (mean step / target, at most 1): a replica
    stepping back to back at the ITL target is full, one stepping at a tenth of it is a tenth
    loaded."""
    if busy_s <= 0 or steps <= 0:
        return 0.0
    return busy_s * min(1.0, busy_s / steps / itl_target_s)


def starting_ratio(prefill_demand: float, decode_demand: float, budget: int) -> tuple[int, int]:
    """(prefill, decode) replicas in proportion to measured accelerator-seconds, within `budget`,
    each at least 1 (DESIGN section 8: where a fleet starts before it follows its tail)."""
    if budget < 2:
        raise ValueError(f"a disaggregated fleet needs a budget of at least 2, got {budget}")
    total = prefill_demand + decode_demand
    share = prefill_demand / total if total > 0 else 0.5
    p = min(budget - 1, max(1, round(share * budget)))
    return p, budget - p
