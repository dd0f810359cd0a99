"""`kvfleet status [--redis-url URL | --endpoint GATEWAY_URL] [--watch] [--json] [--prometheus-sd FILE]`:
what a fleet is made of and how loaded it is, read from Redis and the services' /metrics.

From Redis (`--redis-url`, the URL `kvfleet up` prints as `redis`):
  processes  every worker (its WorkerStats heartbeat) and every gateway and router (their
             ServiceRecord heartbeats, FleetState.live_services): role, id, address, metrics URL,
             and whether that /metrics answers now;
  workers    KV blocks used / reserved / total, sequences running and queued, the prompt backlog,
             measured prefill and decode rates (tokens/s), all from the worker's own heartbeat,
             and the age of its oldest queued request (`kvfleet_queue_age_seconds`, its /metrics);
  stage      the overload stage, the highest `kvfleet_overload_stage` of the routers' /metrics
             (overload stages are not implemented yet: S0_NORMAL until they are);
  tenants    the top tenants by share of the fleet's live sequences and KV blocks (the sum of
             every worker's WorkerStats.tenants).

`--endpoint GATEWAY_URL` reads only that gateway's /health and /metrics (its requests so far by
outcome, its streams now by tenant): the gateway does not
publish the Redis URL it uses, so the workers, routers, stage and tenants need `--redis-url`
(the output says so).

`--json` prints one JSON object (with `prometheus_targets`, every process's metrics URL);
`--prometheus-sd FILE` writes a Prometheus file_sd JSON file: one target per process, labelled
`role` and `id` (with --watch it is rewritten, atomically, at each refresh: point a
`file_sd_configs` job at it). `--watch` refreshes every 2 s until Ctrl-C.

Exit status: 0 when the fleet could be read (a process whose /metrics does not answer is shown as
such), 2 when Redis (or the gateway) cannot be reached; never a traceback for either.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb

WATCH_EVERY_S = 2.0
SCRAPE_TIMEOUT_S = 2.0
TOP_TENANTS = 5
STAGES = tuple(pb.OverloadStage.keys())     # by value: S0_NORMAL .. S4_REJECT
NEEDS_REDIS = ("workers, routers, the overload stage and tenant shares are read from Redis: pass "
               "--redis-url URL (the gateway does not publish the Redis URL it uses)")


class SourceDown(Exception):
    """The fleet's source of truth (Redis, or the gateway for --endpoint) cannot be read."""


@dataclass
class Process:
    role: str                      # gateway | router | prefill | decode | mixed
    id: str
    address: str
    metrics_url: str               # "" when the process serves none
    pid: int | None = None
    metrics: str = "none"          # ok | not answering: ... | none


@dataclass
class Worker:
    id: str
    role: str
    kv_used: int
    kv_reserved: int
    kv_total: int
    running: int
    queued: int
    queued_prefill_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    queue_age_s: float | None = None   # the oldest queued request's age (its /metrics; None: unread)


@dataclass
class Tenant:
    tenant: str
    sequences: int
    kv_blocks: int
    sequence_share: float          # of the fleet's live sequences
    kv_share: float                # of the KV blocks tenants hold


@dataclass
class FleetStatus:
    source: str                    # "redis redis://..." or "gateway http://..."
    at_unix_s: float
    processes: list[Process] = field(default_factory=list)
    workers: list[Worker] = field(default_factory=list)
    tenants: list[Tenant] = field(default_factory=list)
    stage: int | None = None       # None: unknown (no router answered)
    stage_from: str = ""
    gateway: dict | None = None    # --endpoint: its /health answer
    notes: list[str] = field(default_factory=list)

    @property
    def prometheus_targets(self) -> list[str]:
        return [p.metrics_url for p in self.processes if p.metrics_url]

    def to_json(self) -> dict:
        out = asdict(self)
        out["stage_name"] = STAGES[self.stage] if self.stage is not None else None
        out["prometheus_targets"] = self.prometheus_targets
        return out


