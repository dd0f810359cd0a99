"""`kvfleet sim overhead`: the emulated fleet against the discrete-event simulation on the same
target and workload; the difference, phase by phase, is the fleet's own overhead.

The emulated side is the whole real fleet (gateway, routers, workers, Redis, gRPC, KV transport)
on simulated engine cores that pace each step to the target's modelled time on the wall clock
(`kvfleet up --engine sim --sim-model ...`, started by loadtests/local_fleet.py), loaded by the
load tester (`kvfleet bench serve`'s runner). The discrete-event side is `kvfleet sim run` with
the same target, fleet shape and seeded workload: the same scheduler, block pools and placement
on a virtual clock, with none of the fleet's own costs. Per request, the server's phase times:

    queue       arrival at the gateway -> the engine schedules the prompt (gateway, router, queue)
    prefill     scheduled -> first token in the engine
    transfer    first token -> the decode worker starts (disaggregated: the KV hand-off)
    path        client TTFT - queue - prefill: what the client waited beyond the server's phases
                (HTTP, SSE, the gRPC hops of the first token, the load generator). A simulated
                core stamps the first token at its step's start, so on both sides the path also
                holds the first token's last step; the difference is the fleet's
    TTFT, ITL   as the client saw them

A third column, "DES + overhead", runs the simulation again with the fleet overhead fitted on the
emulated run itself (services/planner/overhead.py: the path's distribution and the hand-off beyond
the modelled transfer): how much of the difference that model accounts for.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from loadtests.metrics import latency_stats
from loadtests.records import RunResult
from loadtests.workload import WorkloadSpec, load_workload
from services.engine.config import SimConfig
from services.planner.overhead import FleetOverhead, fit_overhead
from services.planner.simulator import Fleet, SimRunConfig, simulate

PHASES = ("queue_s", "prefill_s", "transfer_s", "path_s", "ttft_s", "itl_s")


@dataclass(frozen=True)
class Target:
    model: str = "llama-3-70b"
    gpu: str = "h200"
    tp: int = 4
    dtype: str = "fp8"

    def sim_config(self) -> SimConfig:
        return SimConfig(target_model=self.model, gpu=self.gpu, tp=self.tp, dtype=self.dtype)

    def flags(self) -> tuple[str, ...]:
        return ("--sim-model", self.model, "--sim-gpu", self.gpu, "--sim-tp", str(self.tp),
                "--sim-dtype", self.dtype)

    def __str__(self) -> str:
        return f"{self.model} {self.dtype} on {self.tp} x {self.gpu}"


def emulated_run(spec: WorkloadSpec, fleet: Fleet, target: Target) -> RunResult:
    """The spec through `kvfleet up --engine sim` with the target's flags."""
    from loadtests.local_fleet import FleetSetup, local_fleet  # noqa: PLC0415
    from loadtests.runner import RunConfig, run_workload  # noqa: PLC0415
    setup = FleetSetup(mode=fleet.mode, engine="sim", sim_args=target.flags(),
                       prefill=max(1, fleet.prefill), decode=fleet.decode)
    with local_fleet(list(spec.tenants), setup) as up:
        run = asyncio.run(run_workload(spec, RunConfig(up.endpoint, tenant_keys=up.tenant_keys)))
    run.meta["loadavg_1m"] = os.getloadavg()[0]
    run.meta["emulated"] = {"fleet": str(fleet), "target": str(target)}
    return run


def des_run(spec: WorkloadSpec, fleet: Fleet, target: Target,
            overhead: FleetOverhead | None = None) -> RunResult:
    return simulate(spec, SimRunConfig(fleet=fleet, sim=target.sim_config(),
                                       overhead=overhead)).run


def phases(run: RunResult) -> dict[str, dict]:
    """Each phase's mean / p50 / p95 / p99 over the ok requests (seconds)."""
    ok = [r for r in run.records if r.ok]
    timed = [r for r in ok if r.timing]

    def phase(name: str) -> list[float]:
        return [float(r.timing[name]) for r in timed if isinstance(r.timing.get(name), (int, float))]

    transfer = [r for r in timed if r.timing.get("pool") != "mixed" and r.timing.get("transfer_s")]
    return {"queue_s": latency_stats(phase("queue_s")),
            "prefill_s": latency_stats(phase("prefill_s")),
            "transfer_s": latency_stats([float(r.timing["transfer_s"]) for r in transfer]),
            "path_s": latency_stats([r.ttft_s - r.timing["queue_s"] - r.timing["prefill_s"]
                                     for r in timed]),
            "ttft_s": latency_stats([r.ttft_s for r in ok]),
            "itl_s": latency_stats([g for r in ok for g in r.itl_s])}


@dataclass(frozen=True)
class Versus:
    workload: str
    fleet: str
    requests: int
    ok: tuple[int, int, int]           # emulated, DES, DES + overhead
    loadavg_1m: float
    emulated: dict
    des: dict
    des_overhead: dict
    overhead: dict                     # the fitted FleetOverhead's to_dict()


