"""The evaluation's fleet parts: real processes (`kvfleet up`, loaded by `kvfleet bench serve`'s
runner over HTTP), one fleet per setup kept up for its whole sweep.

  emulated  the 70B fleet: real gateway, router and workers whose engine cores are simulated and
            paced to the target's step times on the wall clock (`kvfleet up --engine sim
            --sim-model llama-3-70b ...`). Swept at multiples of the discrete-event knee of the
            same setup and workload; the discrete-event run at each of those rates is kept beside
            it, so the difference is the fleet's own overhead on this machine.
  cpu       the real CPU fleet on the tiny model, co-located and disaggregated, swept by doubling
            past its knee.

Both run under whatever else loads this machine: each point records the 1-minute load average
at its start and end.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from loadtests.eval_des import des_point, real_lengths
from loadtests.eval_points import EvalPoint, loadavg_1m, point_of
from loadtests.knee import Sweep, find_knee, rates_around
from loadtests.local_fleet import FleetSetup, local_fleet
from loadtests.runner import RunConfig, run_workload
from loadtests.workload import WorkloadSpec, load_workload
from services.engine.config import SimConfig
from services.planner.simulator import Fleet

CPU_SETUPS = ("colocated", "disagg")


@dataclass(frozen=True)
class EmulatedConfig:
    workload: str = "mixed"
    setup: str = "colocated:2"                    # colocated:N | disagg:P:D
    duration_s: float = 20.0
    # x the discrete-event knee: on a loaded 2-core box the fleet breaks far below it
    multiples: tuple[float, ...] = (0.0625, 0.125, 0.25, 0.5, 1.0)
    des_sweep: Sweep = Sweep(start=1.0, past=1, refine=1)
    sim: SimConfig = SimConfig()
    knee: float | None = None          # the discrete-event knee when known (no sweep then)

    def __post_init__(self) -> None:
        if Fleet.parse(self.setup).mode == "hybrid":
            raise ValueError("the emulated part runs colocated:N or disagg:P:D")
        if self.duration_s <= 0 or (self.knee is not None and self.knee <= 0):
            raise ValueError("duration and knee must be > 0")


@dataclass(frozen=True)
class CpuConfig:
    workload: str = "mixed"
    setups: tuple[str, ...] = CPU_SETUPS
    duration_s: float = 20.0
    model: str = "tiny"
    sweep: Sweep = Sweep(start=0.5, max_rate=16.0, min_rate=1 / 16, past=1, refine=1)

    def __post_init__(self) -> None:
        if not set(self.setups) <= set(CPU_SETUPS) or self.duration_s <= 0:
            raise ValueError(f"cpu setups from {CPU_SETUPS}, duration > 0")


def fleet_point(fleet, spec: WorkloadSpec, rate: float) -> EvalPoint:
    """One load-test run against a running fleet, with the load average around it."""
    s = spec.with_overrides(rate_scale=rate)
    before, started = loadavg_1m(), time.perf_counter()
    run = asyncio.run(run_workload(s, RunConfig(fleet.endpoint, tenant_keys=fleet.tenant_keys)))
    return point_of(run, rate, s.duration_s, wall_s=time.perf_counter() - started,
                    loadavg=(before, loadavg_1m()))


def _target_flags(sim: SimConfig) -> tuple[str, ...]:
    return ("--sim-model", sim.target_model, "--sim-gpu", sim.gpu, "--sim-tp", str(sim.tp),
            "--sim-dtype", sim.dtype, "--sim-network-gbps", f"{sim.network_gbps:g}")


def run_emulated(cfg: EmulatedConfig, progress: Callable[[str], None] = print) -> dict:
    """The discrete-event sweep of the setup (its knee), then the emulated fleet and the
    discrete-event run at `multiples` of that knee."""
    spec = real_lengths(load_workload(cfg.workload).with_overrides(duration_s=cfg.duration_s))
    des, knee = [], cfg.knee
    if knee is None:
        des = cfg.des_sweep.run(lambda r: des_point(spec, cfg.setup, cfg.sim, r))
        found = find_knee(des).point
        if found is None:
            raise RuntimeError(f"{cfg.setup} misses its SLOs at the lowest simulated rate")
        knee = found.rate_scale
    rates = rates_around(knee, cfg.multiples)
    progress(f"emulated {cfg.workload} {cfg.setup}: discrete-event knee x{knee:g}; rates {rates}")
    fleet = Fleet.parse(cfg.setup)
    setup = FleetSetup(mode=fleet.mode, engine="sim", sim_args=_target_flags(cfg.sim),
                       prefill=max(1, fleet.prefill), decode=fleet.decode)
    emulated = []
    with local_fleet(list(spec.tenants), setup) as up:
        for rate in rates:
            emulated.append(fleet_point(up, spec, rate))
            progress(_line("emulated", cfg.setup, emulated[-1]))
    at_rates = [des_point(spec, cfg.setup, cfg.sim, r) for r in rates]
    return {"workload": cfg.workload, "setup": cfg.setup, "des_knee": knee,
            "knee_given": cfg.knee is not None, "des_sweep": des, "des": at_rates,
            "emulated": emulated}


def run_cpu(cfg: CpuConfig, progress: Callable[[str], None] = print) -> dict:
    """{setup: [points]} for the real CPU fleet, one fleet per setup."""
    spec = load_workload(cfg.workload).with_overrides(duration_s=cfg.duration_s)
    out: dict[str, list[EvalPoint]] = {}
    for name in cfg.setups:
        setup = FleetSetup(mode=name, model=cfg.model)
        with local_fleet(list(spec.tenants), setup) as up:
            def measure(rate: float, up=up, name: str = name) -> EvalPoint:
                p = fleet_point(up, spec, rate)
                progress(_line("cpu", name, p))
                return p
            out[name] = cfg.sweep.run(measure)
    return out


def _line(part: str, setup: str, p: EvalPoint) -> str:
    load = f", load {p.loadavg[0]:.1f}-{p.loadavg[1]:.1f}" if p.loadavg else ""
    return (f"{part} {setup} x{p.rate_scale:g}: offered {p.offered_rps:.1f} goodput "
            f"{p.goodput_rps:.1f} req/s, attainment {p.attainment:.0%}, refused {p.rejected}, "
            f"errors {p.errors} ({p.wall_s:.0f} s{load})")

