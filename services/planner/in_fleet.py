"""`kvfleet sim calibrate --in-fleet`: a step profile and the fleet's overhead measured inside a
running fleet under load (services/planner/overhead.py says why and what each part is).

A real fleet (`kvfleet up` through loadtests/local_fleet.py, its engine cores tracing every step:
services/worker/step_trace.py) serves a seeded workload with the load tester; then

  * the trace's steps are fitted as an in-process calibration's are (services/planner/profile.py).
    A step's cost is the time from its start to the next step's start when the core went straight
    on (the step, sending its outputs, the commands that came meanwhile); the last step before
    the core idled costs its own time plus the median of those in-between times;
  * the path: each request's TTFT in the fleet less its TTFT in the discrete-event simulation
    of the same seeded workload with that profile (`fit_overhead` with a baseline): what the
    fleet added beyond its engine's steps, the gateway's and router's queues included.
"""
from __future__ import annotations

import asyncio
import json
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from loadtests.records import RunResult
from loadtests.workload import WorkloadSpec
from services.planner.calibrate import machine_facts
from services.planner.overhead import FleetOverhead, fit_overhead
from services.planner.profile import ProfileError, StepProfile, fit_profile
from services.planner.step_time import BatchShape
from services.protocol import env

MIN_STEPS = 20


@dataclass(frozen=True)
class TracedStep:
    shape: BatchShape
    started: float
    duration_s: float
    busy_after: bool


def read_trace(folder: str | Path) -> list[list[TracedStep]]:
    """Every engine core's traced steps (one list per core, in order)."""
    cores = []
    for path in sorted(Path(folder).glob("steps-*.jsonl")):
        steps = []
        for line in path.read_text().splitlines():
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue                    # a core killed mid-line
            steps.append(TracedStep(_shape(d), float(d["t0"]), float(d["dur"]), bool(d["busy_after"])))
        cores.append(steps)
    return cores


def _shape(d: dict) -> BatchShape:
    """A shape with the traced totals (the profile's features are sums, so one chunk carrying all
    prefill tokens and pairs and one context per decode give the same features)."""
    chunks = ()
    if d["prefill_seqs"]:
        # prefill_seqs chunks; the first carries the tokens, the pairs come from its start
        n, pairs, seqs = d["prefill_tokens"], d["prefill_attention_pairs"], d["prefill_seqs"]
        start = max(0, round((pairs - n * (n + 1) / 2) / n)) if n else 0
        chunks = ((n, start),) + ((0, 0),) * (seqs - 1)
    decodes = d["decodes"]
    ctx = d["decode_context_tokens"]
    contexts = ((ctx // decodes,) * (decodes - 1) + (ctx - (ctx // decodes) * (decodes - 1),)
                if decodes else ())
    return BatchShape(prefill_chunks=chunks, decode_contexts=contexts)


def step_costs(cores: list[list[TracedStep]]) -> list[tuple[BatchShape, float]]:
    """(shape, seconds the core spent on it) per traced step."""
    samples = []
    for steps in cores:
        between = [b.started - a.started - a.duration_s for a, b in zip(steps, steps[1:])
                   if a.busy_after]
        extra = float(np.median(between)) if between else 0.0
        for a, b in zip(steps, steps[1:] + [None]):
            cost = b.started - a.started if (b is not None and a.busy_after) else a.duration_s + extra
            samples.append((a.shape, cost))
    return samples


def fit_in_fleet(samples: list[tuple[BatchShape, float]], **meta) -> StepProfile:
    """The profile's fit by absolute error over every step, spikes included (under load a
    relative fit runs short: a step stretched by a neighbour counts as little as a typical one,
    and the simulated queues grow with the total busy time), then every coefficient scaled so
    that the fitted steps add up to the time the core spent on them (a term dropped as negative
    leaves the rest a little short)."""
    fitted = fit_profile(samples, relative=False, **meta)
    predicted = sum(fitted.step_s(b) for b, _ in samples)
    scale = sum(s for _, s in samples) / predicted if predicted > 0 else 1.0
    return replace(fitted, coefficients={k: v * scale for k, v in fitted.coefficients.items()},
                   notes=f"{fitted.notes}; coefficients x{scale:.3f} to the measured total")


@dataclass(frozen=True)
class InFleetResult:
    profile: StepProfile
    overhead: FleetOverhead
    run: RunResult
    loadavg_1m: float


def calibrate_in_fleet(spec: WorkloadSpec, model: str = "tiny", threads: int = 1) -> InFleetResult:
    """Run `spec` through a real co-located fleet of one worker (the load tester's own) with its
    engine core tracing; fit the steps and the path."""
    from loadtests.local_fleet import FleetSetup, local_fleet  # noqa: PLC0415
    from loadtests.runner import RunConfig, run_workload  # noqa: PLC0415
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kvfleet-steps-") as trace:
        setup = FleetSetup(mode="colocated", model=model, env={env.STEP_TRACE.name: trace})
        with local_fleet(list(spec.tenants), setup) as fleet:
            run = asyncio.run(run_workload(spec, RunConfig(fleet.endpoint,
                                                           tenant_keys=fleet.tenant_keys)))
        cores = read_trace(trace)
    samples = step_costs(cores)
    if len(samples) < MIN_STEPS:
        raise ProfileError(f"the fleet ran {len(samples)} traced steps; need at least {MIN_STEPS} "
                           f"(a longer --duration or a higher --rate-scale)")
    source = (f"in-fleet: {spec.name} at rate x{spec.scale.rate:g} for {spec.duration_s:g} s, "
              f"load average {load:.1f}")
    profile = fit_in_fleet(samples, model=model, threads=threads, machine=machine_facts(),
                           notes=f"{source}, {len(samples)} steps")
    run.meta["loadavg_1m"] = load
    des = simulated(spec, profile)
    return InFleetResult(profile, fit_overhead([run], source=source, baseline=des), run, load)


def simulated(spec: WorkloadSpec, profile: StepProfile) -> RunResult:
    """The spec through the discrete-event simulation of the load tester's fleet (one mixed
    worker, its default KV) with this profile and no overhead."""
    from services.engine.config import SimConfig  # noqa: PLC0415
    from services.planner.simulator import Fleet, SimRunConfig, simulate  # noqa: PLC0415
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "profile.json")
        profile.save(path)
        return simulate(spec, SimRunConfig(fleet=Fleet.parse("colocated:1"),
                                           sim=SimConfig(profile=path))).run


def with_overhead_of(result: InFleetResult) -> dict:
    """What `kvfleet sim calibrate --in-fleet` prints: the fit and the path."""
    fit, o = result.profile.fit, result.overhead
    return {"steps": fit.samples, "r2": fit.r2, "mean_abs_rel_error": fit.mean_abs_rel_error,
            "path_mean_ms": o.path_mean_s * 1e3, "path_p50_ms": o.path_s(0.5) * 1e3,
            "path_p95_ms": o.path_s(0.95) * 1e3, "requests": o.samples,
            "loadavg_1m": result.loadavg_1m}

