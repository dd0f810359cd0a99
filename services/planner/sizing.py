"""`kvfleet capacity --workload FILE --rate R`: the GPUs a traffic mix needs at its SLOs.

Two steps, per fleet mode (co-located, disaggregated, hybrid):

  estimate: the offered prefill and decode replica-seconds per second (offered_load.py) at the
            target utilization: co-located N = ceil((prefill + decode) / util); disaggregated
            P = ceil(prefill / util), D = ceil(decode / util); hybrid the same total, at least 3;
  check:    the simulator runs the mix at rate R on a fleet of n replicas and reads its SLO
            attainment: the worst class's share of requests that met the class's TTFT and ITL
            targets (classes without a target, batch, count not). Starting at the
            estimate, the search walks down while the fleet still meets `attainment` and up until
            one does; the answer is the smallest n met. At most `max_replicas` per mode.

A fleet of n replicas of one mode is fixed by n (`fleet_of`): disaggregated splits n by the offered
prefill share of the work, hybrid gives half to mixed workers and splits the rest evenly, as the
study's hybrid (services/planner/study.py); for a disaggregated n the search also tries one
prefill replica fewer and one more (`candidates`). GPUs are replicas x TP.

R is requests per second: the spec's arrival rates are scaled by R over the spec's own planned
rate (its requests over its duration), so the mix of classes and tenants is the spec's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from loadtests.metrics import summarize
from loadtests.workload import WorkloadSpec, plan_requests, slo_table
from services.engine.config import SimConfig
from services.planner.capacity import CostModel
from services.planner.offered_load import OfferedLoad, offered_load_of

MODES = ("colocated", "disagg", "hybrid")
MIN_REPLICAS = {"colocated": 1, "disagg": 2, "hybrid": 3}


@dataclass(frozen=True)
class SizingConfig:
    rate_rps: float                    # requests per second to serve
    attainment: float = 0.9            # SLO attainment a fleet must reach
    max_replicas: int = 32             # per mode: the search gives up above this
    tp: int = 4                        # GPUs per replica

    def __post_init__(self) -> None:
        if not self.rate_rps > 0 or math.isinf(self.rate_rps):
            raise ValueError(f"--rate must be a finite number of requests/s > 0, "
                             f"got {self.rate_rps}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.attainment}")
        if self.max_replicas < 3:
            raise ValueError(f"--max-replicas must be >= 3, got {self.max_replicas}")


@dataclass(frozen=True)
class Sized:
    mode: str
    estimate: str                       # the fleet the offered load alone gives
    fleet: str | None                   # the smallest that met the attainment (None: none did)
    replicas: int | None
    gpus: int | None
    attainment: float | None            # the chosen fleet's
    tried: dict[str, float] = field(default_factory=dict)   # fleet -> attainment, in search order


def rate_scale_for(spec: WorkloadSpec, rate_rps: float) -> float:
    """The scale of the spec's arrival rates that offers `rate_rps` requests per second."""
    base = spec.with_overrides(rate_scale=1.0)
    planned = len(plan_requests(base)) / base.duration_s
    if planned <= 0:
        raise ValueError(f"workload {spec.name!r} plans no requests in {spec.duration_s:g} s")
    return rate_rps / planned


def fleet_of(mode: str, n: int, prefill_share: float) -> str:
    """The fleet of `n` replicas of `mode`; `prefill_share` is prefill's part of the work."""
    if mode == "colocated":
        return f"colocated:{n}"
    if mode == "disagg":
        p = min(n - 1, max(1, round(n * prefill_share)))
        return f"disagg:{p}:{n - p}"
    mixed = n // 2
    p = max(1, (n - mixed) // 2)
    return f"hybrid:{mixed}:{p}:{n - mixed - p}"


def candidates(mode: str, n: int, prefill_share: float) -> list[str]:
    """The fleets of `n` replicas the search tries, best guess first: a disaggregated fleet's
    split by the prefill share, then one prefill replica fewer and one more."""
    first = fleet_of(mode, n, prefill_share)
    if mode != "disagg":
        return [first]
    p = int(first.split(":")[1])
    return [first] + [f"disagg:{q}:{n - q}" for q in (p - 1, p + 1) if 1 <= q <= n - 1]


def estimate(load: OfferedLoad, util: float) -> dict[str, int]:
    """Replicas per mode from the offered accelerator-seconds alone."""
    pre = max(1, math.ceil(load.prefill_replica_s_per_s / util))
    dec = max(1, math.ceil(load.decode_replica_s_per_s / util))
    both = load.prefill_replica_s_per_s + load.decode_replica_s_per_s
    together = max(1, math.ceil(both / util))
    return {"colocated": together, "disagg": pre + dec, "hybrid": max(3, pre + dec)}


def size(spec: WorkloadSpec, model: CostModel, sim: SimConfig, cfg: SizingConfig,
         progress=None) -> dict:
    """The offered load at the rate and, per mode, the smallest fleet that met the attainment."""
    scaled = spec.with_overrides(rate_scale=rate_scale_for(spec, cfg.rate_rps))
    load = offered_load_of(model, scaled)
    share = load.prefill_replica_s_per_s / (load.prefill_replica_s_per_s
                                            + load.decode_replica_s_per_s)
    first = estimate(load, model.constants.target_utilization)
    attained = _attainment_of(scaled, sim, progress)
    out = [search(mode, first[mode], share, cfg, attained) for mode in MODES]
    return {"rate_rps": cfg.rate_rps, "rate_scale": scaled.scale.rate, "load": load,
            "prefill_share": share, "modes": out}


def search(mode: str, start: int, share: float, cfg: SizingConfig, attained) -> Sized:
    """The smallest n whose fleet met the attainment, walking from `start` (see the module)."""
    lo = MIN_REPLICAS[mode]
    n = min(max(start, lo), cfg.max_replicas)
    tried: dict[str, float] = {}
    met: dict[int, str] = {}

    def meets(k: int) -> bool:
        for f in candidates(mode, k, share):
            if f not in tried:
                tried[f] = attained(f)
            if tried[f] >= cfg.attainment:
                met[k] = f
                return True
        return False

    if meets(n):
        while n > lo and meets(n - 1):
            n -= 1
    else:
        while n < cfg.max_replicas and not meets(n + 1):
            n += 1
        n += 1
        if n > cfg.max_replicas:
            return Sized(mode, fleet_of(mode, start, share), None, None, None, None, tried)
    best = met[n]
    return Sized(mode, fleet_of(mode, max(start, lo), share), best, n, n * cfg.tp, tried[best],
                 tried)


def _attainment_of(spec: WorkloadSpec, sim: SimConfig, progress):
    from services.planner.simulator import Fleet, SimRunConfig, simulate  # noqa: PLC0415

    def attained(fleet: str) -> float:
        run = simulate(spec, SimRunConfig(fleet=Fleet.parse(fleet), sim=sim)).run
        a = class_attainment(summarize(run), slo_table(spec))
        if progress:
            progress(fleet, a)
        return a
    return attained


def class_attainment(summary: dict, slos: dict) -> float:
    """The worst SLO attainment of the classes that have a target (a class without one, batch,
    counts not): a fleet serves the mix only if every such class is served, not 90% of requests
    that chats dominate. No such class: the overall attainment."""
    worst = [c["attainment"]["slo"] for name, c in summary["classes"].items()
             if c["requests"] and name in slos
             and (slos[name].ttft_s is not None or slos[name].itl_s is not None)]
    if worst:
        return min(worst)
    overall = summary["overall"]
    return overall["met"] / max(1, overall["requests"])
