"""Overload stages S0-S4 (DESIGN.md section 6): entered on signals, left with hysteresis.

    S0 normal            everything admitted as its prediction allows
    S1 no batch          batch traffic waits in the wait queue until its deadline
    S2 cap output        degradable classes get output and context caps (the response says so)
    S3 fallback          degradable classes go to the fallback model pool
    S4 reject            early refusal with Retry-After from the measured drain rate

The machine is pure: `StageMachine.decide(current, since, signals, now)` returns the next stage
and is called by whoever holds the fleet's stage record (services/router/stage_record.py keeps
it in Redis so every router and gateway agrees). Invariants:

  * one step at a time: a decision moves the stage by at most one (S0 -> S2 takes two decisions);
  * a minimum dwell: no change until `min_dwell_s` after the last one (at most one change per
    dwell, so a noisy signal cannot flap the fleet);
  * hysteresis: stage k is entered when ANY signal reaches its `enter[k]` threshold and left
    (down to k - 1) only when EVERY signal is below its `leave[k]` threshold, with
    leave[k] < enter[k]; between the two the stage holds.

Signals are dimensionless pressures so one threshold table serves every class:
  kv_reserved:   decode KV blocks used or reserved / total, fleet-wide (0..1)
  ttft_pressure: predicted TTFT / class target, over recent admissions (a high quantile)
  queue_age:     age of the oldest wait-queue entry / its class target
  error_rate:    failed requests / requests over the last window (0..1)
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

S0, S1, S2, S3, S4 = range(5)
NUM_STAGES = 5
STAGE_NAMES = ("S0_NORMAL", "S1_NO_BATCH", "S2_CAP_OUTPUT", "S3_FALLBACK", "S4_REJECT")


@dataclass(frozen=True, slots=True)
class Signals:
    kv_reserved: float = 0.0
    ttft_pressure: float = 0.0
    queue_age: float = 0.0
    error_rate: float = 0.0

    def over(self, limits: Signals) -> list[str]:
        """The names of the signals at or past their limit in `limits`."""
        return [f.name for f in fields(self) if getattr(self, f.name) >= getattr(limits, f.name)]


def _table(*rows: tuple[float, float, float, float]) -> tuple[Signals, ...]:
    return tuple(Signals(*row) for row in rows)


INF = float("inf")


@dataclass(frozen=True)
class StageConfig:
    """Thresholds per stage, index k = the threshold for stage k (index 0 unused). Defaults:
    S1 as the decode pool fills or chats start to queue; S4 only when the pool is all but full,
    predictions run at twice the targets, or one request in five fails."""

    #        kv_reserved, ttft_pressure, queue_age, error_rate
    enter: tuple[Signals, ...] = field(default_factory=lambda: _table(
        (INF, INF, INF, INF),
        (0.80, 0.8, 0.5, 0.05),
        (0.88, 1.0, 0.8, 0.10),
        (0.94, 1.5, 1.0, 0.15),
        (0.98, 2.0, 1.5, 0.20)))
    leave: tuple[Signals, ...] = field(default_factory=lambda: _table(
        (INF, INF, INF, INF),
        (0.70, 0.6, 0.3, 0.02),
        (0.80, 0.8, 0.5, 0.05),
        (0.88, 1.2, 0.8, 0.10),
        (0.93, 1.6, 1.2, 0.15)))
    min_dwell_s: float = 5.0

    def __post_init__(self) -> None:
        if len(self.enter) != NUM_STAGES or len(self.leave) != NUM_STAGES:
            raise ValueError(f"enter and leave need {NUM_STAGES} rows (S0..S4)")
        for k in range(1, NUM_STAGES):
            for f in fields(Signals):
                up, down = getattr(self.enter[k], f.name), getattr(self.leave[k], f.name)
                if not down < up:
                    raise ValueError(f"S{k} {f.name}: the leave threshold ({down}) must be below "
                                     f"the enter threshold ({up}), or the stage would flap")
        if self.min_dwell_s < 0:
            raise ValueError("min_dwell_s must be >= 0")


@dataclass(frozen=True, slots=True)
class Decision:
    stage: int
    changed: bool
    why: str          # the signals that moved it (or held it), for the log, the span and refusals


class StageMachine:
    def __init__(self, config: StageConfig | None = None) -> None:
        self.config = config or StageConfig()

    def decide(self, current: int, since: float, signals: Signals, now: float) -> Decision:
        """The stage after `current` (held since `since`) under `signals` at `now`."""
        cfg = self.config
        if now - since < cfg.min_dwell_s:
            return Decision(current, False, "dwell")
        if current < S4:
            hot = signals.over(cfg.enter[current + 1])
            if hot:
                return Decision(current + 1, True, "enter: " + ",".join(hot))
        if current > S0:
            held = signals.over(cfg.leave[current])
            if not held:
                return Decision(current - 1, True, "leave: all signals below")
            return Decision(current, False, "hold: " + ",".join(held))
        return Decision(current, False, "normal")


def stage_name(stage: int) -> str:
    return STAGE_NAMES[stage]