# ---------------------------------------------------------------------------- reading
async def from_redis(redis_url: str, namespace: str, top: int = TOP_TENANTS) -> FleetStatus:
    from redis.exceptions import RedisError  # noqa: PLC0415

    from services.state.fleet_state import FleetState  # noqa: PLC0415
    try:
        state = FleetState(redis_url, namespace)
    except ValueError as e:                     # not a redis:// URL
        raise SourceDown(f"bad --redis-url {redis_url!r}: {e}") from None
    try:
        workers = await state.live_workers()
        services = await state.live_services()
    except (RedisError, OSError) as e:
        raise SourceDown(f"cannot read the fleet from Redis at {redis_url}: "
                         f"{type(e).__name__}: {e}") from None
    finally:
        await state.close()
    out = FleetStatus(f"redis {redis_url}", time.time())
    out.processes = [Process(s.role, s.service_id, s.address, s.metrics_url, s.pid or None)
                     for s in services]
    out.processes += [Process(w.role, w.worker_id, w.grpc_address, w.metrics_url) for w in workers]
    out.workers = [Worker(w.worker_id, w.role, w.kv_blocks_used, w.kv_blocks_reserved,
                          w.kv_blocks_total, w.num_running, w.num_queued, w.queued_prefill_tokens,
                          w.prefill_tokens_per_s, w.decode_tokens_per_s) for w in workers]
    out.tenants = top_tenants(workers, top)
    pages = await scrape([p.metrics_url for p in out.processes])
    for process, page in zip(out.processes, pages):
        process.metrics = page.state
    ages = {p.id: page.gauge("kvfleet_queue_age_seconds") for p, page in zip(out.processes, pages)}
    for w in out.workers:
        w.queue_age_s = ages.get(w.id)
    routers = [(p.id, page.gauge("kvfleet_overload_stage")) for p, page in
               zip(out.processes, pages) if p.role == "router"]
    known = [(stage, rid) for rid, stage in routers if stage is not None]
    if known:
        stage, out.stage_from = max(known)
        out.stage = min(int(stage), len(STAGES) - 1)
    if not workers:
        out.notes.append("no live worker in Redis (is this the fleet's Redis URL and namespace?)")
    if not routers:
        out.notes.append("no router registered in Redis: the overload stage is unknown")
    return out


def top_tenants(workers, top: int) -> list[Tenant]:
    """The `top` tenants by KV blocks (then sequences) summed over every worker's heartbeat."""
    seqs: dict[str, int] = {}
    blocks: dict[str, int] = {}
    for w in workers:
        for share in w.tenants:
            seqs[share.tenant] = seqs.get(share.tenant, 0) + share.sequences
            blocks[share.tenant] = blocks.get(share.tenant, 0) + share.kv_blocks
    total_seqs, total_blocks = sum(seqs.values()), sum(blocks.values())
    ranked = sorted(seqs, key=lambda t: (-blocks[t], -seqs[t], t))[:top]
    return [Tenant(t, seqs[t], blocks[t], seqs[t] / total_seqs if total_seqs else 0.0,
                   blocks[t] / total_blocks if total_blocks else 0.0) for t in ranked]


async def from_gateway(url: str) -> FleetStatus:
    base = url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise SourceDown(f"bad --endpoint {url!r}: want the gateway's URL, e.g. http://127.0.0.1:8000")
    async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S) as client:
        try:
            health = await client.get(f"{base}/health")
            answer = health.json()
        except (httpx.HTTPError, ValueError) as e:
            raise SourceDown(f"the gateway at {base} does not answer /health: "
                             f"{type(e).__name__}: {e}") from None
    (page,) = await scrape([f"{base}/metrics"])
    out = FleetStatus(f"gateway {base}", time.time())
    out.processes = [Process("gateway", str(answer.get("id", "gateway")), parts.netloc,
                             f"{base}/metrics", metrics=page.state)]
    out.gateway = {"http_status": health.status_code, **answer,
                   "requests": page.totals("kvfleet_requests_total", "outcome"),
                   "streaming_by_tenant": {t: n for t, n in page.totals(
                       "kvfleet_tenant_active_requests", "tenant").items() if n}}
    out.notes.append(NEEDS_REDIS)
    return out


