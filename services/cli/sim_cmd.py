"""`kvfleet sim calibrate` (a measured step profile of this machine's engine) and `kvfleet sim run`
(the discrete-event fleet simulator). Arguments here; the work in services/planner/."""
from __future__ import annotations

import argparse
import json
import sys


def add_calibrate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="tiny, a named model, or a checkpoint dir")
    p.add_argument("--out", default="step-profile.json", help="the profile file to write")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's; the fleet's workers use theirs)")
    p.add_argument("--quick", action="store_true", help="a small grid (seconds): a smoke test")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stat", choices=["median", "min"], default="median",
                   help="a step's time over its repeated runs: median (typical on a shared "
                        "machine, default) or min (the machine unloaded)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")


def run_calibrate(args: argparse.Namespace) -> int:
    from services.planner.calibrate import CalibrateConfig, calibrate  # noqa: PLC0415
    if args.threads is not None and args.threads < 1:
        print("kvfleet sim calibrate: --threads must be >= 1", file=sys.stderr)
        return 2
    try:
        profile = calibrate(CalibrateConfig(model=args.model, threads=args.threads,
                                            quick=args.quick, seed=args.seed, stat=args.stat),
                            progress=None if args.json else lambda m: print(m, file=sys.stderr))
    except (ValueError, FileNotFoundError) as e:
        print(f"kvfleet sim calibrate: {e}", file=sys.stderr)
        return 2
    profile.save(args.out)
    if args.json:
        print(json.dumps(profile.to_dict(), indent=1))
        return 0
    fit = profile.fit
    print(f"{profile.model} ({profile.dtype}, {profile.threads} threads): {fit.samples} steps, "
          f"R^2 {fit.r2:.4f}, |relative error| mean {fit.mean_abs_rel_error:.1%} "
          f"p90 {fit.p90_abs_rel_error:.1%} max {fit.max_abs_rel_error:.1%}, "
          f"total {fit.total_rel_error:+.1%}")
    for term, c in profile.coefficients.items():
        print(f"  {term:24s} {c * 1e6:12.4f} us")
    print(f"profile written to {args.out}")
    return 0
