"""`kvfleet sim rebalance`: the rebalancer in the simulator's loop on a trace whose mix shifts, against
fixed-ratio fleets of the same size (services/planner/rebalance_sim.py does the work). Writes a
PNG of the pool sizes over time and a JSON of every run (goodput, GPU-hours, timeline, decisions).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", nargs="+", default=["shift-chat", "shift-docs"],
                   help="the trace's hours, in order (default: shift-chat shift-docs)")
    p.add_argument("--hour-s", type=float, default=180.0,
                   help="simulated seconds each hour is compressed into (default 180)")
    p.add_argument("--window-s", type=float, default=15.0, help="the policy's window (default 15)")
    p.add_argument("--startup-s", type=float, default=15.0,
                   help="an added worker's start-up, compressed as the hours are (default 15)")
    p.add_argument("--down-windows", type=int, default=3)
    p.add_argument("--budget", type=int, default=8, help="replicas, all pools (default 8)")
    p.add_argument("--start", default="disagg:4:4", help="the rebalanced fleet's first sizes")
    p.add_argument("--fixed", nargs="+", default=["disagg:4:4", "disagg:6:2"],
                   help="fixed-ratio fleets to compare (same budget)")
    p.add_argument("--rate-scale", type=float, default=None, help="x every hour's arrival rates")
    p.add_argument("--out", default="docs/img/rebalance_loop.png", help="the PNG to write")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs side by side, one process each (default 1: one after the other)")
    p.add_argument("--json-out", default=None, help="the runs as JSON (default: --out as .json)")


def run(args: argparse.Namespace) -> int:
    from services.engine.config import SimConfig  # noqa: PLC0415
    from services.planner.rebalance import RebalanceConfig  # noqa: PLC0415
    from services.planner.rebalance_sim import LoopConfig, plot, run_one  # noqa: PLC0415
    from services.planner.simulator import Fleet, SimRunConfig  # noqa: PLC0415
    from loadtests.workload import load_workload  # noqa: PLC0415
    from loadtests.distributions import SpecError  # noqa: PLC0415
    try:
        specs = [load_workload(w).with_overrides(rate_scale=args.rate_scale)
                 for w in args.workloads]
        loop = LoopConfig(hour_s=args.hour_s, window_s=args.window_s, startup_s=args.startup_s,
                          policy=RebalanceConfig(cooldown_s=args.startup_s + 2 * args.window_s,
                                                 budget=args.budget,
                                                 down_windows=args.down_windows))
        start = Fleet.parse(args.start)
        fixed = [Fleet.parse(f) for f in args.fixed]
        for f in (start, *fixed):
            if f.mode != "disagg" or f.prefill + f.decode > args.budget:
                raise ValueError(f"fleet {f}: expected disagg:P:D with P + D <= --budget")
    except (SpecError, ValueError, KeyError, FileNotFoundError) as e:
        print(f"kvfleet sim rebalance: {e}", file=sys.stderr)
        return 2
    jobs = [(specs, SimRunConfig(fleet=start, sim=SimConfig()), loop, args.hour_s)]
    jobs += [(specs, SimRunConfig(fleet=f, sim=SimConfig()), None, args.hour_s) for f in fixed]
    if args.jobs > 1:                   # the runs are independent: one process each
        from concurrent.futures import ProcessPoolExecutor  # noqa: PLC0415
        with ProcessPoolExecutor(min(args.jobs, len(jobs))) as pool:
            runs = list(pool.map(run_one, *zip(*jobs)))
    else:
        runs = [run_one(*job) for job in jobs]
    for r in runs:
        print(_line(r), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(runs[0], runs[1:], args.hour_s, str(out))
    json_out = Path(args.json_out) if args.json_out else out.with_suffix(".json")
    json_out.write_text(json.dumps({
        "command": ["kvfleet", "sim", "rebalance", *sys.argv[3:]],
        "loop": {"hour_s": args.hour_s, "window_s": args.window_s, "startup_s": args.startup_s,
                 "budget": args.budget, "down_windows": args.down_windows,
                 "cooldown_s": loop.policy.cooldown_s},
        "runs": [{"label": r.label, "gpu_hours": round(r.gpu_hours, 3),
                  "overall": r.summary["overall"], "classes": r.summary.get("classes"),
                  "timeline": r.timeline,
                  "decisions": r.decisions} for r in runs]}, indent=1))
    print(f"plot {out}; runs {json_out}")
    return 0


def _line(r) -> str:
    o = r.summary["overall"]
    changes = sum(1 for d in r.decisions
                  if any(isinstance(v, dict) and v["recommended"] != v["current"]
                         for v in d.values()))
    return (f"{r.label:<18} goodput {o['goodput_rps']:.2f} req/s  met {o['met']}/{o['requests']}"
            f"  rejected {o['rejected']}  {r.gpu_hours:.2f} GPU-h (simulated)  changes {changes}")
