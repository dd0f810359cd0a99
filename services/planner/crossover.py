"""`kvfleet sim crossover`: where disaggregation starts to pay, by prompt length and KV link.

For each prompt length, a workload of that one length (one tenant, Poisson arrivals, a fixed
output) runs on a co-located fleet of n replicas and on a disaggregated fleet of the same n, split
by the offered prefill share of the work (sizing.fleet_of), at each KV link bandwidth. Rates are
multiples of the length's `base_rate`: the requests per second n replicas hold at the target
utilization by the cost model, so every length is swept around its own capacity. Each setup's
knee (the highest rate at SLO attainment >= 90%, study.knee) and its goodput there are compared:
disaggregation pays at a length and link where its goodput at the knee beats co-located's.

Prompts up to the interactive class's longest (8,192 tokens) are interactive (TTFT 1 s, ITL
100 ms); longer ones are documents (TTFT 10 s, ITL 100 ms): DESIGN section 2's targets.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from loadtests.workload import WorkloadSpec, parse_workload
from services.engine.config import DOCUMENT, INTERACTIVE, SimConfig
from services.planner.capacity import CostModel
from services.planner.sizing import fleet_of
from services.planner.study import Point, knee, point

LENGTHS = (256, 1024, 4096, 16384, 32768)


@dataclass(frozen=True)
class CrossoverConfig:
    lengths: tuple[int, ...] = LENGTHS
    output_tokens: int = 128
    replicas: int = 4
    factors: tuple[float, ...] = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0)   # x base_rate
    gbps: tuple[float, ...] = (3200.0, 400.0, 14.4)
    duration_s: float = 20.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.replicas < 2:
            raise ValueError(f"--replicas must be >= 2 (a disaggregated fleet needs two), got "
                             f"{self.replicas}")
        if not self.lengths or min(self.lengths) < 1 or self.output_tokens < 1:
            raise ValueError("prompt lengths and the output must be >= 1 token")
        if max(self.lengths) > DOCUMENT.max_prompt_tokens:
            raise ValueError(f"prompt lengths must be <= {DOCUMENT.max_prompt_tokens}")
        if not self.factors or min(self.factors) <= 0 or not self.gbps or min(self.gbps) <= 0:
            raise ValueError("rate factors and bandwidths must be > 0")
        if not self.duration_s > 0:
            raise ValueError("--duration must be > 0")


def traffic_class(prompt_tokens: int):
    return INTERACTIVE if prompt_tokens <= INTERACTIVE.max_prompt_tokens else DOCUMENT


def fixed_workload(prompt_tokens: int, output_tokens: int, rate_rps: float, duration_s: float,
                   seed: int = 0) -> WorkloadSpec:
    """One tenant sending prompts of exactly `prompt_tokens`, Poisson at `rate_rps`."""
    cls = traffic_class(prompt_tokens)
    return parse_workload({
        "name": f"fixed-{prompt_tokens}", "seed": seed, "duration_s": duration_s,
        "classes": {cls.name: {"slo": {"ttft_s": cls.ttft_target_s, "itl_s": cls.itl_target_s},
                               "prompt_tokens": {"dist": "fixed", "value": prompt_tokens},
                               "output_tokens": {"dist": "fixed", "value": output_tokens}}},
        "tenants": {"t": {"class": cls.name,
                          "arrival": {"process": "poisson", "rate_rps": rate_rps}}}})


def work_of(model: CostModel, prompt_tokens: int, output_tokens: int) -> tuple[float, float]:
    """Prefill and decode replica-seconds one request costs (decode at a full replica's batch,
    as offered_load.py counts it)."""
    context = prompt_tokens + output_tokens // 2
    batch = max(1, min(model.constants.max_decode_batch,
                       int(model.kv_tokens_per_replica // (prompt_tokens + output_tokens))))
    return (model.prefill_s(prompt_tokens),
            output_tokens * model.decode_step_s(batch, context) / batch)


def base_rate(model: CostModel, replicas: int, prompt_tokens: int, output_tokens: int) -> float:
    """Requests per second `replicas` hold at the target utilization, by the cost model."""
    pre, dec = work_of(model, prompt_tokens, output_tokens)
    return replicas * model.constants.target_utilization / (pre + dec)


def setups_for(model: CostModel, cfg: CrossoverConfig, prompt_tokens: int) -> list[str]:
    pre, dec = work_of(model, prompt_tokens, cfg.output_tokens)
    return [f"colocated:{cfg.replicas}", fleet_of("disagg", cfg.replicas, pre / (pre + dec))]


def sweep(model: CostModel, sim: SimConfig, cfg: CrossoverConfig, progress=None) -> list[dict]:
    """Every point: {length, base_rps, point}; a setup's rates stop once attainment is under 50%."""
    out = []
    for length in cfg.lengths:
        base = base_rate(model, cfg.replicas, length, cfg.output_tokens)
        spec = fixed_workload(length, cfg.output_tokens, base, cfg.duration_s, cfg.seed)
        for setup in setups_for(model, cfg, length):
            for g in cfg.gbps[:1] if setup.startswith("colocated") else cfg.gbps:
                for f in cfg.factors:
                    p = point(spec, setup, replace(sim, network_gbps=g), f)
                    out.append({"length": length, "base_rps": base, "point": p})
                    if progress:
                        progress(length, p)
                    if p.attainment < 0.5:
                        break
    return out


