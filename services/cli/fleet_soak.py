"""`kvfleet bench soak`: a supervised fleet (`kvfleet up`) under closed-loop load for minutes, with
clients that go away at every phase, then a check that nothing leaked (slots, blocks, streams).

  load        --clients closed-loop clients; each request a ~200-token chat, or (--doc-share) a
              4-8K-token document; streamed; output 16-128 tokens
  disconnects --disconnect-share of requests are dropped by their client: before any answer (while
              queued or prefilling), right at the first token (during the KV transfer), or mid-stream
  report      completed / refused by status and code / error events / dropped by phase; TTFT and
              ITL p50/p99 of completed chats; RSS of every fleet process at the first and the
              last minute; after the load, once quiet: KV blocks used and reserved, requests
              running or queued on every worker, and the tenants' open stream slots (all 0)
Prints one JSON report; asserts nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
import httpx
import redis

from services.engine.config import KV_CACHE_MIB
from services.protocol.fleet_token import METADATA_KEY, generate
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc


def add_soak_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny")
    p.add_argument("--mode", choices=["disagg", "colocated"], default="disagg")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--doc-share", type=float, default=0.1, help="requests that are 4-8K documents")
    p.add_argument("--disconnect-share", type=float, default=0.3)
    p.add_argument("--kv-cache-mib", type=int, default=KV_CACHE_MIB)
    p.add_argument("--seed", type=int, default=0)


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    samples: dict[str, str] = field(default_factory=dict)   # outcome -> one message


async def request(client: httpx.AsyncClient, model: str, rng: random.Random, share: float,
                  drop: float, tally: Tally) -> None:
    doc = rng.random() < share
    ids = [rng.randrange(100, 4000) for _ in range(rng.randrange(4096, 8192) if doc else 200)]
    body = {"model": model, "prompt": ids, "max_tokens": rng.randrange(16, 129), "stream": True,
            "ignore_eos": True, "temperature": 0}
    phase = rng.choice(["queued", "first_token", "mid_stream"]) if rng.random() < drop else None
    try:
        outcome = await asyncio.wait_for(_stream(client, body, phase, doc, rng, tally),
                                         rng.uniform(0.05, 1.5) if phase == "queued" else None)
    except asyncio.TimeoutError:
        outcome = "dropped:queued"
    tally.outcomes[outcome] += 1


async def _stream(client, body, phase, doc, rng, tally) -> str:
    started = last = time.perf_counter()
    tokens, stop_at = 0, rng.randrange(2, 12)
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            error = json.loads(await r.aread()).get("error", {})
            key = f"refused:{r.status_code} {error.get('code')}"
            tally.samples.setdefault(key, f"{error.get('message', '')[:160]} (Retry-After "
                                          f"{r.headers.get('retry-after')})")
            return key
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                tally.samples.setdefault("error_event", str(event["error"].get("message"))[:160])
                return "error_event"
            if not event.get("choices") or not event["choices"][0].get("text"):
                continue
            now = time.perf_counter()
            if tokens == 0 and not doc:
                tally.ttfts.append(now - started)
            elif not doc:
                tally.itls.append(now - last)
            last, tokens = now, tokens + 1
            if phase == "first_token" or (phase == "mid_stream" and tokens >= stop_at):
                return f"dropped:{phase}"         # leaving the block closes the connection
    return "completed"


async def client_loop(client, model, deadline, seed, args, tally) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        try:
            await request(client, model, rng, args.doc_share, args.disconnect_share, tally)
        except httpx.HTTPError as e:
            tally.outcomes[f"transport:{type(e).__name__}"] += 1


def rss_mib(pids: list[int]) -> dict[str, float]:
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            with open(f"/proc/{pid}/status") as f:
                kb = next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
        name = _name(args)
        out[name] = round(kb / 1024, 1)
    return out


def _name(args: list[bytes]) -> str:
    text = [a.decode() for a in args]
    if "--worker-id" in text:
        return text[text.index("--worker-id") + 1]
    return next((a.split(".")[-1] for a in text if a in ("services.router", "services.gateway")),
                " ".join(text)[:40])


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def leaks(workers: dict[str, str], redis_url: str, token: str) -> dict:
    """What the fleet still holds once the load is over: all 0 when nothing leaked."""
    held = {}
    for name, address in workers.items():
        with grpc.insecure_channel(address) as ch:
            s = pb_grpc.WorkerStub(ch).Stats(pb.StatsRequest(), timeout=10,
                                             metadata=((METADATA_KEY, token),))
        held[name] = {"kv_blocks_used": s.kv_blocks_used, "kv_blocks_reserved": s.kv_blocks_reserved,
                      "running": s.num_running, "queued": s.num_queued,
                      "kv_writes_in_flight": s.kv_writes_in_flight}
    r = redis.Redis.from_url(redis_url)
    try:
        now_ms = int(time.time() * 1000)
        held["open_stream_slots"] = sum(r.zcount(k, f"({now_ms}", "+inf")
                                        for k in r.scan_iter(match="kvfleet:tenant:*:leases"))
    finally:
        r.close()
    return held


def pct(xs: list[float], p: float) -> float | None:
    return round(sorted(xs)[min(len(xs) - 1, int(p / 100 * len(xs)))], 4) if xs else None


async def soak(args: argparse.Namespace, http: str, workers: dict[str, str], up_pid: int,
               redis_url: str, token: str) -> dict:
    tally = Tally()
    async with httpx.AsyncClient(base_url=f"http://{http}", timeout=120,
                                 limits=httpx.Limits(max_connections=args.clients + 4)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        deadline = time.monotonic() + args.duration
        loops = asyncio.gather(*(client_loop(client, model, deadline, args.seed * 1000 + i, args,
                                             tally) for i in range(args.clients)))
        await asyncio.sleep(min(60.0, args.duration / 2))
        rss_first = rss_mib(children(up_pid))
        await loops
    rss_last = rss_mib(children(up_pid))
    quiet_by = time.monotonic() + 30              # leases of dropped streams end with them
    while True:
        held = leaks(workers, redis_url, token)
        clean = held["open_stream_slots"] == 0 and all(
            not any(v.values()) for k, v in held.items() if isinstance(v, dict))
        if clean or time.monotonic() > quiet_by:
            break
        await asyncio.sleep(0.5)
    return {"duration_s": args.duration, "clients": args.clients,
            "requests": sum(tally.outcomes.values()), "outcomes": dict(tally.outcomes),
            "samples": tally.samples, "chat_ttft_p50_s": pct(tally.ttfts, 50),
            "chat_ttft_p99_s": pct(tally.ttfts, 99), "chat_itl_p50_s": pct(tally.itls, 50),
            "chat_itl_p99_s": pct(tally.itls, 99), "rss_mib_first_minute": rss_first,
            "rss_mib_end": rss_last, "held_after": held, "leaked": not clean}


def run_soak(args: argparse.Namespace) -> int:
    from loadtests.local_fleet import kvfleet_up  # noqa: PLC0415
    token = generate()
    with kvfleet_up(args.model, mode=args.mode, kv_cache_mib=args.kv_cache_mib,
                    token=token) as up:
        workers = {name: w.address for name, w in up.workers.items()}
        try:
            report = asyncio.run(soak(args, up.http, workers, up.proc.pid, up.redis_url, token))
        finally:
            banner = next(i for i, line in enumerate(up.lines) if line.startswith("READY"))
            print(*up.lines[banner + 1:], sep="\n", file=sys.stderr)   # the supervisor's lines
    print(json.dumps(report, indent=1))
    return 1 if report["leaked"] else 0