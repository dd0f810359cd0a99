"""Where a setup stops serving more: the knee of goodput against offered load, and the rate
sweep that finds it (docs/evaluation.md).

A sweep measures points (rate scale, goodput, SLO attainment) in rising rate. Going from one
point to the next is a *break* when either

  * the SLO attainment of the next point falls below `attainment` (0.9), or
  * goodput stops growing with load: its relative gain is under `min_growth` (0.5) of the
    offered load's relative gain (doubling the requests sent adds less than half the goodput it
    had). The offered load is the requests a run planned, not the rate scale, so a seeded
    Poisson draw that sent a few more or fewer requests does not look like a knee.

The knee is the point before the first break: the highest load the setup serves within its SLOs
while goodput still follows the offered load. `Sweep` walks rates by doubling from `start` until
`past` points lie beyond the knee (or `max_rate`); when `start` already misses the SLOs (a loaded
machine) it halves instead, down to `min_rate`, until a rate meets them. Then it refines:
`refine` times, it measures the geometric middle between the knee and the point after it, so the
knee is known to within `factor ** (1 / 2 ** refine)` rather than a whole doubling.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

ATTAINMENT = 0.9
MIN_GROWTH = 0.5


class Measured(Protocol):
    rate_scale: float
    offered_rps: float
    goodput_rps: float
    attainment: float


P = TypeVar("P", bound=Measured)


@dataclass(frozen=True)
class Knee(Generic[P]):
    point: P | None          # None: the lowest rate already broke the attainment
    # "attainment" | "goodput flat" | "not reached" | "below at lowest rate"
    reason: str
    beyond: int              # points measured past the knee

    @property
    def found(self) -> bool:
        return self.point is not None and self.beyond > 0


@dataclass(frozen=True)
class KneeRule:
    attainment: float = ATTAINMENT
    min_growth: float = MIN_GROWTH

    def __post_init__(self) -> None:
        if not (0 < self.attainment <= 1 and 0 <= self.min_growth <= 1):
            raise ValueError("attainment must be in (0, 1] and min_growth in [0, 1]")

    def breaks(self, a: Measured, b: Measured) -> str | None:
        """Why going from a to b (b at the higher rate) is a break, or None."""
        if b.attainment < self.attainment:
            return "attainment"
        if a.goodput_rps <= 0 or a.offered_rps <= 0:
            return None if b.goodput_rps > 0 else "goodput flat"
        offered_gain = b.offered_rps / a.offered_rps - 1
        if b.goodput_rps / a.goodput_rps - 1 < self.min_growth * offered_gain:
            return "goodput flat"
        return None


def find_knee(points: list[P], rule: KneeRule = KneeRule()) -> Knee[P]:
    """The knee of `points` (any order; sorted by rate here)."""
    ps = sorted(points, key=lambda p: p.rate_scale)
    if not ps:
        raise ValueError("no points")
    if ps[0].attainment < rule.attainment:
        return Knee(None, "below at lowest rate", len(ps))
    for i, (a, b) in enumerate(zip(ps, ps[1:])):
        why = rule.breaks(a, b)
        if why:
            return Knee(a, why, len(ps) - i - 1)
    return Knee(ps[-1], "not reached", 0)


@dataclass(frozen=True)
class Sweep:
    """How rates are chosen: doubling from `start`, `past` points beyond the knee, then `refine`
    geometric middles between the knee and the next point."""

    start: float = 0.5
    factor: float = 2.0
    max_rate: float = 128.0
    min_rate: float = 1 / 32
    past: int = 2
    refine: int = 2
    rule: KneeRule = KneeRule()

    def __post_init__(self) -> None:
        if not (0 < self.min_rate <= self.start <= self.max_rate and self.factor > 1
                and self.past >= 1 and self.refine >= 0):
            raise ValueError("sweep: 0 < min_rate <= start <= max_rate, factor > 1, past >= 1, "
                             "refine >= 0")

    def run(self, measure: Callable[[float], P]) -> list[P]:
        """Points measured at the rates this sweep picks, sorted by rate."""
        points: list[P] = [measure(self.start)]
        low = self.start
        while (points[-1].attainment < self.rule.attainment
               and low / self.factor >= self.min_rate * (1 - 1e-9)):
            low /= self.factor                   # even the start misses: look lower
            points.append(measure(low))
        rate = self.start * self.factor
        while (find_knee(points, self.rule).beyond < self.past
               and rate <= self.max_rate * (1 + 1e-9)):
            points.append(measure(rate))
            rate *= self.factor
        for _ in range(self.refine):
            mid = self.middle(points)
            if mid is None:
                break
            points.append(measure(mid))
        return sorted(points, key=lambda p: p.rate_scale)

    def middle(self, points: list[P]) -> float | None:
        """The geometric middle between the knee and the point after it (None: no such pair)."""
        knee = find_knee(points, self.rule)
        if knee.point is None or not knee.beyond:
            return None
        after = min((p.rate_scale for p in points if p.rate_scale > knee.point.rate_scale))
        return round(math.sqrt(knee.point.rate_scale * after), 4)


def rates_around(knee_rate: float, multiples: tuple[float, ...]) -> list[float]:
    """Rates at `multiples` of a knee's (the fleet sweeps around the simulator's knee)."""
    if knee_rate <= 0 or not multiples or min(multiples) <= 0:
        raise ValueError("a knee rate and multiples > 0")
    return sorted({round(knee_rate * m, 4) for m in multiples})
