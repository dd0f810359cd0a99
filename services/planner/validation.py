"""The simulator against the real fleet on this machine: the same seeded workload through
`kvfleet up` (co-located, the tiny model, the load tester's own fleet: loadtests/local_fleet.py)
and through `kvfleet sim run` with a profile and the fleet's overhead measured here, and the
relative errors of the simulated TTFT and ITL (mean and p99 over every ok request, all classes).

`kvfleet sim validate [--profile FILE --overhead FILE] [--workloads chat-only,mixed]
[--rates 0.5,1] [--duration S] [--out DIR]` prints the table docs/capacity.md ("Validation")
shows and writes each run's reports under DIR. Without --profile it first calibrates in a fleet
(`kvfleet sim calibrate --in-fleet`: services/planner/in_fleet.py) on its own workload.

Each real run's engine core traces its steps; a second simulation per run ("replay") uses a
profile and overhead fitted on that run itself. The replay says what the model can do with the
step times of that very minute; the prediction (the calibration's profile) adds the drift of a
shared machine's load between the calibration and the run.

The replay takes from the real run what the simulated fleet cannot know, and nothing it is meant
to reproduce (`replay_run`):

  * the moments: each request arrives when the load generator really sent it (its lateness on a
    loaded box is the real run's, and its TTFT counts from its real send, as the client's does);
    a request the real fleet refused before any token is not sent at all;
  * the box's contention at each moment (`Contention`): a simulated step starting at t lasts the
    profile's time for its own shape times the ratio of the real steps' measured to fitted
    cost around t. One profile fitted over a loaded minute gives every step the minute's mean
    slowdown, while the real steps were slow in bursts (another process took the core), and the
    requests that arrived in a burst waited far longer than the mean slowdown says;

and compares like with like (`guard_latencies`): requests both sides served, the mean TTFT, and
the mean gap per token (a client's gap that carries two tokens, the gateway having sent them in
one event, counts as two gaps of half its length: the simulated client sees one event a token).
The shapes, the queueing, the scheduler's chunking, the block pool and the delivery are the
simulator's own.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from loadtests.metrics import latency_stats
from loadtests.records import RunResult
from loadtests.workload import WorkloadSpec, load_workload
from services.engine.config import EngineConfig, SimConfig
from services.planner.overhead import FleetOverhead, fit_overhead
from services.planner.profile import ProfileError, StepProfile
from services.planner.simulator import (
    Fleet, SimRunConfig, Simulation, served_kv_tokens, simulate, timing_of)
from services.planner.step_time import BatchShape, StepTimer

CONTENTION_WINDOW_S = 0.25   # the real steps a simulated step's slowdown is read from: +-half


@dataclass(frozen=True)
class Comparison:
    workload: str
    rate: float
    requests: int
    real: dict           # {"ttft_s": {mean p99 ...}, "itl_s": {...}}
    sim: dict
    real_ok: int
    sim_ok: int
    loadavg_1m: float    # at the end of the real run
    replay: dict | None = None   # the simulation with the run's own steps and path

    def error(self, metric: str, stat: str, of: str = "sim") -> float | None:
        """(sim - real) / real; of="replay": the replay's."""
        other = self.sim if of == "sim" else self.replay
        if other is None:
            return None
        r, s = self.real[metric][stat], other[metric][stat]
        return None if r in (None, 0) or s is None else (s - r) / r


def latencies(run: RunResult) -> dict:
    ok = [r for r in run.records if r.ok]
    return {"ttft_s": latency_stats([r.ttft_s for r in ok]),
            "itl_s": latency_stats([g for r in ok for g in r.itl_s])}


def guard_latencies(run: RunResult, indices: set[int]) -> dict[str, float]:
    """The requests `indices` of the run (ok ones): the mean TTFT, and the mean gap per token
    (the gaps' sum over the token intervals: a gap carrying k tokens counts k times)."""
    ok = [r for r in run.records if r.ok and r.index in indices]
    intervals = sum(max(0, r.output_tokens - 1) for r in ok)
    return {"ttft_s": float(np.mean([r.ttft_s for r in ok])) if ok else float("nan"),
            "itl_s": sum(sum(r.itl_s) for r in ok) / intervals if intervals else float("nan")}


def guard_errors(real: RunResult, sim: RunResult) -> dict[str, tuple[float, float, float]]:
    """Per metric of `guard_latencies` over the requests both runs served:
    (real, simulated, (simulated - real) / real)."""
    both = {r.index for r in real.records if r.ok} & {r.index for r in sim.records if r.ok}
    want, got = guard_latencies(real, both), guard_latencies(sim, both)
    return {m: (want[m], got[m], (got[m] - want[m]) / want[m]) for m in want}


