"""An admission workload on the emulated 70B fleet (docs/benchmarks.md, "Admission on the
emulated 70B fleet"):

    python -m loadtests.emulated_admission WORKLOAD MODE DURATION_S RATE_SCALE OUT

starts `kvfleet up --engine sim --sim-model llama-3-70b --sim-gpu h200 --sim-tp 4 --sim-dtype fp8
--mode MODE` (1 prefill + 1 decode, or 1 mixed) for the workload's tenants, each with its own key
(loadtests.local_fleet), runs `kvfleet bench serve --workload WORKLOAD --duration DURATION_S
--rate-scale RATE_SCALE --out OUT/report` against it, writes the 1-minute load average before and
after beside the report (OUT/load.json: the fleet's own overhead grows with the machine's load)
and the gateway's own lag (OUT/probe.json: `GET /version` timed every 0.5 s during the load, from
this process, not the load generator), the CPU seconds each of the fleet's processes and the
load generator spent during the load (OUT/cpu.json: the gateway's CPU per request bounds the rate
one gateway process can sustain), the gateway's `/metrics` after it (OUT/gateway_metrics.txt:
refusals by reason and stage), and stops the fleet. The figures come from the report as for a
simulated run (`python -m loadtests.admission_figures`); the front's own, per run (statuses, the
gateway's refusals by reason, its CPU per request, each tenant's TTFT p50 at the client split
into the part before the gateway's clock and the gateway's own), with

    python -m loadtests.emulated_admission --front OUT [OUT ...]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from loadtests.local_fleet import FleetSetup, local_fleet, tenant_key
from loadtests.workload import load_workload

PROBE_EVERY_S = 0.5
PROBE_TIMEOUT_S = 60.0
# The gateway's front door on this emulated fleet: Little's law at its knee measured on this 2-core
# box (docs/benchmarks.md, a11door: ~29 req/s within target x ~1 s a chat holds the gateway), the
# bound the a11door figures were taken with; the gateway's own default is for its own capacity
EMULATED_MAX_IN_PROGRESS = 32
TARGET = ("--sim-model", "llama-3-70b", "--sim-gpu", "h200", "--sim-tp", "4", "--sim-dtype", "fp8")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--front"] and len(argv) > 1:
        for out in argv[1:]:
            print(front(Path(out)))
        return 0
    if len(argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    workload, mode, duration, scale, out = argv[0], argv[1], argv[2], argv[3], Path(argv[4])
    if mode not in ("colocated", "disagg"):
        print(f"MODE must be colocated or disagg, not {mode!r}", file=sys.stderr)
        return 2
    return run(workload, mode, duration, scale, out)


def run(workload: str, mode: str, duration: str, scale: str, out: Path,
        key_overrides: dict | None = None) -> int:
    """The run `main` describes; `key_overrides`: tenant -> the fleet's key fields to change (a
    tenant's quotas: loadtests.local_fleet.FleetSetup)."""
    spec = load_workload(workload)
    out.mkdir(parents=True, exist_ok=True)
    keys = out / "keys.yaml"
    keys.write_text("".join(f"- {{key: {tenant_key(t.name)}, tenant: {t.name}}}\n"
                            for t in spec.tenants))
    load = {"before": os.getloadavg()[0]}
    setup = FleetSetup(mode=mode, engine="sim", sim_args=TARGET, key_overrides=key_overrides or {},
                       max_in_progress=EMULATED_MAX_IN_PROGRESS)
    with local_fleet(list(spec.tenants), setup) as fleet:
        load["fleet_ready"] = os.getloadavg()[0]
        before = process_cpu(fleet)
        children = os.times()
        with GatewayProbe(fleet.endpoint) as probe:
            done = subprocess.run(
                [sys.executable, "-m", "services.cli.cli", "bench", "serve", "--endpoint",
                 fleet.endpoint, "--workload", workload, "--duration", duration, "--rate-scale",
                 scale, "--api-keys", str(keys), "--no-progress", "--out", str(out / "report")])
        load["after"] = os.getloadavg()[0]
        cpu = {name: round(process_cpu(fleet).get(name, 0.0) - s, 3) for name, s in before.items()}
        after = os.times()
        cpu["load generator"] = round(after.children_user + after.children_system
                                      - children.children_user - children.children_system, 3)
        (out / "gateway_metrics.txt").write_text(_metrics(fleet.endpoint))
    (out / "cpu.json").write_text(json.dumps(cpu) + "\n")
    (out / "probe.json").write_text(json.dumps(probe.summary()) + "\n")
    (out / "load.json").write_text(json.dumps(load) + "\n")
    print(f"load average (1 min): {load}")
    if (out / "report" / "run.json").exists():
        print(front(out))
    return done.returncode


