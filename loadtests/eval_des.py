"""The evaluation's discrete-event part: fleets of the same GPUs on the 70B target, each swept
from a low rate past its knee with the router's admission on (services/planner/simulator.py,
sim_admission.py). Every figure here rests on the capacity model's step and transfer times, not
on a measurement on H200s (docs/capacity.md says which constants are calibrated)."""
from __future__ import annotations

import json
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from loadtests.eval_points import EvalPoint, point_of
from loadtests.knee import Sweep
from loadtests.workload import WorkloadSpec, load_workload
from services.engine.config import SimConfig
from services.planner.sim_admission import SimAdmissionConfig, policy_for
from services.planner.simulator import Fleet, SimRunConfig, simulate

SETUPS = ("colocated:4", "disagg:2:2", "hybrid:2:1:1")
WORKLOADS = ("mixed", "azure-conv", "overload-ramp")
CACHED = "cached_from_commit"     # EvalPoint.extra: the sweep was reused from --cache, made there


@dataclass(frozen=True)
class DesConfig:
    workloads: tuple[str, ...] = WORKLOADS
    setups: tuple[str, ...] = SETUPS
    duration_s: float = 10.0
    seed: int = 0
    sim: SimConfig = SimConfig()          # llama-3-70b fp8, TP 4 on H200, KV link 400 Gb/s
    sweep: Sweep = Sweep(past=1)

    def __post_init__(self) -> None:
        if not self.workloads or not self.setups or self.duration_s <= 0:
            raise ValueError("give workloads, setups and a duration > 0")
        widths = {len(Fleet.parse(s).roles()) for s in self.setups}
        if len(widths) != 1:
            raise ValueError(f"setups {self.setups} differ in worker count: compare equal GPUs")


def real_lengths(spec: WorkloadSpec) -> WorkloadSpec:
    """The workload at its real prompt and output lengths (the shipped specs shrink them for a
    2-core CPU; a 70B on H200s serves the real mix)."""
    return replace(spec, scale=replace(spec.scale, prompt=1.0, output=1.0))


def des_point(spec: WorkloadSpec, setup: str, sim: SimConfig, rate: float) -> EvalPoint:
    """One simulated run at `rate` x the spec's arrival rates, the router's admission on."""
    s = spec.with_overrides(rate_scale=rate)
    gate = SimAdmissionConfig(policy=policy_for(s, sim.network_gbps))
    started = time.perf_counter()
    out = simulate(s, SimRunConfig(fleet=Fleet.parse(setup), sim=sim, admission=gate))
    return point_of(out.run, rate, s.duration_s, router_refusals=out.admission[
        "rejections_by_stage"], wall_s=time.perf_counter() - started)


def sweep_one(cfg: DesConfig, workload: str, setup: str) -> list[EvalPoint]:
    """One setup's sweep on one workload (a whole process's work with --jobs)."""
    spec = real_lengths(load_workload(workload).with_overrides(seed=cfg.seed,
                                                               duration_s=cfg.duration_s))

    def measure(rate: float) -> EvalPoint:
        p = des_point(spec, setup, cfg.sim, rate)
        print(f"des {workload} {setup} x{rate:g}: offered {p.offered_rps:.1f} goodput "
              f"{p.goodput_rps:.1f} req/s, attainment {p.attainment:.0%}, refused "
              f"{p.rejected} ({p.wall_s:.0f} s)", flush=True)
        return p
    return cfg.sweep.run(measure)


def cached_sweep(cfg: DesConfig, workload: str, setup: str, cache: Path | None) -> list[EvalPoint]:
    """sweep_one, kept in `cache` (one JSON per workload and setup, with the config that made
    it): a rerun with the same config takes it from there instead of sweeping again."""
    path = cache / f"{workload}--{setup.replace(':', '-')}.json" if cache else None
    key = json.loads(json.dumps(asdict(cfg), default=str))
    if path is not None and path.is_file():
        saved = json.loads(path.read_text())
        if saved["config"] == key:       # each point says the commit its sweep was made at
            made = saved.get("commit", "unknown")
            return [replace(EvalPoint.from_dict(p), extra={**p.get("extra", {}), CACHED: made})
                    for p in saved["points"]]
    points = sweep_one(cfg, workload, setup)
    if path is not None:
        from loadtests.evaluation import commit  # noqa: PLC0415 - the entry point's helper
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"config": key, "commit": commit(),
                                    "points": [p.to_dict() for p in points]}))
    return points


def run_des(cfg: DesConfig, jobs: int = 1, cache: Path | None = None) -> dict:
    """{workload: {setup: [points]}}; `jobs` sweeps run at once in processes of their own (each
    sweep is seeded and alone on its virtual clock: the same figures with any `jobs`)."""
    pairs = [(w, s) for w in cfg.workloads for s in cfg.setups]
    n = len(pairs)
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            swept = list(pool.map(cached_sweep, [cfg] * n, *zip(*pairs), [cache] * n))
    else:
        swept = [cached_sweep(cfg, w, s, cache) for w, s in pairs]
    results: dict[str, dict[str, list[EvalPoint]]] = {w: {} for w in cfg.workloads}
    for (w, s), points in zip(pairs, swept):
        results[w][s] = points
    return results


def gpus(setup: str, tp: int) -> int:
    return len(Fleet.parse(setup).roles()) * tp
