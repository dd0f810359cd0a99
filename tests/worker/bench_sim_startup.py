"""How long a simulated fleet takes to start, and the CPU each of its processes spends getting there
(docs/benchmarks.md, "Test suite time"; not a test: run by hand).

    python -m tests.worker.bench_sim_startup [--model DIR] [--mode disagg|colocated] [--runs N]

Each run starts `kvfleet up --engine sim` as a user would (loadtests/local_fleet.py), times its
READY line and its first served completion, then reads every process of the fleet's user and
system CPU seconds (/proc/PID/stat) at that moment, by command; and, in fresh interpreters, the CPU
seconds of importing a simulated worker's and engine core's entry modules. One JSON line per run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from services.cli.launcher import children
from services.cli.up import _first_completion_after

ENTRIES = {
    "sim worker": ("services.cli.cli", "services.worker.serve"),
    "sim engine core": ("services.worker.engine_core", "services.engine.sim_engine"),
}
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """user + system CPU seconds of a live process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def role(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().decode(errors="replace").split("\0")
    for key in ("engine_core", "gateway", "router", "redis-server"):
        if any(key in a for a in argv):
            return key
    if "serve" in argv:
        return f"worker {argv[argv.index('serve') + 1]}"
    return " ".join(argv[:4])


def tree(pid: int) -> list[int]:
    kids = children(pid)
    return kids + [g for k in kids for g in tree(k)]


def import_cpu_s(modules: tuple[str, ...]) -> float:
    code = ("import importlib, resource\n"
            f"for m in {list(modules)!r}: importlib.import_module(m)\n"
            "r = resource.getrusage(resource.RUSAGE_SELF)\n"
            "print(r.ru_utime + r.ru_stime)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return round(float(out.stdout.split()[-1]), 2)


def one_run(args: argparse.Namespace) -> dict:
    from loadtests.local_fleet import kvfleet_up  # noqa: PLC0415
    t0 = time.monotonic()
    with kvfleet_up(args.model, mode=args.mode, engine="sim", ready_s=args.timeout_s) as up:
        first_s = _first_completion_after(up.url, t0, args.timeout_s)
        cpu: dict[str, float] = {}
        for pid in tree(up.proc.pid):
            try:
                name = role(pid)
                cpu[name] = round(cpu.get(name, 0.0) + cpu_s(pid), 2)
            except OSError:
                pass                  # ended meanwhile
        cpu["kvfleet up"] = round(cpu_s(up.proc.pid), 2)
    return {"mode": args.mode, "ready_s": round(up.ready_at - t0, 2),
            "first_request_s": round(first_s, 2), "cpu_s_at_first_request": cpu,
            "import_cpu_s": {k: import_cpu_s(m) for k, m in ENTRIES.items()},
            "load_1m": round(os.getloadavg()[0], 1)}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m tests.worker.bench_sim_startup")
    p.add_argument("--model", default="tiny")
    p.add_argument("--mode", choices=["disagg", "colocated"], default="disagg")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=300.0)
    args = p.parse_args()
    for _ in range(args.runs):
        print(json.dumps(one_run(args)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
