"""The `noisy-neighbor` benchmark of admission and fairness: the quiet tenants' SLO attainment
beside the flood against their solo run, and Jain's index (docs/benchmarks.md, the
noisy-neighbor sections):

    python -m loadtests.noisy_neighbor --des [--out DIR] [--fleet disagg:1:1] [--rate-scale 8]
    python -m loadtests.noisy_neighbor --emulated [--out DIR] [--duration 30] [--rate-scale 1]
        [--stream-limit TENANT=N ...] [--solo-from SOLO_REPORT_DIR]
    python -m loadtests.noisy_neighbor --figures RUN_DIR SOLO_DIR

`--des` runs the discrete-event simulator twice with the router's admission on (`kvfleet sim run
--workload noisy-neighbor`, then the quiet tenants alone: `noisy-neighbor-quiet`, the same
classes, rates and seed) at the 70B-on-4xH200-fp8 pace; `--emulated` runs the same two workloads
on the emulated fleet (real processes: loadtests.emulated_admission; `--stream-limit flood=8`
gives the flood's key a quota of 8 concurrent streams). Either then writes
DIR/figures.json and prints a table: per quiet tenant its attainment beside the flood, alone, and
the ratio (goal >= 0.95), TTFT p50 / p99, and Jain's index (goal >= 0.95: `summary.json`'s, output
tokens served against each tenant's weighted max-min fair share). `--figures` reads two existing
report folders. The quiet tenants are those of the solo workload. Nothing here is asserted.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from loadtests import emulated_admission
from loadtests.admission_figures import load, _slo
from loadtests.metrics import meets_slo, percentile
from loadtests.records import RunResult

WORKLOAD = "noisy-neighbor"
SOLO = str(Path(__file__).parent / "workloads" / "noisy-neighbor-quiet.yaml")
TARGET = ("--sim-model", "llama-3-70b", "--sim-gpu", "h200", "--sim-tp", "4", "--sim-dtype", "fp8")
GOAL_RATIO = 0.95
GOAL_JAIN = 0.95


def kvfleet(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "services.cli.cli", *args], check=True)


def run_des(out: Path, fleet: str, rate_scale: str) -> tuple[Path, Path]:
    for workload, name in ((WORKLOAD, "noisy"), (SOLO, "solo")):
        kvfleet("sim", "run", *TARGET, "--fleet", fleet, "--workload", workload,
                "--rate-scale", rate_scale, "--admission", "on", "--out", str(out / name))
    return out / "noisy", out / "solo"


def run_emulated(out: Path, duration: str, rate_scale: str, limits: dict[str, int],
                 solo: bool = True) -> tuple[Path, Path]:
    overrides = {t: {"max_concurrent_streams": n} for t, n in limits.items()}
    for workload, name in ((WORKLOAD, "noisy"), (SOLO, "solo")) if solo else ((WORKLOAD, "noisy"),):
        if emulated_admission.run(workload, "disagg", duration, rate_scale, out / name, overrides):
            raise ValueError(f"the emulated {workload} run failed")
    return out / "noisy" / "report", out / "solo" / "report"


def stream_limits(items: list[str]) -> dict[str, int]:
    """`TENANT=N` items: the tenant's key allows N concurrent streams."""
    out = {}
    for item in items:
        tenant, _, n = item.partition("=")
        if not tenant or not n.isdigit() or int(n) < 1:
            raise ValueError(f"--stream-limit wants TENANT=N with N >= 1, not {item!r}")
        out[tenant] = int(n)
    return out


def tenant_figures(run: RunResult, tenant: str) -> dict:
    """A tenant's attainment and TTFT; on a fleet run also where its TTFT went: the load
    generator's lag in sending, the gateway's own TTFT (its clock starts in the handler, after the
    HTTP request was accepted and read), and the rest (accept queue, HTTP, the client's loop)."""
    mine = [r for r in run.records if r.tenant == tenant]
    ttft = [r.ttft_s for r in mine if r.ok]
    timed = [r for r in mine if r.ok and r.timing]
    return {"requests": len(mine),
            "served": sum(r.ok for r in mine),
            "attainment": sum(meets_slo(r, _slo(run, r)) for r in mine) / max(1, len(mine)),
            "ttft_p50_ms": _p(ttft, 50), "ttft_p99_ms": _p(ttft, 99),
            "ttft_attained_at_gateway": sum(
                r.timing["ttft_s"] <= (_slo(run, r).ttft_s or float("inf")) for r in timed)
            / max(1, len(mine)),
            "send_lag_p50_ms": _p([r.send_s - r.scheduled_s for r in mine], 50),
            "gateway_ttft_p50_ms": _p([r.timing["ttft_s"] for r in timed], 50),
            "before_gateway_p50_ms": _p([r.ttft_s - r.timing["ttft_s"] for r in timed], 50)}


def _p(values: list[float], q: float) -> float | None:
    return percentile(values, q) * 1000 if values else None