@dataclass(frozen=True)
class Contention:
    """How much slower than the profile the real steps ran, moment by moment: per real step (in
    start order) its start on the load generator's clock (the zero its sends count from), its
    measured cost and the profile's time for its shape."""

    starts_s: tuple[float, ...]
    measured_s: tuple[float, ...]
    fitted_s: tuple[float, ...]
    window_s: float = CONTENTION_WINDOW_S

    def __post_init__(self) -> None:
        # the arrays factor() reads: the starts, and both costs' running sums (0 first)
        object.__setattr__(self, "_starts", np.asarray(self.starts_s, dtype=float))
        for name, costs in (("_measured", self.measured_s), ("_fitted", self.fitted_s)):
            object.__setattr__(self, name, np.concatenate(([0.0], np.cumsum(costs))))

    def factor(self, t: float) -> float:
        """Measured over fitted, summed over the real steps started within window_s/2 of t (none
        there: the nearest one's)."""
        starts = self._starts
        i0, i1 = (int(i) for i in np.searchsorted(starts, (t - self.window_s / 2,
                                                            t + self.window_s / 2)))
        if i1 <= i0:
            j = int(np.searchsorted(starts, t))
            if j == len(starts) or (j > 0 and t - starts[j - 1] < starts[j] - t):
                j -= 1
            i0, i1 = j, j + 1
        fitted = self._fitted[i1] - self._fitted[i0]
        return (self._measured[i1] - self._measured[i0]) / fitted if fitted > 0 else 1.0


class ContendedSteps:
    """A StepTimer: the profile's time for the batch times the real run's contention at the
    simulated moment. `clock` is the simulation's (set once it exists: its engines are made with
    this timer)."""

    def __init__(self, timer: StepTimer, contention: Contention) -> None:
        self.timer, self.contention = timer, contention
        self.clock = lambda: 0.0

    def step_s(self, batch: BatchShape) -> float:
        base = self.timer.step_s(batch)
        return base if batch.is_empty else base * self.contention.factor(self.clock())


@dataclass(frozen=True)
class RealRun:
    run: RunResult
    replay: tuple[StepProfile, FleetOverhead] | None   # fitted on the run itself
    contention: Contention | None = None               # the run's own steps against that fit


def real_runs(specs: list[WorkloadSpec], keep_trace: Path | None = None) -> list[RealRun]:
    """The specs (one workload's tenants) one after the other through one real fleet, its engine
    core tracing its steps (copied to `keep_trace`); each run with the load average at its end
    and its own fit."""
    from loadtests.local_fleet import FleetSetup, local_fleet  # noqa: PLC0415
    from loadtests.runner import RunConfig, run_workload  # noqa: PLC0415
    from services.planner.in_fleet import read_trace  # noqa: PLC0415
    from services.protocol import env  # noqa: PLC0415
    out = []
    with tempfile.TemporaryDirectory(prefix="kvfleet-steps-") as trace:
        setup = FleetSetup(mode="colocated", env={env.STEP_TRACE.name: trace})
        with local_fleet(list(specs[0].tenants), setup) as fleet:
            cfg = RunConfig(fleet.endpoint, tenant_keys=fleet.tenant_keys)
            windows = []
            for spec in specs:
                t0 = time.monotonic()
                run = asyncio.run(run_workload(spec, cfg))
                windows.append((t0, time.monotonic()))
                run.meta["loadavg_1m"] = os.getloadavg()[0]
                run.meta["trace_window"] = list(windows[-1])   # the host's monotonic clock
                out.append(run)
        cores = read_trace(trace)
        if keep_trace is not None:
            shutil.copytree(trace, keep_trace, dirs_exist_ok=True)
    return [_replay_fit(run, cores, window) for run, window in zip(out, windows)]


def _saved_real(run: RunResult, steps: Path) -> RealRun:
    """A real run saved by an earlier call, refitted from its saved step trace when there is one."""
    from services.planner.in_fleet import read_trace  # noqa: PLC0415
    window = run.meta.get("trace_window")
    if not window or not steps.is_dir():
        return RealRun(run, None)
    return _replay_fit(run, read_trace(steps), tuple(window))