@dataclass
class Page:
    """One scraped /metrics page: `state` says whether it answered; `families` its metrics."""
    state: str
    families: dict = field(default_factory=dict)       # name -> prometheus_client Metric

    def gauge(self, name: str) -> float | None:
        family = self.families.get(name)
        values = [s.value for s in family.samples if s.name == name] if family else []
        return max(values) if values else None

    def totals(self, sample: str, by: str) -> dict[str, float]:
        """`sample`'s values summed by the label `by` (e.g. requests by outcome)."""
        out: dict[str, float] = {}
        for family in self.families.values():
            for s in family.samples:
                if s.name == sample:
                    key = s.labels.get(by, "")
                    out[key] = out.get(key, 0.0) + s.value
        return out


async def scrape(urls: list[str]) -> list[Page]:
    async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S) as client:
        return await asyncio.gather(*(_scrape(client, u) for u in urls))


async def _scrape(client: httpx.AsyncClient, url: str) -> Page:
    if not url:
        return Page("none")
    try:
        r = await client.get(url)
        r.raise_for_status()
        families = {f.name: f for f in text_string_to_metric_families(r.text)}
    except httpx.HTTPError as e:
        return Page(f"not answering: {type(e).__name__}: {e}".rstrip(": "))
    except ValueError as e:
        return Page(f"not a Prometheus page: {e}")
    return Page("ok", families)


# ---------------------------------------------------------------------------- writing
def render(st: FleetStatus) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(st.at_unix_s))
    lines = [f"kvfleet status: {st.source} ({when})"]
    if st.gateway is not None:
        lines.append(f"gateway        {st.gateway.get('status', '?')} "
                     f"(HTTP {st.gateway['http_status']}), model {st.gateway.get('model', '?')}: "
                     f"{st.gateway.get('detail', '')}")
        done = ", ".join(f"{k} {v:.0f}" for k, v in sorted(st.gateway["requests"].items()))
        streaming = st.gateway["streaming_by_tenant"]
        lines.append(f"requests       {done or 'none yet'}; streaming now "
                     f"{sum(streaming.values()):.0f}"
                     + (" (" + ", ".join(f"{t} {n:.0f}" for t, n in sorted(streaming.items())) + ")"
                        if streaming else ""))
    else:
        stage = (f"{STAGES[st.stage]} (from {st.stage_from}'s /metrics)" if st.stage is not None
                 else "unknown (no router's /metrics answered)")
        lines.append(f"overload stage {stage}")
    lines += ["", "PROCESSES"]
    lines += _table(["ROLE", "ID", "ADDRESS", "PID", "METRICS URL", "METRICS"],
                    [[p.role, p.id, p.address, p.pid or "-", p.metrics_url or "-", p.metrics]
                     for p in sorted(st.processes, key=_process_order)])
    if st.workers:
        lines += ["", "WORKERS (KV in blocks; rates are measured tokens/s)"]
        lines += _table(["ID", "ROLE", "KV USED", "RESERVED", "TOTAL", "RUNNING", "QUEUED",
                         "QUEUE AGE S", "BACKLOG TOK", "PREFILL TOK/S", "DECODE TOK/S"],
                        [[w.id, w.role, w.kv_used, w.kv_reserved, w.kv_total, w.running, w.queued,
                          "-" if w.queue_age_s is None else f"{w.queue_age_s:.2f}",
                          w.queued_prefill_tokens, _rate(w.prefill_tokens_per_s),
                          _rate(w.decode_tokens_per_s)]
                         for w in sorted(st.workers, key=_process_order)])
    if st.gateway is None:
        lines += ["", "TENANTS (top by KV; shares of the fleet's live sequences and KV)"]
        lines += (_table(["TENANT", "SEQUENCES", "SEQ SHARE", "KV BLOCKS", "KV SHARE"],
                         [[t.tenant, t.sequences, f"{t.sequence_share:.0%}", t.kv_blocks,
                           f"{t.kv_share:.0%}"] for t in st.tenants])
                  if st.tenants else ["  (no live sequences)"])
    lines += [f"note: {n}" for n in st.notes]
    return "\n".join(lines)