def figures(run_dir: Path, solo_dir: Path) -> dict:
    run, summary = load(str(run_dir))
    solo, _ = load(str(solo_dir))
    quiet = sorted({r.tenant for r in solo.records})
    tenants = {}
    for t in quiet:
        beside, alone = tenant_figures(run, t), tenant_figures(solo, t)
        ratio = beside["attainment"] / alone["attainment"] if alone["attainment"] else None
        tenants[t] = {"beside": beside, "solo": alone, "ratio": ratio}
    others = sorted({r.tenant for r in run.records} - set(quiet))
    ratios = [v["ratio"] for v in tenants.values()]
    jain = summary.get("jain_index")
    return {"run": str(run_dir), "solo": str(solo_dir), "quiet": tenants,
            "others": {t: tenant_figures(run, t) for t in others},
            "jain_index": jain, "rejections_by_stage": summary.get("rejections_by_stage"),
            "gateway_probe": _probe(run_dir),
            "goal_ratio_met": bool(ratios) and all(r is not None and r >= GOAL_RATIO
                                                   for r in ratios),
            "goal_jain_met": jain is not None and jain >= GOAL_JAIN}


def _probe(run_dir: Path) -> dict | None:
    """An emulated run's `GET /version` timings (loadtests.emulated_admission), if any."""
    f = run_dir.parent / "probe.json"
    return json.loads(f.read_text()) if f.exists() else None


def _ms(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def markdown(f: dict) -> str:
    lines = ["| tenant | attainment beside the flood | solo | ratio | TTFT p50 / p99 (ms) "
             "| solo TTFT p50 / p99 (ms) | p50 send lag / gateway TTFT / before the gateway (ms) "
             "| TTFT target met at the gateway |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for t, v in f["quiet"].items():
        b, s = v["beside"], v["solo"]
        ratio = "-" if v["ratio"] is None else f"{v['ratio']:.2f}"
        lines.append(f"| {t} | {b['attainment']:.1%} | {s['attainment']:.1%} | {ratio} "
                     f"| {_ms(b['ttft_p50_ms'])} / {_ms(b['ttft_p99_ms'])} "
                     f"| {_ms(s['ttft_p50_ms'])} / {_ms(s['ttft_p99_ms'])} | {_where(b)} "
                     f"| {b['ttft_attained_at_gateway']:.1%} |")
    for t, v in f["others"].items():
        lines.append(f"| {t} (not quiet) | {v['attainment']:.1%} | | | {_ms(v['ttft_p50_ms'])} / "
                     f"{_ms(v['ttft_p99_ms'])} | | {_where(v)} | {v['ttft_attained_at_gateway']:.1%} |")
    if f.get("gateway_probe"):
        g = f["gateway_probe"]
        lines.append("")
        lines.append(f"gateway `GET /version` during the load: p50 {_ms(_x1000(g['p50_s']))} ms, "
                     f"p99 {_ms(_x1000(g['p99_s']))} ms, max {_ms(_x1000(g['max_s']))} ms "
                     f"({g['probes']} probes, {g['failed']} failed)")
    jain = f["jain_index"]
    lines.append("")
    lines.append(f"quiet tenants >= {GOAL_RATIO:.0%} of solo: "
                 f"{'met' if f['goal_ratio_met'] else 'NOT met'}; Jain's index "
                 f"{'-' if jain is None else f'{jain:.3f}'} (goal >= {GOAL_JAIN}): "
                 f"{'met' if f['goal_jain_met'] else 'NOT met'}; refusals by stage "
                 f"{f['rejections_by_stage']}")
    return "\n".join(lines)


def _where(v: dict) -> str:
    return " / ".join(_ms(v[k]) for k in ("send_lag_p50_ms", "gateway_ttft_p50_ms",
                                          "before_gateway_p50_ms"))


def _x1000(v):
    return None if v is None else v * 1000


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.noisy_neighbor",
                                description=__doc__.split("\n\n")[0])
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--des", action="store_true", help="the discrete-event simulator")
    how.add_argument("--emulated", action="store_true", help="the emulated 70B fleet (processes)")
    how.add_argument("--figures", nargs=2, metavar=("RUN_DIR", "SOLO_DIR"),
                     help="only the figures of two existing report folders")
    p.add_argument("--out", default="noisy_neighbor_out")
    p.add_argument("--fleet", default="disagg:1:1", help="--des: the simulated fleet")
    p.add_argument("--rate-scale", default=None,
                   help="default 8 with --des (past a 70B replica), 1 with --emulated")
    p.add_argument("--duration", default="30", help="--emulated: seconds of load")
    p.add_argument("--stream-limit", action="append", default=[], metavar="TENANT=N",
                   help="--emulated: the tenant's key allows N concurrent streams (its quota)")
    p.add_argument("--solo-from", default=None, metavar="SOLO_DIR",
                   help="--emulated: reuse this solo run's report instead of running it again")
    args = p.parse_args(argv)
    out = Path(args.out)
    try:
        limits = stream_limits(args.stream_limit)
        if args.figures:
            run_dir, solo_dir = Path(args.figures[0]), Path(args.figures[1])
        else:
            out.mkdir(parents=True, exist_ok=True)
            if args.des:
                run_dir, solo_dir = run_des(out, args.fleet, args.rate_scale or "8")
            else:
                run_dir, solo_dir = run_emulated(out, args.duration, args.rate_scale or "1",
                                                 limits, solo=args.solo_from is None)
                solo_dir = Path(args.solo_from) if args.solo_from else solo_dir
        f = figures(run_dir, solo_dir)
    except (OSError, KeyError, ValueError, subprocess.CalledProcessError) as e:
        print(f"noisy_neighbor: {e}", file=sys.stderr)
        return 2
    if not args.figures:
        (out / "figures.json").write_text(json.dumps(f, indent=2) + "\n")
    print(markdown(f))
    return 0


if __name__ == "__main__":
    sys.exit(main())