def front(out: Path) -> str:
    """One run's front figures (module docstring), as text."""
    from loadtests.metrics import percentile  # noqa: PLC0415
    from loadtests.records import RunResult  # noqa: PLC0415
    records = RunResult.load(out / "report" / "run.json").records
    load = json.loads((out / "load.json").read_text())
    cpu = json.loads((out / "cpu.json").read_text())
    statuses = dict(sorted(Counter(r.status for r in records).items()))
    refused = {}
    for line in (out / "gateway_metrics.txt").read_text().splitlines():
        if line.startswith("kvfleet_rejections_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            refused[reason] = refused.get(reason, 0) + float(line.rsplit(" ", 1)[1])
    lines = [f"{out}: load {load['before']:.1f} -> {load['after']:.1f}; statuses {statuses}; "
             f"the gateway's refusals {refused}; its CPU {cpu['gateway'] / len(records) * 1e3:.1f} "
             f"ms a request (CPU s: {cpu})"]
    for tenant in sorted({r.tenant for r in records}):
        ok = [r for r in records if r.tenant == tenant and r.ok and r.timing]
        if ok:
            p50 = (lambda xs: percentile(xs, 50) * 1e3)
            lines.append(f"  {tenant}: TTFT p50 {p50([r.ttft_s for r in ok]):.0f} ms = before the "
                         f"gateway {p50([r.ttft_s - r.timing['ttft_s'] for r in ok]):.0f} + the "
                         f"gateway's {p50([r.timing['ttft_s'] for r in ok]):.0f} (queue_s "
                         f"{p50([r.timing['queue_s'] for r in ok]):.0f}) ms; {len(ok)} served")
    return "\n".join(lines)


SERVICES = ("gateway", "router-0", "prefill-0", "decode-0", "mixed-0")


def process_cpu(fleet) -> dict[str, float]:
    """CPU seconds (user + system) so far of each of the fleet's services that runs."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name in SERVICES:
        pid = fleet.up.pid(name)
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, TypeError):
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / tick    # utime, stime
    return out


def _metrics(endpoint: str) -> str:
    try:
        return httpx.get(f"{endpoint}/metrics", timeout=PROBE_TIMEOUT_S).text
    except httpx.HTTPError as e:
        return f"# unavailable: {e}\n"


class GatewayProbe:
    """Times `GET /version` (no auth, no body, no fleet call: the gateway's HTTP front and event
    loop alone) every PROBE_EVERY_S from a thread of this process while the load runs, so a run
    tells the gateway's own lag from the load generator's (whose records start the clock when it
    means to send)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint, self.seconds, self.failed = endpoint, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gateway-probe", daemon=True)

    def __enter__(self) -> "GatewayProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(PROBE_TIMEOUT_S + 1)

    def _loop(self) -> None:
        with httpx.Client(base_url=self.endpoint, timeout=PROBE_TIMEOUT_S) as client:
            while not self._stop.wait(PROBE_EVERY_S):
                start = time.perf_counter()
                try:
                    client.get("/version").raise_for_status()
                    self.seconds.append(time.perf_counter() - start)
                except httpx.HTTPError:
                    self.failed += 1

    def summary(self) -> dict:
        got = sorted(self.seconds)
        at = (lambda q: got[min(len(got) - 1, int(q * len(got)))] if got else None)
        return {"probes": len(got), "failed": self.failed, "p50_s": at(0.5), "p90_s": at(0.9),
                "p99_s": at(0.99), "max_s": got[-1] if got else None}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
