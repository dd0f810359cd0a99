"""The simulator against the real fleet on this machine: the same seeded workload through
`kvfleet up` (co-located, the tiny model, the load tester's own fleet: loadtests/local_fleet.py)
and through `kvfleet sim run` with a profile measured here (`kvfleet sim calibrate`), and the
relative errors of the simulated TTFT and ITL (mean and p99 over every ok request, all classes).

`python -m services.planner.validation PROFILE [--workloads chat-only,mixed] [--rates 0.5,1]
[--duration S] [--out DIR]` prints the table docs/capacity.md ("Validation") shows and writes
each run's reports under DIR.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path

from loadtests.metrics import latency_stats
from loadtests.records import RunResult
from loadtests.workload import WorkloadSpec, load_workload
from services.engine.config import SimConfig
from services.planner.simulator import Fleet, SimRunConfig, simulate


@dataclass(frozen=True)
class Comparison:
    workload: str
    rate: float
    requests: int
    real: dict           # {"ttft_s": {mean p99 ...}, "itl_s": {...}}
    sim: dict
    real_ok: int
    sim_ok: int
    loadavg_1m: float

    def error(self, metric: str, stat: str) -> float | None:
        """(sim - real) / real."""
        r, s = self.real[metric][stat], self.sim[metric][stat]
        return None if r in (None, 0) or s is None else (s - r) / r


def latencies(run: RunResult) -> dict:
    ok = [r for r in run.records if r.ok]
    return {"ttft_s": latency_stats([r.ttft_s for r in ok]),
            "itl_s": latency_stats([g for r in ok for g in r.itl_s])}


def real_runs(specs: list[WorkloadSpec]) -> list[RunResult]:
    """The specs (one workload's tenants) one after the other through one real fleet."""
    from loadtests.local_fleet import FleetSetup, local_fleet  # noqa: PLC0415
    from loadtests.runner import RunConfig, run_workload  # noqa: PLC0415
    with local_fleet(list(specs[0].tenants), FleetSetup(mode="colocated")) as fleet:
        cfg = RunConfig(fleet.endpoint, tenant_keys=fleet.tenant_keys)
        return [asyncio.run(run_workload(spec, cfg)) for spec in specs]


def sim_run(spec: WorkloadSpec, profile: str) -> RunResult:
    # the load tester's fleet: one mixed worker, kvfleet up's 256 MiB of KV (local_fleet.py)
    return simulate(spec, SimRunConfig(fleet=Fleet.parse("colocated:1"),
                                       sim=SimConfig(profile=profile))).run


def compare(workload: str, rates: list[float], duration_s: float, profile: str,
            out: Path | None = None, reuse_real: bool = False) -> list[Comparison]:
    """One workload at each rate, through one real fleet and through the simulator.
    `reuse_real`: the real runs saved under `out` by an earlier call, when all are there (a new
    profile is then checked against the same real runs)."""
    base = load_workload(workload)
    specs = [base.with_overrides(duration_s=duration_s, rate_scale=r) for r in rates]
    saved = [out / f"{workload}-{r:g}" / "real" / "run.json" for r in rates] if out else []
    if reuse_real and saved and all(p.is_file() for p in saved):
        reals = [RunResult.load(p) for p in saved]
        load = float(reals[0].meta.get("loadavg_1m", float("nan")))
    else:
        load = os.getloadavg()[0]
        reals = real_runs(specs)
        for real in reals:
            real.meta["loadavg_1m"] = load
    rows = []
    for rate, spec, real in zip(rates, specs, reals):
        sim = sim_run(spec, profile)
        if out is not None:
            from loadtests.report import write_report  # noqa: PLC0415
            write_report(real, out / f"{workload}-{rate:g}" / "real")
            write_report(sim, out / f"{workload}-{rate:g}" / "sim")
        rows.append(Comparison(workload, rate, len(real.records), latencies(real), latencies(sim),
                               sum(r.ok for r in real.records), sum(r.ok for r in sim.records),
                               load))
    return rows


def table(rows: list[Comparison]) -> str:
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:+.0%}"

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    lines = ["| workload | rate | requests (ok real / sim) | load 1m | TTFT mean real / sim (ms) "
             "| err | TTFT p99 real / sim (ms) | err | ITL mean real / sim (ms) | err "
             "| ITL p99 real / sim (ms) | err |",
             "|---|---:|---|---:|---|---:|---|---:|---|---:|---|---:|"]
    for c in rows:
        cells = []
        for metric in ("ttft_s", "itl_s"):
            for stat in ("mean", "p99"):
                cells += [f"{ms(c.real[metric][stat])} / {ms(c.sim[metric][stat])}",
                          pct(c.error(metric, stat))]
        lines.append(f"| {c.workload} | {c.rate:g} | {c.requests} ({c.real_ok} / {c.sim_ok}) "
                     f"| {c.loadavg_1m:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.planner.validation",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("profile", help="a kvfleet sim calibrate profile of this machine")
    p.add_argument("--workloads", default="chat-only,mixed,azure-conv")
    p.add_argument("--rates", default="0.5,1", help="scale.rate values")
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--out", default=None, help="folder for each run's reports and table.md")
    p.add_argument("--reuse-real", action="store_true",
                   help="take the real runs an earlier call saved under --out (new profile, same runs)")
    args = p.parse_args(argv)
    out = Path(args.out) if args.out else None
    rows = []
    rates = [float(r) for r in args.rates.split(",")]
    for workload in args.workloads.split(","):
        got = compare(workload, rates, args.duration, args.profile, out, args.reuse_real)
        rows += got
        print("\n".join(table(got).splitlines()[2:]), flush=True)
    print(table(rows))
    if out is not None:
        (out / "table.md").write_text(table(rows) + "\n")
        (out / "rows.json").write_text(json.dumps([c.__dict__ for c in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
