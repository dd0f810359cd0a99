"""Where a lone request's added TTFT goes: each hop of the fleet's request path timed on its own
against a running fleet (the same `kvfleet up` fleet `kvfleet bench fleet` starts).

    PYTHONPATH=. python -m loadtests.fleet_hops --mode colocated|disagg [--repeats 15]

Per repeat, in turns, each on a fresh ~200-token prompt (no prefix-cache hit) and after the same
idle gap (the fleet's real traffic comes after idle too):
  rest        the gateway's REST stream to its first token (what `bench fleet` measures)
  admit       Router.Admit alone (disagg: with the router's Reserve inside; the reservation is
              then cancelled)
  first       the worker's own call to its first token, the way the gateway makes it (co-located:
              the mixed worker; disagg: Prefill after a fresh Admit)
  unary       a bare Worker.Health unary call (what one gRPC hop costs on this host)
Then `--cpu-requests` lone REST requests (16 tokens out) in a row, and the CPU time (user +
system, /proc) each of the fleet's processes spent per request: the work the path adds (the
engine core's CPU is mostly the model's). A loaded host inflates it less than wall time, but it
still grows with the load: compare runs taken at the same load.
Medians and CPU ms per request are printed as JSON. Nothing is asserted; the figures go to
docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time

import httpx

from services.cli import fleet_bench
from services.engine.workload import random_prompt
from services.protocol.fleet_token import FleetAuth
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.timeouts import Timeouts

IDLE_S = 0.02        # the gap before each timed call (the box is otherwise idle)
VOCAB = 1000


async def probe(endpoints: dict[str, str], auth: FleetAuth, mode: str, repeats: int) -> dict:
    from services.gateway.fleet_run import Channels, FleetRun, Routers
    timeouts = Timeouts()
    channels = Channels(auth)
    routers = Routers([endpoints["router-0"]], channels, timeouts)
    rng = random.Random(7)
    prompt = lambda: random_prompt(rng, fleet_bench.PROMPT_TOKENS, VOCAB)  # noqa: E731
    params = pb.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    times: dict[str, list[float]] = {"rest": [], "admit": [], "first": [], "unary": []}
    async with httpx.AsyncClient(base_url=f"http://{endpoints['gateway']}", timeout=60) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        for i in range(repeats + 2):                 # the first two warm everything up
            await asyncio.sleep(IDLE_S)
            rest = (await fleet_bench.fleet_times(client, model, prompt(), 16))[0]
            await asyncio.sleep(IDLE_S)
            req = pb.WorkRequest(request_id=f"probe-a{i}", prompt_token_ids=prompt(), params=params)
            t0 = time.perf_counter()
            plan = await routers.admit(req)
            admit = time.perf_counter() - t0
            await _end(channels, plan, req.request_id, timeouts)
            await asyncio.sleep(IDLE_S)
            req = pb.WorkRequest(request_id=f"probe-f{i}", prompt_token_ids=prompt(), params=params)
            run = FleetRun(req, routers, channels, timeouts)
            await run.start()
            t0 = time.perf_counter()
            await run.next()
            first = time.perf_counter() - t0
            while await run.next() is not None:
                pass
            await asyncio.sleep(IDLE_S)
            worker = channels.worker(plan.prefill[0].address)
            t0 = time.perf_counter()
            await worker.Health(pb.HealthRequest(), timeout=5)
            unary = time.perf_counter() - t0
            if i >= 2:
                for name, value in (("rest", rest), ("admit", admit), ("first", first),
                                    ("unary", unary)):
                    times[name].append(value)
    await channels.close()
    return {name: round(1e3 * statistics.median(v), 2) for name, v in times.items()}


def cpu_s(launcher) -> dict[str, float]:
    """CPU seconds (user + system) so far of each child of the launcher and all under it."""
    from services.cli.launcher import descendants
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, child in launcher.children.items():
        total = 0
        for pid in [child.proc.pid, *descendants(child.proc.pid)]:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
            except (OSError, IndexError, ValueError):
                pass                     # gone meanwhile
        out[name] = total / tick
    return out


async def cpu_per_request(endpoints: dict[str, str], launcher, n: int) -> dict[str, float]:
    """CPU ms per lone REST request of each fleet process, over `n` requests in a row."""
    rng = random.Random(11)
    async with httpx.AsyncClient(base_url=f"http://{endpoints['gateway']}", timeout=60) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await fleet_bench.fleet_times(client, model, random_prompt(rng, 200, VOCAB), 16)
        before = cpu_s(launcher)
        for _ in range(n):
            await fleet_bench.fleet_times(client, model, random_prompt(rng, 200, VOCAB), 16)
        after = cpu_s(launcher)
    return {name: round(1e3 * (after[name] - before.get(name, 0.0)) / n, 2) for name in after}


async def _end(channels, plan: pb.Plan, request_id: str, timeouts: Timeouts) -> None:
    """Free what an Admit alone reserved (disagg: the decode reservation)."""
    if plan.mode == pb.Plan.DISAGGREGATED:
        await channels.worker(plan.decode.address).Cancel(
            pb.CancelRequest(request_id=request_id), timeout=timeouts.cancel_s)


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.fleet_hops")
    p.add_argument("--mode", choices=["colocated", "disagg"], default="colocated")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--model", default="tiny")
    p.add_argument("--kv-backend", default="tcp")
    p.add_argument("--cpu-requests", type=int, default=40)
    args = p.parse_args()
    up = fleet_bench.up_args(args, fleet_bench.write_config())
    from services.cli.launcher import Launcher
    from services.cli.up import start_fleet
    redis, launcher = fleet_bench._redis(), Launcher()
    try:
        endpoints = start_fleet(up, launcher, redis.url)
        auth = FleetAuth.from_env(launcher.env)
        result = asyncio.run(probe(endpoints, auth, args.mode, args.repeats))
        cpu = asyncio.run(cpu_per_request(endpoints, launcher, args.cpu_requests))
    finally:
        launcher.stop_all()
        redis.stop()
    print(json.dumps({"mode": args.mode, "repeats": args.repeats, "median_ms": result,
                      "cpu_ms_per_request": cpu}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
