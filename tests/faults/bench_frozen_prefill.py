"""How long a request waits on a frozen prefill worker before its first token (docs/benchmarks.md).

A real disaggregated fleet (two prefill workers, one decode worker, tiny model, real redis-server;
the frozen prefill-0 kept listed so that the router's plan names it first), the gateway's FleetRun
with prefill_start_s = S. For each of N requests: freeze prefill-0 (SIGSTOP), send, time the
first token (it comes from prefill-1 after the start deadline), thaw. The same N requests with no
one frozen give the baseline. Prints JSON.

    PYTHONPATH=. python -m tests.faults.bench_frozen_prefill --start-s 2 -n 5
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time

from services.engine.model_zoo import resolve
from services.protocol.timeouts import Timeouts
from services.state.redis_server import RedisServerProcess
from tests.harness import route_request, running_fleet

PROMPT = list(range(1, 25))
KEEP_LISTED = ("--timeout-heartbeat-ttl-s", "20", "--timeout-engine-stall-s", "20")


def first_token_s(fleet, rid: str) -> tuple[float, str]:
    began = time.monotonic()
    chunks = iter(fleet.generate(route_request(rid, PROMPT, 4, ignore_eos=True)))
    first = next(chunks)
    took = time.monotonic() - began
    for _ in chunks:
        pass
    return took, first.served_by


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--start-s", type=float, default=2.0)
    p.add_argument("-n", type=int, default=5)
    args = p.parse_args()
    redis = RedisServerProcess().start()
    try:
        result = measure(redis.url, args.start_s, args.n)
    finally:
        redis.stop()
    print(json.dumps(result))


def measure(redis_url: str, start_s: float, n: int) -> dict:
    with running_fleet(redis_url, resolve("tiny"), "disagg", prefill=2, decode=1,
                       worker_args=KEEP_LISTED) as fleet:
        fleet.timeouts = Timeouts(prefill_start_s=start_s)
        base = [first_token_s(fleet, f"base-{i}")[0] for i in range(n)]
        frozen, by = [], set()
        pid = fleet.launcher.children["prefill-0"].proc.pid
        for i in range(n):
            os.kill(pid, signal.SIGSTOP)
            try:
                took, served_by = first_token_s(fleet, f"frozen-{i}")
            finally:
                os.kill(pid, signal.SIGCONT)
            frozen.append(took)
            by.add(served_by)
    return {"prefill_start_s": start_s, "n": n, "ttft_median_s": round(statistics.median(base), 3),
            "failover_ttft_median_s": round(statistics.median(frozen), 3),
            "failover_ttft_max_s": round(max(frozen), 3), "served_by": sorted(by)}

if __name__ == "__main__":
    main()
