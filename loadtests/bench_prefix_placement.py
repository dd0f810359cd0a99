"""Prefix-aware placement against load-only placement, paired runs (docs/benchmarks.md):

    python -m loadtests.bench_prefix_placement [--workload azure-conv-turns] [--pairs 2]
        [--duration 40] [--out DIR]

Each pair starts `kvfleet up --mode disagg --prefill 2 --decode 1 --placement load`, runs
`kvfleet bench serve` with the workload, stops it, then the same with `--placement prefix` (the
order alternates between pairs). After each run: TTFT from the run's summary, and the prefix-cache
hit rate, prefix_hits / prefix_queries summed over the prefill workers' /metrics. Prints a
markdown table."""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from loadtests.local_fleet import FleetSetup, kvfleet_up, up_options, write_fleet_config
from loadtests.workload import load_workload


def counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("kvfleet_prefix_cache_hits_total", "kvfleet_prefix_cache_queries_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def prefill_metrics(lines: list[str]) -> list[str]:
    """The prefill workers' metrics addresses, from `kvfleet up`'s listen lines."""
    return [parts[3] for parts in (line.split() for line in lines)
            if len(parts) == 4 and parts[0] == "listen" and parts[1].startswith("prefill-")
            and parts[2] == "metrics"]


def one_run(placement: str, workload: str, duration: float, folder: Path) -> dict:
    spec = load_workload(workload)
    setup = FleetSetup(mode="disagg")
    engine_yaml, keys_yaml = write_fleet_config(list(spec.tenants), setup, folder)
    args, options = up_options(setup, engine_yaml, keys_yaml, None)
    args[args.index("--prefill") + 1] = "2"
    args += ["--placement", placement]
    out = folder / placement
    with kvfleet_up(setup.model, *args, **options) as up:
        lines = up.lines
        subprocess.run([sys.executable, "-m", "services.cli.cli", "bench", "serve", "--endpoint",
                        up.url, "--workload", workload, "--api-keys", keys_yaml,
                        "--duration", str(duration), "--out", str(out), "--no-progress"],
                       check=True, stdout=subprocess.DEVNULL)
        hits = queries = 0.0
        for url in prefill_metrics(lines):
            c = counters(url)
            hits += c.get("kvfleet_prefix_cache_hits_total", 0.0)
            queries += c.get("kvfleet_prefix_cache_queries_total", 0.0)
    summary = json.loads((out / "summary.json").read_text())
    ttft = summary["classes"]["interactive"]["ttft_s"]
    return {"placement": placement, "hit_rate": hits / queries if queries else 0.0,
            "ttft_p50": ttft["p50"], "ttft_p95": ttft["p95"], "ttft_p99": ttft["p99"],
            "requests": summary["classes"]["interactive"].get("requests")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench_prefix_placement")
    p.add_argument("--workload", default="azure-conv-turns")
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    base = Path(args.out or tempfile.mkdtemp(prefix="kvfleet-prefix-bench-"))
    rows = []
    for pair in range(args.pairs):
        order = ("load", "prefix") if pair % 2 == 0 else ("prefix", "load")
        for placement in order:
            folder = base / f"pair{pair}"
            folder.mkdir(parents=True, exist_ok=True)
            row = one_run(placement, args.workload, args.duration, folder)
            row["pair"] = pair
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| pair | placement | requests | prefix hit rate | TTFT p50 | p95 | p99 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pair']} | {r['placement']} | {r['requests']} | {r['hit_rate']:.1%} | "
              f"{r['ttft_p50'] * 1000:.0f} ms | {(r['ttft_p95'] or 0) * 1000:.0f} ms | "
              f"{r['ttft_p99'] * 1000:.0f} ms |")
    for placement in ("load", "prefix"):
        mine = [r for r in rows if r["placement"] == placement]
        print(f"{placement}: median over runs: hit rate "
              f"{statistics.median(r['hit_rate'] for r in mine):.1%}, TTFT p50 "
              f"{statistics.median(r['ttft_p50'] for r in mine) * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
