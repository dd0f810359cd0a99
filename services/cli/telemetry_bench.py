"""`kvfleet bench telemetry`: what tracing at 100% sampling and metrics cost the fleet.

Two identical fleets (`kvfleet up`'s processes, each with its own redis-server) run side by side:
  off   no OTLP endpoint (tracing off) and KVFLEET_METRICS=off (every metric a no-op);
  on    every span exported over OTLP/gRPC to a receiver in this process (sampling ratio 1.0),
        metrics recorded, and every service's /metrics scraped once a second (a Prometheus
        scraping 60 times harder than its default).
Samples alternate between the two (the order flips every round), so the machine's drift lands on
both alike:
  added TTFT   one ~200-token prompt at a time, 16 tokens out: median TTFT on - median off, and
               the median of the paired differences
  tok/s        32 concurrent 200-in/64-out streams, ROUNDS rounds per side after one unmeasured
               round each: median tok/s on / off
The exporters batch as the SDK does by default (every 5 s), as a production fleet would.
Printed, never asserted; the figures live in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
import time

import httpx

from services.cli.fleet_bench import (CONCURRENT, CONCURRENT_OUTPUT, TTFT_OUTPUT, Prompts,
                                      _redis, fleet_times, up_args, write_config)
from services.telemetry.metrics import ENV_SWITCH
from services.telemetry.receiver import OtlpReceiver

ROUNDS = 5
SCRAPE_EVERY_S = 1.0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny")
    p.add_argument("--mode", default="disagg", choices=["disagg", "colocated"])
    p.add_argument("--kv-backend", default="tcp", choices=["tcp", "nixl"])
    p.add_argument("--repeats", type=int, default=40, help="lone requests per side (TTFT)")
    p.add_argument("--json", action="store_true")


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}


class Scraper:
    """Scrapes every /metrics of a fleet once a second on a thread, as Prometheus would."""

    def __init__(self, urls: list[str]) -> None:
        self.urls, self.scrapes, self.failures = urls, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.wait(SCRAPE_EVERY_S):
                for url in self.urls:
                    try:
                        client.get(url).raise_for_status()
                        self.scrapes += 1
                    except httpx.HTTPError:
                        self.failures += 1

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


async def metrics_urls(gateway: str, redis_url: str) -> list[str]:
    """The gateway's /metrics and every worker's and router's, from their Redis records."""
    from services.state.fleet_state import FleetState
    state = FleetState(redis_url)
    try:
        urls = [w.metrics_url for w in await state.live_workers() if w.metrics_url]
        urls += [s.metrics_url for s in await state.live_services() if s.metrics_url]
    finally:
        await state.close()
    return sorted({f"http://{gateway}/metrics", *urls})


async def measure(fleets: dict[str, str], prompts: Prompts, repeats: int) -> dict:
    """Alternating samples of both fleets: TTFT of lone requests, tok/s of concurrent batches."""
    limits = httpx.Limits(max_connections=CONCURRENT, max_keepalive_connections=CONCURRENT)
    clients = {name: httpx.AsyncClient(base_url=f"http://{addr}", timeout=300, limits=limits)
               for name, addr in fleets.items()}
    try:
        models = {n: (await c.get("/v1/models")).json()["data"][0]["id"] for n, c in clients.items()}
        for name, client in clients.items():         # warm-up: connections, first requests,
            await asyncio.gather(*(fleet_times(client, models[name], p, 4)     # a first batch
                                   for p in prompts.warm_up))
            await asyncio.gather(*(fleet_times(client, models[name], p, CONCURRENT_OUTPUT)
                                   for p in prompts.warm_up))
        ttft: dict[str, list[float]] = {n: [] for n in fleets}
        for i, ids in enumerate(prompts.lone[:repeats]):
            for name in (list(fleets) if i % 2 == 0 else list(reversed(fleets))):
                ttft[name].append((await fleet_times(clients[name], models[name], ids,
                                                     TTFT_OUTPUT))[0])
        tok_s: dict[str, list[float]] = {n: [] for n in fleets}
        for r in range(ROUNDS):
            for name in (list(fleets) if r % 2 == 0 else list(reversed(fleets))):
                t0 = time.perf_counter()
                runs = await asyncio.gather(*(fleet_times(clients[name], models[name], p,
                                                          CONCURRENT_OUTPUT)
                                              for p in prompts.concurrent))
                tok_s[name].append(sum(x[2] for x in runs) / (time.perf_counter() - t0))
    finally:
        await asyncio.gather(*(c.aclose() for c in clients.values()))
    return {"ttft_s": ttft, "tok_s": tok_s}


