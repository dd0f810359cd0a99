"""`kvfleet sim study`: fleets of the same GPUs swept past their knee on the discrete-event
simulator, for the 70B study in docs/capacity.md (DESIGN sections 1 and 8).

For one workload and target: each setup (co-located, disaggregated at the given P:D splits, hybrid)
runs the workload at each rate scale; a point is the summary's goodput (requests that met their
class's TTFT and ITL targets, per second), SLO attainment, interactive TTFT / ITL p99 and refusals.

  knee:     the highest rate whose SLO attainment is at least `attainment` (0.9): the load the
            setup serves within its SLOs; its goodput there, per GPU, is the setup's figure
  bandwidth: the KV transfer's (disaggregated and hybrid setups), one sweep per value
  GPUs:     each worker is one replica of `tp` GPUs (the target's), so setups of equal worker
            count use equal GPUs

Every figure comes from `simulate` with a seeded plan: the same arguments give the same numbers.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from loadtests.metrics import summarize
from loadtests.workload import WorkloadSpec
from services.engine.config import EngineConfig, SimConfig
from services.planner.simulator import Fleet, SimRunConfig, simulate

__all__ = ["Fleet", "Point", "fcfs_engine", "knee", "point", "setups", "sweep", "write"]

ATTAINMENT = 0.9


@dataclass(frozen=True)
class Point:
    setup: str
    gbps: float
    rate_scale: float
    offered_rps: float
    goodput_rps: float
    attainment: float
    ttft_p99_s: float
    itl_p99_s: float
    rejected: int


def setups(replicas: int) -> list[str]:
    """Co-located, disaggregated splits and a hybrid, all of `replicas` workers."""
    out = [f"colocated:{replicas}"]
    out += [f"disagg:{p}:{replicas - p}" for p in range(1, replicas) if p <= replicas - p]
    if replicas >= 3:
        mixed = replicas // 2
        out.append(f"hybrid:{mixed}:{max(1, (replicas - mixed) // 2)}:"
                   f"{replicas - mixed - max(1, (replicas - mixed) // 2)}")
    return out


def point(spec: WorkloadSpec, setup: str, sim: SimConfig, rate_scale: float,
          engine: EngineConfig | None = None) -> Point:
    cfg = SimRunConfig(fleet=Fleet.parse(setup), sim=sim)
    if engine is not None:
        cfg = replace(cfg, engine=engine)
    run = simulate(spec.with_overrides(rate_scale=rate_scale), cfg).run
    s = summarize(run)
    overall = s["overall"]
    inter = s["classes"].get("interactive", {})
    requests = max(1, overall["requests"])
    return Point(setup, sim.network_gbps, rate_scale, overall["requests"] / spec.duration_s,
                 overall["goodput_rps"], overall["met"] / requests,
                 _p99(inter, "ttft_s"), _p99(inter, "itl_s"), overall.get("rejected", 0))


def _p99(cls: dict, key: str) -> float:
    stats = cls.get(key) or {}
    return float(stats.get("p99", float("nan"))) if isinstance(stats, dict) else float("nan")


def fcfs_engine() -> EngineConfig:
    """The baseline scheduler: whole prompts first come, first served, no token budget.

    Each iteration runs every running decode and then admits waiting prompts whole (no chunking,
    no per-step token budget, no attention cap), oldest first; no decode protection, no late
    refusal, no class priority or class share (every class is one level), and a tenant's turn is
    its whole queue. What remains of the order is the tenants' round-robin when KV is short."""
    from services.engine.config import SchedulerConfig  # noqa: PLC0415
    base = SchedulerConfig()
    unlimited = 1 << 24
    classes = tuple(replace(c, priority=0, share_while_interactive_waits=1.0)
                    for c in base.classes)
    return EngineConfig(scheduler=replace(
        base, token_budget=unlimited, chunk_size=unlimited, max_prefill_attention=0,
        protect_itl=False, reject_late=False, drr_quantum=unlimited, classes=classes))


def knee(points: list[Point], attainment: float = ATTAINMENT) -> Point | None:
    """The highest-rate point that still met `attainment` (None: none did)."""
    good = [p for p in points if p.attainment >= attainment]
    return max(good, key=lambda p: p.rate_scale) if good else None


def sweep(spec: WorkloadSpec, sim: SimConfig, fleets: list[str], rates: list[float],
          gbps: list[float], progress=None, engine: EngineConfig | None = None) -> list[Point]:
    out = []
    for setup in fleets:
        for g in (gbps if not setup.startswith("colocated") else gbps[:1]):
            for r in rates:
                p = point(spec, setup, replace(sim, network_gbps=g), r, engine)
                out.append(p)
                if progress:
                    progress(p)
                if p.attainment < 0.5:        # far past the knee: higher rates say nothing more
                    break
    return out


def write(points: list[Point], spec: WorkloadSpec, sim: SimConfig, out: Path) -> dict:
    """study.json and goodput.png under `out`; returns the table of knees."""
    out.mkdir(parents=True, exist_ok=True)
    groups: dict[tuple[str, float], list[Point]] = {}
    for p in points:
        groups.setdefault((p.setup, p.gbps), []).append(p)
    knees = []
    for (setup, g), ps in groups.items():
        k = knee(ps)
        workers = len(Fleet.parse(setup).roles())
        knees.append({"setup": setup, "gbps": g, "gpus": workers * sim.tp,
                      "knee_rate_scale": k.rate_scale if k else None,
                      "goodput_rps": k.goodput_rps if k else 0.0,
                      "goodput_rps_per_gpu": (k.goodput_rps if k else 0.0) / (workers * sim.tp)})
    (out / "study.json").write_text(json.dumps({
        "workload": spec.name, "target": asdict(sim), "points": [asdict(p) for p in points],
        "knees": knees}, indent=1, default=str))
    _plot(groups, spec, out / "goodput.png")
    return {"knees": knees}


def _plot(groups, spec: WorkloadSpec, path: Path) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (setup, g), ps in sorted(groups.items()):
        label = setup if setup.startswith("colocated") else f"{setup} @ {g:g} Gb/s"
        ax.plot([p.offered_rps for p in ps], [p.goodput_rps for p in ps], marker="o", label=label)
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("goodput (requests/s within SLO)")
    ax.set_title(f"{spec.name}: goodput vs offered load (simulated)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
