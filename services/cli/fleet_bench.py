"""`kvfleet bench fleet`: what the fleet adds over the in-process engine, on loopback.

  added TTFT        one ~200-token chat at a time: TTFT through REST (SSE) minus in-process TTFT
  added per token   one 128-token stream at a time: (end - first token) / 127, fleet minus engine
  throughput        32 concurrent 200-in/64-out SSE streams: output tokens/s
The client keeps its connections open (keep-alive), as the OpenAI client does.
Fleet and engine samples alternate (the engine sits in this process, idle while the fleet serves).
Medians over repeats; printed, never asserted. KV transfer GB/s: `python -m services.cli.kv_bench`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx
import torch

from loadtests.http_client import SSEConnection

from services.cli.launcher import Launcher
from services.state.redis_server import EmbeddedRedis, RedisNotInstalledError, RedisServerProcess
from services.cli.up import start_fleet, worker_threads
from services.engine.engine import LLMEngine, engine_config
from services.engine.sampling_params import SamplingParams
from services.engine.workload import random_prompt

TPOT_REPEATS = 5


async def stream_times(conn: SSEConnection, model: str, ids: list[int], n: int) -> list[float]:
    """One streaming completion: [first token s, last token s, completion tokens]."""
    first = last = None
    tokens = 0
    body = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    async for t, event in conn.post("/v1/completions", body):
        if event.get("choices"):
            last = t
            first = t if first is None else first
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    return [first, last, tokens]


def engine_times(engine: LLMEngine, ids: list[int], n: int) -> list[float]:
    """The same [first_token_s, last_token_s, tokens] for the in-process engine."""
    t0 = time.perf_counter()
    rid = engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    first = last = None
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                last = time.perf_counter() - t0
                first = last if first is None else first
                tokens += len(out.new_token_ids)
    return [first, last, tokens]


def per_token(times: list[float]) -> float:
    first, last, tokens = times
    return (last - first) / max(1, tokens - 1)


async def paired_numbers(address: str, engine: LLMEngine, prompts: list[list[int]],
                         repeats: int) -> tuple[dict, dict]:
    """Fleet and engine samples taken in turns (one fleet request, then the same prompt in the
    engine), so that the machine's drift during the run lands on both sides alike."""
    async with httpx.AsyncClient(base_url=f"http://{address}") as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
    pool = [await SSEConnection(address).open() for _ in range(32)]   # keep-alive, like a client
    conn = pool[0]
    await stream_times(conn, model, prompts[0], 4)                             # warm-up
    engine_times(engine, prompts[0], 4)
    ttft = {"fleet": [], "engine": []}
    for i in range(repeats):
        ttft["fleet"].append((await stream_times(conn, model, prompts[i % len(prompts)], 16))[0])
        ttft["engine"].append(engine_times(engine, prompts[i % len(prompts)], 16)[0])
    tpot = {"fleet": [], "engine": []}
    for _ in range(TPOT_REPEATS):
        tpot["fleet"].append(per_token(await stream_times(conn, model, prompts[0], 128)))
        tpot["engine"].append(per_token(engine_times(engine, prompts[0], 128)))
    t0 = time.perf_counter()
    runs = await asyncio.gather(*(stream_times(c, model, p, 64) for c, p in zip(pool, prompts)))
    fleet_tps = sum(r[2] for r in runs) / (time.perf_counter() - t0)
    for c in pool:
        await c.close()
    t0 = time.perf_counter()
    outs = engine.generate(prompts[:32], SamplingParams(max_tokens=64, temperature=0,
                                                       ignore_eos=True))
    engine_tps = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
    return tuple({"ttft_s": statistics.median(ttft[side]), "per_token_s": statistics.median(tpot[side]),
                  "concurrent_output_tokens_per_s": tps}
                 for side, tps in (("fleet", fleet_tps), ("engine", engine_tps)))


def bench_engine(model: str, threads: int) -> LLMEngine:
    """The in-process engine with the same torch threads as one fleet worker, so that the
    difference is the serving path, not the core split. It sits idle while the fleet serves."""
    torch.set_num_threads(threads)
    return LLMEngine(engine_config(model, token_budget=2048, chunk_size=512, reject_late=False,
                                   enable_prefix_caching=False))


def _redis():
    """A real redis-server when installed (as in production); the embedded one otherwise. The
    embedded server runs Lua through lupa inside this process and adds its own latency."""
    try:
        return RedisServerProcess().start()
    except RedisNotInstalledError:
        return EmbeddedRedis().start()


def run_fleet_bench(args: argparse.Namespace) -> int:
    rng = random.Random(0)
    prompts = [random_prompt(rng, 200, 4096) for _ in range(32)]
    up = argparse.Namespace(model=args.model, mode=args.mode, prefill=1, decode=1, host="127.0.0.1",
                            http_port=0, grpc_port=0, redis_url=None, api_keys=None,
                            kv_backend=args.kv_backend, kv_cache_mib=256, insecure=False,
                            config=None)
    engine_model = bench_engine(args.model, worker_threads(up))
    redis, launcher = _redis(), Launcher()
    try:
        endpoints = start_fleet(up, launcher, redis.url)
        fleet, engine = asyncio.run(paired_numbers(endpoints["gateway"], engine_model, prompts,
                                                   args.repeats))
    finally:
        launcher.stop_all()
        redis.stop()
    result = {"mode": args.mode, "kv_backend": args.kv_backend, "fleet": fleet, "engine": engine,
              "added_ttft_ms": 1e3 * (fleet["ttft_s"] - engine["ttft_s"]),
              "added_per_token_ms": 1e3 * (fleet["per_token_s"] - engine["per_token_s"])}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"fleet ({args.mode}, KV over {args.kv_backend}) vs in-process engine, tiny model, "
          f"{worker_threads(up)} torch thread(s) per worker and for the engine:")
    for key, label, scale in (("ttft_s", "chat TTFT", 1e3), ("per_token_s", "time per token", 1e3)):
        print(f"  {label:<16} fleet {scale * fleet[key]:7.2f} ms   engine "
              f"{scale * engine[key]:7.2f} ms")
    print(f"  added TTFT {result['added_ttft_ms']:.2f} ms, added per token "
          f"{result['added_per_token_ms']:.2f} ms")
    print(f"  32 concurrent 200-in/64-out: fleet {fleet['concurrent_output_tokens_per_s']:.0f} "
          f"tok/s, engine {engine['concurrent_output_tokens_per_s']:.0f} tok/s")
    return 0