_ROLE_ORDER = {"gateway": 0, "router": 1, "prefill": 2, "decode": 3, "mixed": 4}


def _process_order(p: Process):
    return _ROLE_ORDER.get(p.role, 9), p.id


def _rate(x: float) -> str:
    return f"{x:.0f}" if x > 0 and math.isfinite(x) else "-"


def _table(header: list[str], rows: list[list]) -> list[str]:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]


def file_sd(st: FleetStatus) -> list[dict]:
    """Prometheus file_sd: one target group per process that serves /metrics."""
    groups = []
    for p in sorted(st.processes, key=_process_order):
        if not p.metrics_url:
            continue
        url = urlsplit(p.metrics_url)
        groups.append({"targets": [url.netloc],
                       "labels": {"role": p.role, "id": p.id, "__metrics_path__": url.path or "/metrics",
                                  "__scheme__": url.scheme or "http"}})
    return groups


def write_file_sd(path: str, st: FleetStatus) -> None:
    """Written whole, then renamed into place: Prometheus never reads half a file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(file_sd(st), f, indent=2)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- command
def add_status_args(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--redis-url", help="the fleet's Redis (what `kvfleet up` prints as redis)")
    where.add_argument("--endpoint", metavar="GATEWAY_URL",
                       help="a gateway's URL: its /health and /metrics only (" + NEEDS_REDIS + ")")
    p.add_argument("--namespace", default="kvfleet:", help="the fleet's Redis key namespace")
    p.add_argument("--watch", action="store_true", help=f"refresh every {WATCH_EVERY_S:g} s until Ctrl-C")
    p.add_argument("--json", action="store_true", help="one JSON object (one per line with --watch)")
    p.add_argument("--prometheus-sd", metavar="FILE",
                   help="write a Prometheus file_sd JSON file: every process's /metrics target, "
                        "labelled role and id")
    p.add_argument("--top", type=int, default=TOP_TENANTS, help="tenants listed")


async def collect(args: argparse.Namespace) -> FleetStatus:
    if args.endpoint:
        return await from_gateway(args.endpoint)
    return await from_redis(args.redis_url, args.namespace, args.top)


def show_once(args: argparse.Namespace) -> int:
    try:
        st = asyncio.run(collect(args))
    except SourceDown as e:
        if args.json:
            print(json.dumps({"error": str(e)}), flush=True)
        print(f"kvfleet status: {e}", file=sys.stderr, flush=True)
        return 2
    if args.prometheus_sd:
        write_file_sd(args.prometheus_sd, st)
    if args.json:
        print(json.dumps(st.to_json(), indent=None if args.watch else 2), flush=True)
    else:
        print(render(st), flush=True)
    return 0


def run_status(args: argparse.Namespace) -> int:
    if not (args.redis_url or args.endpoint):
        print("kvfleet status: say where the fleet is: --redis-url URL (the `redis` line "
              "`kvfleet up` prints) or --endpoint GATEWAY_URL", file=sys.stderr)
        return 2
    if not args.watch:
        return show_once(args)
    clear = sys.stdout.isatty() and not args.json
    try:
        while True:
            if clear:
                print("\033[H\033[J", end="")
            show_once(args)
            time.sleep(WATCH_EVERY_S)
    except KeyboardInterrupt:
        return 0