def versus(spec: WorkloadSpec, fleet: Fleet, target: Target, out: Path | None = None,
           reuse: bool = False) -> Versus:
    """`reuse`: the emulated run an earlier call saved under `out`, when it is there."""
    from loadtests.report import write_report  # noqa: PLC0415
    from services.planner.capacity import CostModel  # noqa: PLC0415
    folder = out / f"{spec.name}-{str(fleet).replace(':', '-')}" if out is not None else None
    saved = folder / "emulated" / "run.json" if folder is not None else None
    emulated = (RunResult.load(saved) if reuse and saved is not None and saved.is_file()
                else emulated_run(spec, fleet, target))
    des = des_run(spec, fleet, target)
    model = CostModel.for_target(model=target.model, gpu=target.gpu, tp=target.tp,
                                 dtype=target.dtype)
    gbps = target.sim_config().network_gbps
    # two stages: the per-step cost and the hand-off against the bare simulation, then the path
    # against a simulation with them (the longer steps and hand-offs are not counted twice)
    costs = fit_overhead([emulated], transfer_s=lambda n: model.transfer_s(n, gbps),
                         baseline=des, per_step=True)
    slower = des_run(spec, fleet, target, replace(costs, path_quantiles_s=(0.0, 0.0)))
    overhead = replace(fit_overhead([emulated], baseline=slower), step_s=costs.step_s,
                       handoff_s=costs.handoff_s, source=f"emulated {spec.name} on {fleet}")
    des_o = des_run(spec, fleet, target, overhead)
    if folder is not None:
        for name, run in (("emulated", emulated), ("des", des), ("des-overhead", des_o)):
            write_report(run, folder / name)
        overhead.save(folder / "overhead.json")
    return Versus(spec.name, str(fleet), len(emulated.records),
                  tuple(sum(r.ok for r in run.records) for run in (emulated, des, des_o)),
                  float(emulated.meta["loadavg_1m"]), phases(emulated), phases(des),
                  phases(des_o), overhead.to_dict())


def table(rows: list[Versus], stats: tuple[str, ...] = ("mean", "p99")) -> str:
    def ms(v) -> str:
        return "-" if v is None else f"{v * 1e3:.1f}"

    lines = ["| workload | fleet | load 1m | phase | " + " | ".join(
        f"{s} emulated / DES / DES + overhead (ms) | {s} fleet adds (ms)" for s in stats) + " |",
        "|---|---|---:|---|" + "---|---:|" * len(stats)]
    for v in rows:
        for ph in PHASES:
            cells = []
            for s in stats:
                e, d, o = v.emulated[ph][s], v.des[ph][s], v.des_overhead[ph][s]
                cells += [f"{ms(e)} / {ms(d)} / {ms(o)}",
                          "-" if e is None or d is None else f"{(e - d) * 1e3:+.1f}"]
            lines.append(f"| {v.workload} | {v.fleet} | {v.loadavg_1m:.1f} | {ph.removesuffix('_s')} "
                         f"| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_overhead_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", default="mixed,azure-conv")
    p.add_argument("--fleets", default="disagg:1:1,colocated:2",
                   help="comma-separated colocated:N | disagg:P:D")
    p.add_argument("--sim-model", default=Target.model)
    p.add_argument("--sim-gpu", default=Target.gpu)
    p.add_argument("--sim-tp", type=int, default=Target.tp)
    p.add_argument("--sim-dtype", default=Target.dtype)
    p.add_argument("--rate-scale", type=float, default=None, help="x the workload's arrival rates")
    p.add_argument("--duration", type=float, default=None, help="seconds (default: the workload's)")
    p.add_argument("--out", default="sim-overhead",
                   help="folder for each side's report (run.json, summary.json, report.md)")
    p.add_argument("--reuse", action="store_true",
                   help="take the emulated runs an earlier call saved under --out")


def run_overhead(args: argparse.Namespace) -> int:
    from loadtests.distributions import SpecError  # noqa: PLC0415
    try:
        target = Target(args.sim_model, args.sim_gpu, args.sim_tp, args.sim_dtype)
        fleets = [Fleet.parse(f) for f in args.fleets.split(",")]
        specs = [load_workload(w).with_overrides(duration_s=args.duration, rate_scale=args.rate_scale)
                 for w in args.workloads.split(",")]
    except (SpecError, ValueError, KeyError) as e:
        print(f"kvfleet sim overhead: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    rows = []
    for spec in specs:
        for fleet in fleets:
            rows.append(versus(spec, fleet, target, out, args.reuse))
            print("\n".join(table(rows[-1:]).splitlines()[2:]), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{target}\n" + table(rows))
    (out / "table.md").write_text(f"{target}\n\n" + table(rows) + "\n")
    (out / "rows.json").write_text(json.dumps([v.__dict__ for v in rows], indent=1))
    return 0
