"""The router's Admit on its own: wall time, CPU and Redis commands per co-located admission.

    PYTHONPATH=. python -m loadtests.bench_admit [--admits 400] [--idle-ms 2]

A RouterServicer in this process (co-located mode: no worker call, so what is timed is the
router's decision and its Redis work), a real redis-server, and one `mixed` worker's heartbeat
written here (re-beaten every `--beat-every` admits, outside the timing, so placements since the
beat do not pile up). Each Admit gets a fresh 200-token prompt after `--idle-ms` idle (the
fleet's lone requests come after idle too). Printed as JSON: the wall-time median and p90 of one
Admit; this process's CPU over the whole timed run per Admit (so whatever an Admit leaves to
run after it answered is counted too, and so are the router's background loops, the stage
keeper and the capacity subscription, and the heartbeats); and Redis commands per Admit over
the run (INFO commandstats before and after; the heartbeats' and the keeper's included). Run it
with PYTHONPATH at another tree to compare; nothing is asserted.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import redis.asyncio as aioredis

from services.cli import fleet_bench
from services.engine.workload import random_prompt
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.router.service import RouterServicer
from services.state.fleet_state import FleetState

BEAT_TTL_S = 600.0


def mixed_worker(beat_unix_s: float) -> pb.WorkerStats:
    return pb.WorkerStats(
        worker_id="mixed-0", role="mixed", grpc_address="127.0.0.1:1", kv_backend="tcp",
        block_size=16, kv_blocks_total=100_000, kv_blocks_free=100_000, model="tiny",
        max_model_len=4096, prefill_tokens_per_s=50_000.0, decode_tokens_per_s=2_000.0,
        updated_at_unix_s=beat_unix_s)


async def commands(r: aioredis.Redis) -> int:
    stats = await r.info("commandstats")
    return sum(v["calls"] for v in stats.values())


async def bench(url: str, admits: int, idle_s: float, beat_every: int) -> dict:
    state = FleetState(url)
    router = RouterServicer(state, "colocated", "bench-router")
    probe = aioredis.Redis.from_url(url)
    rng = random.Random(5)
    params = pb.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    walls: list[float] = []
    try:
        for i in range(admits + 10):                   # the first 10 warm everything up
            if i == 10:
                before_calls, c0 = await commands(probe), time.process_time()
            if i % beat_every == 0:
                await state.heartbeat(mixed_worker(time.time()), BEAT_TTL_S)
            request = pb.WorkRequest(request_id=f"bench-{i}", prompt_token_ids=random_prompt(
                rng, fleet_bench.PROMPT_TOKENS, 1000), params=params, traffic_class="interactive")
            await asyncio.sleep(idle_s)
            t0 = time.perf_counter()
            plan = await router.Admit(request, None)
            if i >= 10:
                walls.append(time.perf_counter() - t0)
            assert plan.prefill[0].worker_id == "mixed-0"
        await asyncio.sleep(idle_s)
        cpu = time.process_time() - c0
        calls = await commands(probe) - before_calls - 1   # less the first INFO call
    finally:
        await router.close()
        await state.close()
        await probe.aclose()
    walls.sort()
    return {"admits": admits, "wall_ms_median": round(1e3 * statistics.median(walls), 3),
            "wall_ms_p90": round(1e3 * walls[int(0.9 * len(walls))], 3),
            "cpu_ms_per_admit": round(1e3 * cpu / admits, 3),
            "redis_commands_per_admit": round(calls / admits, 2)}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench_admit")
    p.add_argument("--admits", type=int, default=400)
    p.add_argument("--idle-ms", type=float, default=2.0)
    p.add_argument("--beat-every", type=int, default=20)
    args = p.parse_args()
    redis = fleet_bench._redis()
    try:
        out = asyncio.run(bench(redis.url, args.admits, args.idle_ms / 1e3, args.beat_every))
    finally:
        redis.stop()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
