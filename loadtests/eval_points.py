"""One measured point of an evaluation sweep (docs/evaluation.md): what a run at one rate scale
gave, read from its records and summary. The same shape for the discrete-event simulator, the
emulated 70B fleet and the real CPU fleet, so one report renders all three.

  goodput       requests that met their class's TTFT and ITL targets, per second of the planned
                duration (the window they arrived in); `goodput_run_rps` divides by the run's
                whole length instead (arrivals and the drain: `kvfleet bench serve`'s goodput),
                which the drain of the last long documents lowers at every rate alike
  attainment    met / requests (refused requests count as missed)
  refusals      refused requests by the overload stage the router named; "engine" for refusals
                no router stage names (an engine's late refusal: its prediction was met at
                admission, the engine's queue then broke it), as the simulator tells them apart
  transfer      the KV hand-off of the requests that moved KV (first token -> the decode worker
                starts): count, mean, p99, and its share of the time those requests took
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from loadtests.metrics import percentile, summarize
from loadtests.records import RunResult

CLASSES = ("interactive", "document", "batch")


@dataclass(frozen=True)
class ClassPoint:
    requests: int
    met: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None


@dataclass(frozen=True)
class Transfer:
    moved: int                     # requests whose KV moved
    mean_s: float | None
    p99_s: float | None
    share: float | None            # transfer seconds / e2e seconds of those requests


@dataclass(frozen=True)
class EvalPoint:
    rate_scale: float
    offered_rps: float             # planned requests / planned duration
    requests: int
    goodput_rps: float             # met / planned duration
    goodput_run_rps: float         # met / the run's whole length (the summary's goodput)
    attainment: float
    rejected: int
    errors: int
    refusals: dict[str, int]
    classes: dict[str, ClassPoint]
    transfer: Transfer
    errors_by_reason: dict[str, int] = field(default_factory=dict)   # refusals' and failures'
    loadavg: tuple[float, float] | None = None   # 1-minute load average at start and end (fleets)
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EvalPoint":
        d = dict(d)
        d["classes"] = {k: ClassPoint(**v) for k, v in d["classes"].items()}
        d["transfer"] = Transfer(**d["transfer"])
        d["loadavg"] = tuple(d["loadavg"]) if d.get("loadavg") else None
        return cls(**d)


def point_of(run: RunResult, rate_scale: float, planned_s: float,
             router_refusals: dict[str, int] | None = None, wall_s: float = 0.0,
             loadavg: tuple[float, float] | None = None) -> EvalPoint:
    """The point of one run. `router_refusals`: the simulator's refusals by stage (its records
    name no stage); the rest of its refusals are the engines'. Without it, the records' stages."""
    s = summarize(run)
    o = s["overall"]
    refusals = dict(s["rejections_by_stage"])
    if router_refusals is not None:
        refusals = {k: v for k, v in router_refusals.items() if v}
        late = o["rejected"] - sum(refusals.values())
        if late > 0:
            refusals["engine"] = late
    return EvalPoint(rate_scale=rate_scale, offered_rps=o["requests"] / planned_s,
                     requests=o["requests"], goodput_rps=o["met"] / planned_s,
                     goodput_run_rps=o["goodput_rps"],
                     attainment=o["met"] / max(1, o["requests"]), rejected=o["rejected"],
                     errors=o["errors"], refusals=refusals,
                     classes={name: _class_point(c) for name, c in s["classes"].items()
                              if c["requests"]},
                     transfer=transfer_of(run), errors_by_reason=s["errors_by_reason"],
                     loadavg=loadavg, wall_s=wall_s)


def _class_point(c: dict) -> ClassPoint:
    return ClassPoint(c["requests"], c["met"], c["ttft_s"]["p50"], c["ttft_s"]["p99"],
                      c["itl_s"]["p50"], c["itl_s"]["p99"])


def transfer_of(run: RunResult) -> Transfer:
    moved = [r for r in run.records
             if r.ok and r.timing and r.e2e_s and r.timing.get("transfer_s", 0.0) > 0]
    times = [float(r.timing["transfer_s"]) for r in moved]
    if not moved:
        return Transfer(0, None, None, None)
    return Transfer(len(moved), sum(times) / len(times), percentile(times, 99),
                    sum(times) / sum(r.e2e_s for r in moved))


def loadavg_1m() -> float:
    return os.getloadavg()[0]
