"""`kvfleet demo --fleet` (what `make demo` runs): `kvfleet up` on the tiny model, then a short
open-loop mixed run through the OpenAI REST API: ~200-token chats from three tenants and a few
long documents from a fourth, streamed over SSE. Prints TTFT and ITL p50/p99 per class, then
stops the fleet cleanly.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import yaml

from services.cli.launcher import Launcher
from services.state.redis_server import EmbeddedRedis
from services.cli.up import start_fleet
from services.cli.engine_demo import pct
from services.engine.workload import mixed_workload

TENANTS = {"acme": "interactive", "globex": "interactive", "initech": "interactive",
           "docs": "document"}


def write_configs(tmp: Path) -> tuple[str, str]:
    """An engine config naming the tenants, and one API key per tenant."""
    engine = {"scheduler": {"token_budget": 256, "chunk_size": 128, "reject_late": False,
                            "default_tenant": "acme",
                            "tenants": [{"name": t, "classes": [c]} for t, c in TENANTS.items()]}}
    keys = [{"key": f"sk-demo-{t}", "tenant": t, "traffic_class": c, "max_concurrent_streams": 64,
             "requests_per_minute": 10_000, "tokens_per_minute": 10_000_000}
            for t, c in TENANTS.items()]
    (tmp / "engine.yaml").write_text(yaml.safe_dump(engine))
    (tmp / "keys.yaml").write_text(yaml.safe_dump(keys))
    return str(tmp / "engine.yaml"), str(tmp / "keys.yaml")


class StreamError(RuntimeError):
    """A generation answered something other than 200 (the status and the start of the body)."""


async def sse_events(client: httpx.AsyncClient, path: str, body: dict,
                     headers: dict[str, str] | None = None) -> AsyncIterator[tuple[float, dict]]:
    """POST `body` on `client` (its connections kept alive between requests, as the OpenAI client
    does); yield (seconds since the send, event) per SSE `data:` event until [DONE]."""
    t0 = time.perf_counter()
    async with client.stream("POST", path, json=body, headers=headers) as r:
        if r.status_code != 200:
            raise StreamError(f"HTTP {r.status_code}: {(await r.aread())[:300].decode(errors='replace')}")
        async for line in r.aiter_lines():
            if line.startswith("data: [DONE]"):
                return
            if line.startswith("data: "):
                yield time.perf_counter() - t0, json.loads(line[6:])


async def one_request(client: httpx.AsyncClient, model: str, arrival, start: float) -> dict:
    await asyncio.sleep(max(0.0, start + arrival.at_s - time.perf_counter()))
    sent = time.perf_counter()
    times, status = [], 200
    body = {"model": model, "prompt": arrival.prompt_ids, "max_tokens": arrival.max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer sk-demo-{arrival.tenant}"}
    try:
        async for _, event in sse_events(client, "/v1/completions", body, headers):
            if event.get("choices"):
                times.append(time.perf_counter())
    except (StreamError, httpx.HTTPError):
        status = 500
    return {"cls": arrival.traffic_class, "sent": sent, "times": times, "status": status}


def report(results: list[dict]) -> None:
    by = defaultdict(list)
    for r in results:
        by[r["cls"]].append(r)
    print(f"\n{'class':<12}{'reqs':>5}{'errors':>7}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'ITL p50':>9}{'ITL p99':>9}")
    for cls, rs in sorted(by.items()):
        ok = [r for r in rs if r["status"] == 200 and r["times"]]
        ttft = [r["times"][0] - r["sent"] for r in ok]
        itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
        print(f"{cls:<12}{len(rs):>5}{len(rs) - len(ok):>7}{1e3 * pct(ttft, 50):>8.0f}ms"
              f"{1e3 * pct(ttft, 99):>8.0f}ms{1e3 * pct(itl, 50):>7.1f}ms{1e3 * pct(itl, 99):>7.1f}ms")


async def drive(address: str, arrivals) -> list[dict]:
    limits = httpx.Limits(max_connections=len(arrivals) + 1, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=f"http://{address}", timeout=300, limits=limits) as client:
        model = (await client.get("/v1/models", headers={
            "Authorization": "Bearer sk-demo-acme"})).json()["data"][0]["id"]
        start = time.perf_counter()
        return await asyncio.gather(*(one_request(client, model, a, start) for a in arrivals))


def run_fleet_demo(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="kvfleet-demo-"))
    engine_yaml, keys_yaml = write_configs(tmp)
    up = argparse.Namespace(model=args.model, mode=args.mode, prefill=1, decode=1,
                            host="127.0.0.1", http_port=0, grpc_port=0, redis_url=None,
                            api_keys=keys_yaml, kv_backend="tcp", kv_cache_mib=256,
                            insecure=False, config=engine_yaml)
    redis, launcher = EmbeddedRedis().start(), Launcher()
    try:
        endpoints = start_fleet(up, launcher, redis.url)
        print(f"kvfleet up ({args.mode}): gateway http://{endpoints['gateway']}/v1; "
              f"{len(launcher.children)} processes ({', '.join(launcher.children)})")
        rng = random.Random(args.seed)
        arrivals = [a for a in mixed_workload(
            vocab=4096, chats=args.chats, documents=args.documents, doc_tokens=args.doc_tokens,
            rate=args.rate, tenants=["acme", "globex", "initech"], seed=rng.randrange(1 << 30))]
        print(f"{args.chats} chats (~200-token prompts, 64 tokens out) + {args.documents} documents "
              f"of {args.doc_tokens} tokens, Poisson {args.rate}/s, streamed over SSE")
        t0 = time.perf_counter()
        results = asyncio.run(drive(endpoints["gateway"], arrivals))
        report(results)
        print(f"\nwall time {time.perf_counter() - t0:.1f}s")
        return 0 if all(r["status"] == 200 for r in results) else 1
    finally:
        launcher.stop_all()
        redis.stop()
        print("fleet stopped: every process it started has exited")
