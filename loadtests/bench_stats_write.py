"""What a worker's stats cost to publish to Redis once per engine step (docs/benchmarks.md, "The
prefill worker's scheduler stepped forward"):

    python -m loadtests.bench_stats_write [--writes N]

starts a redis-server on a free loopback port, writes a prefill worker's WorkerStats (three
tenants' queued prompts listed) N times the way `FleetState.heartbeat` does (one pipelined SET
with a TTL and SADD, redis-py asyncio), the step's start stamped into each, and prints the wall
time and this process's CPU per write, and redis-server's CPU in all. The server is stopped
whatever happens."""
from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import time

import redis.asyncio as aioredis

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prefill_stats() -> pb.WorkerStats:
    w = pb.WorkerStats(worker_id="prefill-0", role="prefill", token_budget=2048, chunk_size=512)
    for t in range(3):
        w.prefill_queues.add(traffic_class="interactive", tenant=f"conv-{t}", tokens=3000,
                             prompts=[500] * 6)
    for name in ("interactive", "document", "batch"):
        w.queued_prefill_tokens_ahead[name] = w.prefill_step_tokens_ahead[name] = 9000
    return w


async def ready(r: aioredis.Redis, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while True:
        try:
            await r.ping()
            return
        except (ConnectionError, aioredis.ConnectionError):
            if time.monotonic() > end:
                raise
            await asyncio.sleep(0.05)


async def measure(port: int, writes: int) -> str:
    r = aioredis.Redis(host="127.0.0.1", port=port)
    try:
        await ready(r)
        w = prefill_stats()
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(writes):
            w.step_started_unix_s = time.time()
            async with r.pipeline(transaction=True) as p:
                p.set("w:prefill-0", w.SerializeToString(), px=2000)
                p.sadd("workers", "prefill-0")
                await p.execute()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        info = await r.info("cpu")
        server = info["used_cpu_user"] + info["used_cpu_sys"]
        return (f"{writes} writes of {w.ByteSize()} B: {1e6 * wall / writes:.0f} us wall, "
                f"{1e6 * cpu / writes:.0f} us of this process's CPU each; redis-server CPU "
                f"{server:.2f} s in all")
    finally:
        await r.aclose()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--writes", type=int, default=5000)
    args = ap.parse_args(argv)
    if args.writes < 1:
        ap.error("--writes must be >= 1")
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        print(asyncio.run(measure(port, args.writes)))
    finally:
        server.terminate()
        server.wait(timeout=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
