"""`kvfleet sim crossover`: co-located vs disaggregated on the same GPUs by prompt length and KV
link, on the simulator (services/planner/crossover.py)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _numbers(text: str, kind=float) -> tuple:
    try:
        return tuple(kind(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="256,1024,4096,16384,32768", help="prompt tokens to sweep")
    p.add_argument("--output-tokens", type=int, default=128, help="every request's output")
    p.add_argument("--replicas", type=int, default=4, help="workers per fleet (default 4)")
    p.add_argument("--factors", default="0.25,0.5,1,1.5,2,3,4",
                   help="rates as multiples of what the replicas hold by the cost model, ascending")
    p.add_argument("--gbps", default="3200,400,14.4", help="KV links to sweep, Gbit/s")
    p.add_argument("--duration", type=float, default=20.0, help="simulated seconds per point")
    p.add_argument("--seed", type=int, default=0)
    for flag, default in (("--sim-model", "llama-3-70b"), ("--sim-gpu", "h200"),
                          ("--sim-dtype", "fp8")):
        p.add_argument(flag, default=default)
    p.add_argument("--sim-tp", type=int, default=4)
    p.add_argument("--out", default="docs/capacity/crossover",
                   help="folder for crossover.json, crossover.png")


def run(args: argparse.Namespace) -> int:
    from services.engine.config import SimConfig  # noqa: PLC0415
    from services.planner import crossover  # noqa: PLC0415
    from services.planner.capacity import CostModel  # noqa: PLC0415
    try:
        cfg = crossover.CrossoverConfig(
            lengths=_numbers(args.lengths, int), output_tokens=args.output_tokens,
            replicas=args.replicas, factors=tuple(sorted(_numbers(args.factors))),
            gbps=_numbers(args.gbps), duration_s=args.duration, seed=args.seed)
        sim = SimConfig(target_model=args.sim_model, gpu=args.sim_gpu, tp=args.sim_tp,
                        dtype=args.sim_dtype)
        model = CostModel.for_target(args.sim_model, args.sim_gpu, args.sim_tp, args.sim_dtype)
        points = crossover.sweep(model, sim, cfg, progress=lambda n, p: print(
            f"{n:6d} tok {p.setup:14s} {p.gbps:7g} Gb/s x{p.rate_scale:<5g} offered "
            f"{p.offered_rps:8.2f} goodput {p.goodput_rps:8.2f} attainment {p.attainment:6.1%}",
            file=sys.stderr, flush=True))
    except (ValueError, KeyError) as e:
        print(f"kvfleet sim crossover: {e}", file=sys.stderr)
        return 2
    rows = crossover.write(points, sim, cfg, Path(args.out))
    print(f"{'prompt':>7} {'link Gb/s':>9} {'colocated rps':>13} {'disaggregated':>14} "
          f"{'rps':>8} {'gain':>7}")
    for r in rows:
        gain = "-" if r["disagg_gain"] is None else f"{r['disagg_gain']:+.0%}"
        print(f"{r['prompt_tokens']:>7} {r['gbps']:>9g} {r['colocated_goodput_rps']:>13.2f} "
              f"{r['disaggregated']:>14} {r['disagg_goodput_rps']:>8.2f} {gain:>7}")
    return 0