def result(samples: dict, spans: int, scrapes: int, **about) -> dict:
    ttft, tok = samples["ttft_s"], samples["tok_s"]
    off, on = statistics.median(ttft["off"]), statistics.median(ttft["on"])
    diffs = [b - a for a, b in zip(ttft["off"], ttft["on"])]
    return {"added_ttft_ms": 1e3 * (on - off),
            "paired_ttft_diff_median_ms": 1e3 * statistics.median(diffs),
            "tok_s_on_over_off": statistics.median(tok["on"]) / statistics.median(tok["off"]),
            "ttft_ms": {"off": 1e3 * off, "on": 1e3 * on},
            "tok_s": {k: statistics.median(v) for k, v in tok.items()},
            "tok_s_rounds": tok, "ttft_samples_s": ttft, "samples": len(diffs), "spans_received": spans,
            "scrapes": scrapes, **about}


def run_telemetry_bench(args: argparse.Namespace) -> int:
    from services.cli.launcher import Launcher
    from services.cli.up import start_fleet

    up = up_args(args, write_config())
    from services.engine.engine import resolve_model_dir
    from services.engine.model.config import ModelConfig
    vocab = ModelConfig.from_dir(resolve_model_dir(args.model)).vocab_size
    prompts = Prompts.draw(max(args.repeats, 1), vocab=vocab)
    with OtlpReceiver() as rx:
        envs = {"off": {**_clean_env(), ENV_SWITCH: "off"},
                "on": {**_clean_env(), **OtlpReceiver.env(rx.endpoint, 1.0, fast=False)}}
        redises = {name: _redis() for name in envs}
        launchers = {name: Launcher(env=env) for name, env in envs.items()}
        try:
            fleets = {name: start_fleet(up, launchers[name], redises[name].url)["gateway"]
                      for name in envs}
            time.sleep(1.0)                   # one heartbeat: the records name the metrics URLs
            urls = asyncio.run(metrics_urls(fleets["on"], redises["on"].url))
            with Scraper(urls) as scraper:
                samples = asyncio.run(measure(fleets, prompts, args.repeats))
        finally:
            for launcher in launchers.values():
                launcher.stop_all()
            for redis in redises.values():
                redis.stop()
        spans = len(rx.spans())
    out = result(samples, spans, scraper.scrapes, mode=args.mode, kv_backend=args.kv_backend,
                 model=args.model, metrics_urls=len(urls), scrape_failures=scraper.failures)
    print(json.dumps(out, indent=2) if args.json else render(out))
    return 0


def render(r: dict) -> str:
    return "\n".join([
        f"telemetry on (tracing 100% over OTLP, metrics scraped every {SCRAPE_EVERY_S:g} s from "
        f"{r['metrics_urls']} endpoints) vs off, {r['mode']}, model {r['model']}:",
        f"  TTFT   off {r['ttft_ms']['off']:7.2f} ms   on {r['ttft_ms']['on']:7.2f} ms   added "
        f"{r['added_ttft_ms']:.2f} ms (paired median {r['paired_ttft_diff_median_ms']:.2f} ms, "
        f"{r['samples']} pairs)",
        f"  tok/s  off {r['tok_s']['off']:.0f}   on {r['tok_s']['on']:.0f}   on/off "
        f"{r['tok_s_on_over_off']:.3f}  ({CONCURRENT} x {CONCURRENT_OUTPUT} tokens, {ROUNDS} rounds)",
        f"  {r['spans_received']} spans received, {r['scrapes']} scrapes "
        f"({r['scrape_failures']} failed)"])
