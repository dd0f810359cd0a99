"""The TTFT prediction error of a workload on a fresh local fleet (docs/benchmarks.md, "TTFT prediction error"):

    python -m loadtests.prediction_error WORKLOAD MODE DURATION_S OUT

starts `kvfleet up --mode MODE` for the workload's tenants (loadtests.local_fleet), runs
`kvfleet bench serve --workload WORKLOAD --duration DURATION_S --out OUT/report` against it, stops
the fleet, and prints summary.json's `prediction_error` overall and by class."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loadtests.local_fleet import FleetSetup, local_fleet, tenant_key
from loadtests.workload import load_workload


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    workload, mode, duration, out = argv[0], argv[1], argv[2], Path(argv[3])
    spec = load_workload(workload)
    out.mkdir(parents=True, exist_ok=True)
    keys = out / "keys.yaml"
    keys.write_text("".join(f"- {{key: {tenant_key(t.name)}, tenant: {t.name}}}\n"
                            for t in spec.tenants))
    with local_fleet(list(spec.tenants), FleetSetup(mode=mode)) as fleet:
        done = subprocess.run(
            [sys.executable, "-m", "services.cli.cli", "bench", "serve", "--endpoint",
             fleet.endpoint, "--workload", workload, "--duration", duration, "--api-keys",
             str(keys), "--no-progress", "--out", str(out / "report")])
    if done.returncode != 0:
        return done.returncode
    summary = json.loads((out / "report" / "summary.json").read_text())
    print(f"{workload} {mode}: overall {summary['prediction_error']}")
    for name, c in summary["classes"].items():
        print(f"  {name}: {c['prediction_error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