def _replay_fit(run: RunResult, cores, window) -> RealRun:
    from services.planner.in_fleet import fit_in_fleet, step_costs  # noqa: PLC0415
    t0, t1 = window
    inside = [[s for s in steps if t0 <= s.started <= t1] for steps in cores]
    samples = step_costs(inside)
    try:
        profile = fit_in_fleet(samples, notes="replay: the run's own steps")
        overhead = fit_overhead([run], source="replay: the run's own path")
    except (ProfileError, ValueError):
        return RealRun(run, None)
    starts = [s.started for steps in inside for s in steps]   # step_costs' order
    order = np.argsort(starts, kind="stable")
    zero = _generator_zero(run, min(starts))
    return RealRun(run, (profile, overhead), Contention(
        starts_s=tuple(float(starts[i] - zero) for i in order),
        measured_s=tuple(float(samples[i][1]) for i in order),
        fitted_s=tuple(float(profile.step_s(samples[i][0])) for i in order)))


def _generator_zero(run: RunResult, first_step: float) -> float:
    """The load generator's zero on the trace's clock, estimated: its first request reached the
    idle engine (the first traced step's start) after its send and the way in, taken as half
    the median of the requests' path (client TTFT less the server's queue and prefill: the way
    in and the first token's way out). A few ms off, well inside CONTENTION_WINDOW_S."""
    from services.planner.overhead import path_samples  # noqa: PLC0415
    paths = path_samples(run)
    way_in = float(np.median(paths)) / 2 if paths else 0.0
    first_send = min(r.send_s for r in run.records if r.send_s is not None)
    return first_step - first_send - way_in


def sim_run(spec: WorkloadSpec, profile: str | StepProfile,
            overhead: FleetOverhead | None = None) -> RunResult:
    # the load tester's fleet: one mixed worker, kvfleet up's 256 MiB of KV (local_fleet.py)
    if isinstance(profile, StepProfile):
        with tempfile.TemporaryDirectory() as d:
            profile.save(Path(d) / "profile.json")
            return sim_run(spec, str(Path(d) / "profile.json"), overhead)
    return simulate(spec, SimRunConfig(fleet=Fleet.parse("colocated:1"),
                                       sim=SimConfig(profile=profile), overhead=overhead)).run


def replay_run(spec: WorkloadSpec, real: RealRun,
               engine: EngineConfig | None = None) -> RunResult:
    """The real run again in the simulator (module docstring): the run's own profile, path and
    contention, its requests at their real send times, those it refused before a token left
    out. `engine`: the simulated workers' scheduler and KV settings (default: the workers')."""
    if real.replay is None:
        raise ValueError("the real run has no fit to replay (too few traced steps)")
    profile, overhead = real.replay
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "profile.json")
        profile.save(path)
        cfg = SimRunConfig(fleet=Fleet.parse("colocated:1"), sim=SimConfig(profile=path),
                           engine=engine or EngineConfig(), overhead=overhead)
        timer, transfer_s = timing_of(cfg)
        contended = ContendedSteps(timer, real.contention) if real.contention else None
        timer, transfer_s = overhead.applied(contended or timer, transfer_s)
        cfg = replace(cfg, sim=replace(cfg.sim, kv_tokens=served_kv_tokens(cfg)))
        sim = Simulation(spec, cfg, timer, transfer_s)
        if contended is not None:
            contended.clock = sim.clock
        sent = {r.index: r.send_s for r in real.run.records
                if r.send_s is not None and r.ttft_s is not None}
        sim.planned = [replace(p, at_s=sent[p.index]) for p in sim.planned if p.index in sent]
        return sim.run()


def compare(workload: str, rates: list[float], duration_s: float, profile: str,
            out: Path | None = None, reuse_real: bool = False,
            overhead: FleetOverhead | None = None) -> list[Comparison]:
    """One workload at each rate, through one real fleet and through the simulator.
    `reuse_real`: the real runs saved under `out` by an earlier call, when all are there (a new
    profile is then checked against the same real runs, the replay refitted from their saved
    step traces)."""
    base = load_workload(workload)
    specs = [base.with_overrides(duration_s=duration_s, rate_scale=r) for r in rates]
    saved = [out / f"{workload}-{r:g}" / "real" / "run.json" for r in rates] if out else []
    if reuse_real and saved and all(p.is_file() for p in saved):
        reals = [_saved_real(RunResult.load(p), out / f"{workload}-steps") for p in saved]
    else:
        reals = real_runs(specs, out / f"{workload}-steps" if out else None)
    rows = []
    for rate, spec, real in zip(rates, specs, reals):
        sim = sim_run(spec, profile, overhead)
        replay = replay_run(spec, real) if real.replay else None
        if out is not None:
            from loadtests.report import write_report  # noqa: PLC0415
            folder = out / f"{workload}-{rate:g}"
            write_report(real.run, folder / "real")
            write_report(sim, folder / "sim")
            if replay is not None:
                write_report(replay, folder / "replay")
                real.replay[0].save(folder / "replay" / "profile.json")
                real.replay[1].save(folder / "replay" / "overhead.json")
        load = float(real.run.meta.get("loadavg_1m", float("nan")))
        rows.append(Comparison(workload, rate, len(real.run.records), latencies(real.run),
                               latencies(sim), sum(r.ok for r in real.run.records),
                               sum(r.ok for r in sim.records), load,
                               latencies(replay) if replay is not None else None))
    return rows


