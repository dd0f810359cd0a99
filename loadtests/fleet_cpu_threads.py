"""The gateway's and router's CPU per lone REST request, split by thread: the event loop's
(Python: HTTP, SSE, admission) against grpc's own threads (event_engine, timers).

    PYTHONPATH=. python -m loadtests.fleet_cpu_threads --mode colocated|disagg [--requests 150]
        [--py-spy PATH_PREFIX]

`kvfleet up`'s fleet of the tiny model as `kvfleet bench fleet` starts it (the same as
loadtests/fleet_hops.py), 20 warm-up requests, then `--requests` lone REST requests of a fresh
200-token prompt and 16 tokens out, in a row; CPU (user + system, /proc/PID/task) per request of
every thread of the gateway and the router. With `--py-spy PREFIX` (py-spy on PATH, `pip install
py-spy`), both processes are sampled meanwhile into PREFIX.gateway.txt / PREFIX.router-0.txt
(py-spy's raw collapsed stacks). Printed as JSON; nothing is asserted.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess

import httpx

from services.cli import fleet_bench
from services.engine.workload import random_prompt

PROCESSES = ("gateway", "router-0")
WARM_UP = 20


def thread_ticks(pid: int) -> dict[str, int]:
    """CPU clock ticks so far of each thread of `pid`, by "name/tid"."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[f"{name}/{tid}"] = int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass                        # the thread ended meanwhile
    return out


async def lone_requests(gateway: str, n: int, seed: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=f"http://{gateway}", timeout=60) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        for _ in range(n):
            await fleet_bench.fleet_times(client, model, random_prompt(rng, 200, 1000), 16)


def per_request(before: dict[str, int], after: dict[str, int], n: int) -> dict[str, float]:
    tick = os.sysconf("SC_CLK_TCK")
    per = {t: 1e3 * (after[t] - before.get(t, 0)) / tick / n for t in after}
    per = {t: round(ms, 2) for t, ms in sorted(per.items(), key=lambda x: -x[1]) if ms > 0}
    return {"total": round(sum(per.values()), 2), **per}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.fleet_cpu_threads")
    p.add_argument("--mode", choices=["colocated", "disagg"], default="colocated")
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--model", default="tiny")
    p.add_argument("--kv-backend", default="tcp")
    p.add_argument("--py-spy", default="", metavar="PATH_PREFIX")
    args = p.parse_args()
    up = fleet_bench.up_args(args, fleet_bench.write_config())
    from services.cli.launcher import Launcher
    from services.cli.up import start_fleet
    redis, launcher = fleet_bench._redis(), Launcher()
    spies: list[subprocess.Popen] = []
    try:
        endpoints = start_fleet(up, launcher, redis.url)
        asyncio.run(lone_requests(endpoints["gateway"], WARM_UP, 1))
        pids = {name: launcher.children[name].proc.pid for name in PROCESSES}
        if args.py_spy:
            spy = shutil.which("py-spy") or "py-spy"
            spies = [subprocess.Popen([spy, "record", "-p", str(pid), "-r", "200", "-f", "raw",
                                       "-o", f"{args.py_spy}.{name}.txt"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for name, pid in pids.items()]
        before = {name: thread_ticks(pid) for name, pid in pids.items()}
        asyncio.run(lone_requests(endpoints["gateway"], args.requests, 2))
        after = {name: thread_ticks(pid) for name, pid in pids.items()}
    finally:
        for s in spies:
            s.send_signal(2)             # py-spy writes its file on SIGINT
            s.wait(timeout=30)
        launcher.stop_all()
        redis.stop()
    print(json.dumps({"mode": args.mode, "requests": args.requests,
                      "cpu_ms_per_request": {name: per_request(before[name], after[name],
                                                               args.requests)
                                             for name in PROCESSES}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
