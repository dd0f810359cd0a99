"""The TTFT prediction error of a workload on a fresh local fleet (docs/benchmarks.md, "TTFT prediction error"):

    python -m loadtests.prediction_error WORKLOAD MODE DURATION_S OUT [--emulated-70b]
        [--rate-scale X]

starts `kvfleet up --mode MODE` for the workload's tenants (loadtests.local_fleet; with
`--emulated-70b` on simulated engine cores at Llama-3-70B fp8 on 4 x H200:
`--engine sim --sim-model llama-3-70b --sim-gpu h200 --sim-tp 4 --sim-dtype fp8`), runs
`kvfleet bench serve --workload WORKLOAD --duration DURATION_S --out OUT/report` against it, stops
the fleet, and prints summary.json's `prediction_error` overall and by class."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from loadtests.local_fleet import FleetSetup, local_fleet, tenant_key
from loadtests.workload import load_workload


EMULATED_70B = ("--sim-model", "llama-3-70b", "--sim-gpu", "h200", "--sim-tp", "4",
                "--sim-dtype", "fp8")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload")
    ap.add_argument("mode", choices=("colocated", "disagg"))
    ap.add_argument("duration")
    ap.add_argument("out", type=Path)
    ap.add_argument("--emulated-70b", action="store_true")
    ap.add_argument("--rate-scale", default=None)
    args = ap.parse_args(argv)
    workload, mode, duration, out = args.workload, args.mode, args.duration, args.out
    setup = (FleetSetup(mode=mode, engine="sim", sim_args=EMULATED_70B) if args.emulated_70b
             else FleetSetup(mode=mode))
    scale = ["--rate-scale", args.rate_scale] if args.rate_scale else []
    spec = load_workload(workload)
    out.mkdir(parents=True, exist_ok=True)
    keys = out / "keys.yaml"
    keys.write_text("".join(f"- {{key: {tenant_key(t.name)}, tenant: {t.name}}}\n"
                            for t in spec.tenants))
    with local_fleet(list(spec.tenants), setup) as fleet:
        done = subprocess.run(
            [sys.executable, "-m", "services.cli.cli", "bench", "serve", "--endpoint",
             fleet.endpoint, "--workload", workload, "--duration", duration, "--api-keys",
             str(keys), "--no-progress", "--out", str(out / "report"), *scale])
    if done.returncode != 0:
        return done.returncode
    summary = json.loads((out / "report" / "summary.json").read_text())
    print(f"{workload} {mode}: overall {summary['prediction_error']}")
    for name, c in summary["classes"].items():
        print(f"  {name}: {c['prediction_error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