def table(points: list[dict]) -> list[dict]:
    """Per (length, link): co-located's and disaggregated's knees and goodput there."""
    groups: dict[tuple[int, str, float], list[Point]] = {}
    for row in points:
        p = row["point"]
        groups.setdefault((row["length"], p.setup, p.gbps), []).append(p)
    rows = []
    for length in sorted({k[0] for k in groups}):
        colo = next(ps for (n, s, _), ps in groups.items() if n == length and s.startswith("colo"))
        ck = knee(colo)
        for (n, setup, g), ps in sorted(groups.items()):
            if n != length or setup.startswith("colo"):
                continue
            dk = knee(ps)
            cg, dg = (ck.goodput_rps if ck else 0.0), (dk.goodput_rps if dk else 0.0)
            rows.append({"prompt_tokens": length, "gbps": g, "colocated": colo[0].setup,
                         "disaggregated": setup,
                         "colocated_knee_rps": ck.offered_rps if ck else None,
                         "colocated_goodput_rps": cg,
                         "disagg_knee_rps": dk.offered_rps if dk else None,
                         "disagg_goodput_rps": dg,
                         "disagg_gain": (dg / cg - 1.0) if cg > 0 else None,
                         "pays": dg > cg})
    return rows


def write(points: list[dict], sim: SimConfig, cfg: CrossoverConfig, out: Path) -> list[dict]:
    """crossover.json and crossover.png under `out`; returns the table."""
    out.mkdir(parents=True, exist_ok=True)
    rows = table(points)
    (out / "crossover.json").write_text(json.dumps({
        "config": asdict(cfg), "target": asdict(sim), "table": rows,
        "points": [{"length": r["length"], "base_rps": r["base_rps"], **asdict(r["point"])}
                   for r in points]}, indent=1, default=str))
    _plot(rows, out / "crossover.png")
    return rows


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for g in sorted({r["gbps"] for r in rows}, reverse=True):
        mine = [r for r in rows if r["gbps"] == g and r["disagg_gain"] is not None]
        ax.plot([r["prompt_tokens"] for r in mine], [100 * r["disagg_gain"] for r in mine],
                marker="o", label=f"KV link {g:g} Gb/s")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens (fixed; fixed output)")
    ax.set_ylabel("disaggregated goodput at knee vs co-located (%)")
    ax.set_title("Where disaggregation pays: same GPUs (simulated)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