def table(rows: list[Comparison]) -> str:
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:+.0%}"

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    stats = [(m, s) for m in ("ttft_s", "itl_s") for s in ("mean", "p99")]
    lines = ["| workload | rate | requests (ok real / sim) | load 1m | TTFT mean real / sim (ms) "
             "| err | TTFT p99 real / sim (ms) | err | ITL mean real / sim (ms) | err "
             "| ITL p99 real / sim (ms) | err | replay err: TTFT mean / p99, ITL mean / p99 |",
             "|---|---:|---|---:|---|---:|---|---:|---|---:|---|---:|---|"]
    for c in rows:
        cells = []
        for metric, stat in stats:
            cells += [f"{ms(c.real[metric][stat])} / {ms(c.sim[metric][stat])}",
                      pct(c.error(metric, stat))]
        replay = " / ".join(pct(c.error(m, s, of="replay")) for m, s in stats)
        lines.append(f"| {c.workload} | {c.rate:g} | {c.requests} ({c.real_ok} / {c.sim_ok}) "
                     f"| {c.loadavg_1m:.1f} | " + " | ".join(cells) + f" | {replay} |")
    return "\n".join(lines)


def add_validate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="a step profile (kvfleet sim calibrate); default: calibrate in a fleet "
                        "first")
    p.add_argument("--overhead", default=None, metavar="FILE",
                   help="the fleet's overhead (kvfleet sim calibrate --in-fleet); none: the "
                        "engines alone")
    p.add_argument("--workloads", default="chat-only,mixed,azure-conv")
    p.add_argument("--rates", default="0.5,1", help="scale.rate values")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of each real run")
    p.add_argument("--calibrate-workload", default="mixed",
                   help="without --profile: the in-fleet calibration's workload")
    p.add_argument("--calibrate-rate", type=float, default=0.75)
    p.add_argument("--calibrate-duration", type=float, default=30.0)
    p.add_argument("--out", default="sim-validation",
                   help="folder for each run's reports, the profile, table.md and rows.json")
    p.add_argument("--reuse-real", action="store_true",
                   help="take the real runs an earlier call saved under --out (new profile, "
                        "same runs)")


def run_validate(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile, overhead = args.profile, None
    if args.overhead:
        overhead = FleetOverhead.load(args.overhead)
    if profile is None and args.reuse_real and (out / "profile.json").is_file():
        profile = str(out / "profile.json")          # the in-fleet calibration saved there
        if overhead is None and (out / "overhead.json").is_file():
            overhead = FleetOverhead.load(out / "overhead.json")
    if profile is None:
        from services.planner.in_fleet import calibrate_in_fleet  # noqa: PLC0415
        spec = load_workload(args.calibrate_workload).with_overrides(
            duration_s=args.calibrate_duration, rate_scale=args.calibrate_rate)
        got = calibrate_in_fleet(spec)
        profile, overhead = str(out / "profile.json"), got.overhead
        got.profile.save(profile)
        got.overhead.save(out / "overhead.json")
        from loadtests.report import write_report  # noqa: PLC0415
        write_report(got.run, out / "calibration")
        print(f"calibrated in a fleet: {got.profile.notes}; path mean "
              f"{got.overhead.path_mean_s * 1e3:.0f} ms", flush=True)
    rows = []
    rates = [float(r) for r in args.rates.split(",")]
    for workload in args.workloads.split(","):
        got_rows = compare(workload, rates, args.duration, profile, out, args.reuse_real, overhead)
        rows += got_rows
        print("\n".join(table(got_rows).splitlines()[2:]), flush=True)
    print(table(rows))
    (out / "table.md").write_text(table(rows) + "\n")
    (out / "rows.json").write_text(json.dumps([c.__dict__ for c in rows], indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvfleet sim validate", description=__doc__.split("\n\n")[0])
    add_validate_args(p)
    return run_validate(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
