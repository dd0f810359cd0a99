"""`kvfleet rebalance [--dry-run | --apply | --advisory] --target local --redis-url URL [--json]`:
how many replicas each pool of a running fleet should have, from what it measured.

Measured over `--window-s` (services/planner/rebalance.py decides on it):
  replicas     the fleet's primary-pool workers by role (their Redis records); only the workers
               present at both ends of the window count (one that started inside it is warming up)
  busy_s       each counted worker's `kvfleet_busy_seconds_total` (its /metrics, every phase)
               at the window's end less at its start; a decode pool's weighted by its steps'
               share of the ITL target (`kvfleet_iteration_tokens_count{phase="decode"}` steps;
               services/planner/rebalance.py, decode_work_s)
  tails        TTFT p99 (`gen_ai_server_time_to_first_token_seconds`) and ITL p99
               (`kvfleet_inter_token_latency_seconds`) of the window by traffic class, from the
               gateways' /metrics histograms (the bucket counts' growth, interpolated inside the
               bucket); each class against its own target (the engine config's, `--config`, else
               DESIGN section 2's), the worst class's p99 / target is what the policy weighs.
               `--ttft-p99-s` / `--itl-p99-s` put every class on one target instead

Modes:
  --dry-run    (default) print the recommendation; change nothing
  --apply      and carry it out: `--target local` queues orders to the `kvfleet up` that serves
               this Redis (services/cli/fleet_orders.py: add a worker, drain one), waits for each
               to be taken (`--wait-s`), and records the change's time in Redis for the cool-down
  --advisory   keep deciding, every window, until stopped (or `--decisions N`); change nothing;
               export the recommendation as Prometheus metrics on 127.0.0.1:--metrics-port
               (`kvfleet_rebalance_replicas{pool,kind="current"|"recommended"}`,
               `kvfleet_rebalance_decision_info{pool,reason}`, `kvfleet_rebalance_utilization`)
Every decision, in every mode, is appended to the JSONL audit log (`--audit-log`).
`--replicas POOL=N` (repeatable) sets a pool's size by hand instead of the policy (reason
`manual`): the budget, the step limit and the audit log still apply.

Targets of --apply:
  local        a running `kvfleet up` (orders through its Redis, services/cli/fleet_orders.py)
  ray          a running `kvfleet up --ray`: the same orders; it adds a worker actor, or drains
               one (SIGUSR1: NOT_SERVING, out of Redis, finishes what it holds) then kills it
               (services/cli/ray_fleet.py). Each refuses a fleet that runs its workers the
               other way
  kubernetes   the chart's pools: a JSON merge patch of each changed pool's `spec.replicas`
               (services/planner/rebalance_k8s.py); `--dry-run` prints the requests it would send
Exit status: 0 done (whatever was recommended), 1 an order was refused or not taken in time,
2 bad arguments or an unreachable fleet.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.planner import rebalance_k8s
from services.planner.rebalance import (POOLS, Decision, Outcome, PoolWindow, RebalanceConfig,
                                        RebalanceState, Reason, decide, decode_work_s)

SCRAPE_TIMEOUT_S = 2.0
TTFT = "gen_ai_server_time_to_first_token_seconds"
ITL = "kvfleet_inter_token_latency_seconds"
BUSY = "kvfleet_busy_seconds"
STEPS = "kvfleet_iteration_tokens"
NAMESPACE = "kvfleet:"


def add_args(p: argparse.ArgumentParser) -> None:
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the recommendation (default)")
    mode.add_argument("--apply", action="store_true", help="carry the recommendation out")
    mode.add_argument("--advisory", action="store_true",
                      help="decide every window until stopped; export it as metrics only")
    p.add_argument("--target", choices=["local", "kubernetes", "ray"], default="local",
                   help="where --apply acts: local (a running kvfleet up), ray (a running "
                        "kvfleet up --ray: actors added or drained), kubernetes (the chart's "
                        "pool workloads' spec.replicas, through the API server)")
    kube = p.add_argument_group("--target kubernetes")
    kube.add_argument("--release", default=None,
                      help="the Helm release the fleet was installed as (its workloads are "
                           "<release>-kvfleet-<pool>)")
    kube.add_argument("--namespace", default=None,
                      help="the release's namespace (default: the pod's own, else the "
                           "kubeconfig context's, else default)")
    kube.add_argument("--kubeconfig", default=None,
                      help="credentials (default: the pod's service account, else $KUBECONFIG, "
                           "else ~/.kube/config)")
    kube.add_argument("--kube-kind", choices=sorted(rebalance_k8s.KINDS), default="Deployment",
                      help="the pools' workload kind: Deployment (default), or LeaderWorkerSet "
                           "when the chart spans a worker's tensor parallelism over nodes")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379",
                   help="the fleet's Redis (kvfleet up prints it); credentials as kvfleet status")
    p.add_argument("--json", action="store_true", help="print each decision as one JSON object")
    p.add_argument("--window-s", type=float, default=30.0, help="the measuring window (default 30)")
    p.add_argument("--target-utilization", type=float, default=RebalanceConfig.target_utilization)
    p.add_argument("--band", type=float, default=RebalanceConfig.band,
                   help="hysteresis: no move while |utilization - target| <= band")
    p.add_argument("--cooldown-s", type=float, default=RebalanceConfig.cooldown_s)
    p.add_argument("--budget", type=int, default=None,
                   help="most replicas, all pools together (default: the fleet's size now: "
                        "replicas move between pools, the fleet does not grow)")
    p.add_argument("--down-windows", type=int, default=None,
                   help="low windows in a row before a pool shrinks (default: 1 for one "
                        "decision, --dry-run / --apply; 3 for --advisory)")
    p.add_argument("--ttft-p99-s", type=float, default=None,
                   help="one TTFT p99 target for every class (default: each class's own)")
    p.add_argument("--itl-p99-s", type=float, default=None,
                   help="one ITL p99 target for every class (default: each class's own)")
    p.add_argument("--config", default=None,
                   help="the fleet's engine config YAML (its classes' targets), as kvfleet up's")
    p.add_argument("--replicas", action="append", default=[], metavar="POOL=N",
                   help="set a pool's size by hand instead of the policy (repeatable)")
    p.add_argument("--audit-log", default="rebalance-audit.jsonl", metavar="FILE",
                   help="every decision is appended here as one JSON line")
    p.add_argument("--wait-s", type=float, default=120.0,
                   help="--apply: how long to wait for kvfleet up to take each order")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="--advisory: the /metrics port on 127.0.0.1 (default: a free one)")
    p.add_argument("--decisions", type=int, default=None,
                   help="--advisory: stop after this many decisions (default: until stopped)")


# ------------------------------------------------------------------------------ measuring
@dataclass(frozen=True)
class Snapshot:
    at_s: float
    workers: dict[str, tuple[str, float, float]]   # worker id -> (role, busy s, decode steps)
    ttft: dict[str, dict[float, float]]            # class -> le -> cumulative count, all gateways
    itl: dict[str, dict[float, float]]


@dataclass(frozen=True)
class Targets:
    """Each class's p99 targets, and the units the policy's config compares the worst ratio in."""
    ttft: dict[str, float]
    itl: dict[str, float]
    unit_ttft_s: float = RebalanceConfig.ttft_p99_target_s
    unit_itl_s: float = RebalanceConfig.itl_p99_target_s

    def worst(self, before: dict[str, dict[float, float]], after: dict[str, dict[float, float]],
              targets: dict[str, float], unit_s: float) -> float | None:
        """The worst class's p99 over its target, times `unit_s` (None: no sample; a class with
        no target of its own is held to `unit_s`; one with an infinite target is not held)."""
        ratios = []
        for cls, buckets in after.items():
            q = p99(before.get(cls, {}), buckets)
            target = targets.get(cls, unit_s)
            if q is not None and math.isfinite(target) and target > 0:
                ratios.append(q / target)
        return max(ratios) * unit_s if ratios else None


def _families(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        out.setdefault(family.name, []).extend(family.samples)
    return out


def _buckets(families: dict[str, list], name: str, into: dict[str, dict[float, float]]) -> None:
    for sample in families.get(name, []):
        if sample.name == name + "_bucket":
            le = float(sample.labels["le"])
            per = into.setdefault(sample.labels.get("traffic_class", ""), {})
            per[le] = per.get(le, 0.0) + sample.value


async def snapshot(redis_url: str) -> Snapshot:
    from services.state.fleet_state import FleetState  # noqa: PLC0415
    state = FleetState(redis_url, NAMESPACE)
    try:
        workers = [w for w in await state.live_workers() if w.pool in ("", "primary")]
        gateways = await state.live_services("gateway")
    finally:
        await state.close()
    async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S) as client:
        async def page(url: str) -> dict[str, list]:
            try:
                return _families((await client.get(url)).text) if url else {}
            except (httpx.HTTPError, ValueError):
                return {}
        pages = await asyncio.gather(*(page(w.metrics_url) for w in workers))
        gw_pages = await asyncio.gather(*(page(g.metrics_url) for g in gateways))
    busy = {w.worker_id: (w.role, sum(s.value for s in p.get(BUSY, [])
                                      if s.name == BUSY + "_total"),
                          sum(s.value for s in p.get(STEPS, []) if s.name == STEPS + "_count"
                              and s.labels.get("phase") == "decode"))
            for w, p in zip(workers, pages) if p}
    ttft: dict[str, dict[float, float]] = {}
    itl: dict[str, dict[float, float]] = {}
    for p in gw_pages:
        _buckets(p, TTFT, ttft)
        _buckets(p, ITL, itl)
    return Snapshot(time.monotonic(), busy, ttft, itl)


def p99(before: dict[float, float], after: dict[float, float]) -> float | None:
    """The 0.99 quantile of what a histogram gained between two scrapes (None: nothing)."""
    grown = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = grown[-1][1] if grown else 0.0
    if total <= 0:
        return None
    rank, prev_le, prev_n = 0.99 * total, 0.0, 0.0
    for le, n in grown:
        if n >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_n) / max(n - prev_n, 1e-12)
        prev_le, prev_n = le, n
    return prev_le


def windows_of(a: Snapshot, b: Snapshot, targets: Targets) -> dict[str, PoolWindow]:
    """Each pool's window between two snapshots (only workers present in both count)."""
    span = max(b.at_s - a.at_s, 1e-6)
    ttft = targets.worst(a.ttft, b.ttft, targets.ttft, targets.unit_ttft_s)
    itl = targets.worst(a.itl, b.itl, targets.itl, targets.unit_itl_s)
    finite_itl = [t for t in targets.itl.values() if math.isfinite(t) and t > 0]
    itl_target_s = min(finite_itl, default=targets.unit_itl_s)
    roles = {x[0] for x in b.workers.values()} | {x[0] for x in a.workers.values()}
    out = {}
    for role in sorted(roles & set(POOLS)):
        both = [w for w, x in b.workers.items() if x[0] == role and w in a.workers]
        busy = sum(max(0.0, b.workers[w][1] - a.workers[w][1]) for w in both)
        if role == "decode":
            steps = sum(max(0.0, b.workers[w][2] - a.workers[w][2]) for w in both)
            busy = decode_work_s(busy, int(steps), itl_target_s)
        out[role] = PoolWindow(len(both), busy, span, ttft_p99_s=ttft, itl_p99_s=itl)
    return out


async def measure(redis_url: str, window_s: float, targets: Targets) -> dict[str, PoolWindow]:
    first = await snapshot(redis_url)
    await asyncio.sleep(window_s)
    return windows_of(first, await snapshot(redis_url), targets)


def targets_of(args: argparse.Namespace) -> Targets:
    """Each class's targets: --ttft-p99-s / --itl-p99-s for all, else the engine config's."""
    from services.engine.config import EngineConfig  # noqa: PLC0415
    from services.engine.config_file import load_engine_config  # noqa: PLC0415
    classes = (load_engine_config(args.config) if args.config else EngineConfig()).scheduler.classes
    ttft = {c.name: args.ttft_p99_s or c.ttft_target_s for c in classes}
    itl = {c.name: args.itl_p99_s or c.itl_target_s for c in classes}
    return Targets(ttft, itl, args.ttft_p99_s or RebalanceConfig.ttft_p99_target_s,
                   args.itl_p99_s or RebalanceConfig.itl_p99_target_s)


# ------------------------------------------------------------------------------ deciding
def config_of(args: argparse.Namespace, windows: dict[str, PoolWindow]) -> RebalanceConfig:
    budget = args.budget if args.budget is not None else sum(w.replicas for w in windows.values())
    down = args.down_windows or (3 if args.advisory else 1)
    return RebalanceConfig(target_utilization=args.target_utilization, band=args.band,
                           cooldown_s=args.cooldown_s, budget=max(1, budget), down_windows=down,
                           ttft_p99_target_s=args.ttft_p99_s or RebalanceConfig.ttft_p99_target_s,
                           itl_p99_target_s=args.itl_p99_s or RebalanceConfig.itl_p99_target_s)


def manual_sizes(specs: list[str]) -> dict[str, int]:
    out = {}
    for spec in specs:
        pool, _, n = spec.partition("=")
        if pool not in POOLS or not n.isdigit() or int(n) < 1:
            raise ValueError(f"--replicas {spec!r}: expected POOL=N, POOL one of {POOLS}, N >= 1")
        out[pool] = int(n)
    return out


def manual(windows: dict[str, PoolWindow], sizes: dict[str, int], cfg: RebalanceConfig,
           now_s: float, state: RebalanceState) -> Outcome:
    """The sizes given by hand, one step at most, within the budget."""
    missing = set(sizes) - set(windows)
    if missing:
        raise ValueError(f"--replicas names pools this fleet has none of: {sorted(missing)}")
    rec = {p: w.replicas for p, w in windows.items()}
    for p, n in sizes.items():
        step = cfg.max_step(rec[p])
        rec[p] = max(rec[p] - step, min(rec[p] + step, n))
    while sum(rec.values()) > max(cfg.budget, sum(w.replicas for w in windows.values())):
        grown = max((p for p in rec if rec[p] > windows[p].replicas), key=rec.get)
        rec[grown] -= 1
    decisions = tuple(Decision(p, w.replicas, rec[p], Reason.MANUAL, w.utilization, w.demand)
                      for p, w in sorted(windows.items()))
    changed = any(d.delta for d in decisions)
    return Outcome(decisions, RebalanceState(now_s if changed else state.last_change_s), now_s)


def record(outcome: Outcome, mode: str, cfg: RebalanceConfig, windows: dict[str, PoolWindow],
           applied: list[dict] | None = None) -> dict:
    return {"at_unix_s": round(time.time(), 3), "mode": mode, "changed": outcome.changed,
            "decisions": [d.as_dict() for d in outcome.decisions],
            "window_s": round(next(iter(windows.values())).window_s, 3) if windows else None,
            "ttft_p99_s": next((w.ttft_p99_s for w in windows.values()), None),
            "itl_p99_s": next((w.itl_p99_s for w in windows.values()), None),
            "config": {"target_utilization": cfg.target_utilization, "band": cfg.band,
                       "cooldown_s": cfg.cooldown_s, "budget": cfg.budget,
                       "ttft_p99_target_s": cfg.ttft_p99_target_s,
                       "itl_p99_target_s": cfg.itl_p99_target_s,
                       "down_windows": cfg.down_windows},
            **({"orders": applied} if applied is not None else {})}


def append_audit(path: str, line: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(line, sort_keys=True) + "\n")


def show(line: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(line), flush=True)
        return
    for d in line["decisions"]:
        arrow = "=" if d["recommended"] == d["current"] else "->"
        print(f"{d['pool']:<8} {d['current']:>3} {arrow} {d['recommended']:<3} "
              f"utilization {d['utilization']:.2f}  reason {d['reason']}")
    for o in line.get("orders", []):
        print(f"  order {o['action']} {o['role']}: {o['detail']}")
    print(f"(audit: {line['mode']}, changed={line['changed']})", flush=True)


# ------------------------------------------------------------------------------ applying
def apply_local(redis_url: str, outcome: Outcome, wait_s: float) -> tuple[list[dict], bool]:
    """Queue an add or drain order per replica of difference and wait for kvfleet up to take each
    (and for an added worker to serve). Returns (what each order did, all ok)."""
    import redis as redis_sync  # noqa: PLC0415

    from services.cli import fleet_orders as fo  # noqa: PLC0415
    from services.state.records import RecordSeal  # noqa: PLC0415
    from services.state.redis_auth import RedisCredentials  # noqa: PLC0415
    client = redis_sync.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0,
                                       **RedisCredentials.from_env().client_kwargs())
    seal = RecordSeal.from_env()
    orders = [fo.FleetOrder.new(fo.Action.ADD if d.delta > 0 else fo.Action.DRAIN, d.pool)
              for d in outcome.decisions for _ in range(abs(d.delta))]
    try:
        for order in orders:
            fo.give(client, NAMESPACE, order, seal)
        fo.mark_change(client, NAMESPACE)
        done, ok = [], True
        deadline = time.monotonic() + wait_s
        for order in orders:
            result = None
            while result is None and time.monotonic() < deadline:
                result = fo.result_of(client, NAMESPACE, order.order_id, seal)
                if result is None:
                    time.sleep(0.1)
            if result is not None and result.accepted and order.action is fo.Action.ADD:
                serving = asyncio.run(_wait_serving(redis_url, result.worker_id, deadline))
                result = replace(result, detail=result.detail + (
                    ", serving" if serving else ", not serving yet"))
                ok &= serving
            ok &= result is not None and result.accepted
            done.append({"action": order.action.value, "role": order.role,
                         "order_id": order.order_id,
                         "worker_id": result.worker_id if result else None,
                         "accepted": bool(result and result.accepted),
                         "detail": result.detail if result else
                         f"not taken within {wait_s:g} s (is kvfleet up serving this Redis?)"})
        return done, ok
    finally:
        client.close()


async def _wait_serving(redis_url: str, worker_id: str, deadline: float) -> bool:
    from services.state.fleet_state import FleetState  # noqa: PLC0415
    state = FleetState(redis_url, NAMESPACE)
    try:
        while time.monotonic() < deadline:
            if any(w.worker_id == worker_id for w in await state.live_workers()):
                return True
            await asyncio.sleep(0.2)
        return False
    finally:
        await state.close()


def last_change_s(redis_url: str) -> float | None:
    """The last applied change, on this process's monotonic clock (the cool-down's state)."""
    import redis as redis_sync  # noqa: PLC0415

    from services.cli import fleet_orders as fo  # noqa: PLC0415
    from services.state.redis_auth import RedisCredentials  # noqa: PLC0415
    client = redis_sync.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0,
                                       **RedisCredentials.from_env().client_kwargs())
    try:
        unix = fo.last_change(client, NAMESPACE)
    finally:
        client.close()
    return None if unix is None else time.monotonic() - (time.time() - unix)


# ------------------------------------------------------------------------------ advisory
class Exported:
    """The advisory mode's metrics (its own registry)."""

    def __init__(self, port: int) -> None:
        from prometheus_client import CollectorRegistry, Gauge, start_http_server  # noqa: PLC0415
        self.registry = CollectorRegistry()
        self.replicas = Gauge("kvfleet_rebalance_replicas", "Replicas per pool: current (measured) "
                              "and recommended", ["pool", "kind"], registry=self.registry)
        self.info = Gauge("kvfleet_rebalance_decision_info", "1 for the reason of each pool's "
                          "latest recommendation", ["pool", "reason"], registry=self.registry)
        self.utilization = Gauge("kvfleet_rebalance_utilization", "Busy fraction per pool over "
                                 "the latest window", ["pool"], registry=self.registry)
        self.server, _ = start_http_server(port, addr="127.0.0.1", registry=self.registry)
        self.url = f"http://127.0.0.1:{self.server.server_port}/metrics"

    def show(self, outcome: Outcome) -> None:
        for d in outcome.decisions:
            self.replicas.labels(d.pool, "current").set(d.current)
            self.replicas.labels(d.pool, "recommended").set(d.recommended)
            for reason in Reason:
                self.info.labels(d.pool, reason.value).set(1 if reason is d.reason else 0)
            self.utilization.labels(d.pool).set(d.utilization)

    def close(self) -> None:
        self.server.shutdown()


# ------------------------------------------------------------------------------ entry
def run(args: argparse.Namespace) -> int:
    try:
        sizes = manual_sizes(args.replicas)
        if args.target == "kubernetes" and not args.release:
            raise ValueError("--target kubernetes needs --release: the Helm release whose pools "
                             "it scales")
        if not args.window_s > 0:
            raise ValueError(f"--window-s must be > 0, got {args.window_s}")
        if args.advisory:
            return _advisory(args, sizes)
        return _once(args, sizes)
    except ValueError as e:           # rebalance_k8s.KubeError too
        print(f"kvfleet rebalance: {e}", file=sys.stderr)
        return 2
    except (OSError, ConnectionError) as e:
        print(f"kvfleet rebalance: cannot read the fleet at {args.redis_url}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - redis' own errors: the fleet is unreachable
        if type(e).__module__.startswith("redis"):
            print(f"kvfleet rebalance: cannot read the fleet at {args.redis_url}: "
                  f"{type(e).__name__}: {e}", file=sys.stderr)
            return 2
        raise


def _decide(args, sizes, windows, state) -> tuple[Outcome, RebalanceConfig]:
    if not windows:
        raise ValueError("the fleet has no live workers in Redis (is kvfleet up serving it?)")
    cfg = config_of(args, windows)
    now = time.monotonic()
    out = manual(windows, sizes, cfg, now, state) if sizes else decide(windows, cfg, state, now)
    return out, cfg


def _once(args: argparse.Namespace, sizes: dict[str, int]) -> int:
    windows = asyncio.run(measure(args.redis_url, args.window_s, targets_of(args)))
    state = RebalanceState(last_change_s(args.redis_url))
    outcome, cfg = _decide(args, sizes, windows, state)
    applied, ok, requests = None, True, None
    if args.target == "kubernetes":
        requests, api = kube_requests(args, outcome)
        try:
            if args.apply and requests:
                applied, ok = rebalance_k8s.apply(api, requests)
        finally:
            if api is not None:
                api.close()
        if applied and any(o["accepted"] for o in applied):
            mark_change_in(args.redis_url)
    elif args.apply and outcome.changed:
        check_launcher(args.redis_url, args.target)
        applied, ok = apply_local(args.redis_url, outcome, args.wait_s)
    mode = "apply" if args.apply else "dry-run"
    line = record(outcome, mode, cfg, windows, applied)
    if requests is not None and not args.apply:
        line["requests"] = [r.as_dict() for r in requests]     # what --apply would send
    append_audit(args.audit_log, line)
    show(line, args.json)
    if requests and not args.apply and not args.json:
        for r in requests:
            print("would send:\n" + r.show())
    return 0 if ok else 1


def kube_requests(args: argparse.Namespace, outcome: Outcome):
    """The merge patches of the change (none without one), and the API they would go to (None
    on a dry run: nothing is sent, no credentials are read unless no --namespace is given)."""
    api = None
    if args.apply:
        api = rebalance_k8s.KubeApi.discover(args.kubeconfig)
    namespace = args.namespace or (api.namespace if api else _default_namespace(args.kubeconfig))
    return (rebalance_k8s.scale_requests(outcome, args.release, namespace, args.kube_kind), api)


def _default_namespace(kubeconfig: str | None) -> str:
    try:
        api = rebalance_k8s.KubeApi.discover(kubeconfig)
    except (rebalance_k8s.KubeError, KeyError):
        return "default"
    api.close()
    return api.namespace


def check_launcher(redis_url: str, target: str) -> None:
    """--apply --target local|ray only to a kvfleet up that runs its workers so (ValueError)."""
    import redis as redis_sync  # noqa: PLC0415

    from services.cli import fleet_orders as fo  # noqa: PLC0415
    from services.state.redis_auth import RedisCredentials  # noqa: PLC0415
    client = redis_sync.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0,
                                       **RedisCredentials.from_env().client_kwargs())
    try:
        kind = fo.launcher_kind(client, NAMESPACE)
    finally:
        client.close()
    if kind is None and target == "ray":
        raise ValueError("no kvfleet up --ray takes orders from this Redis (--target ray adds "
                         "and drains the actors of one)")
    if kind is not None and kind != target:
        raise ValueError(f"the kvfleet up serving this Redis runs its workers as {kind}: use "
                         f"--target {kind}")


def mark_change_in(redis_url: str) -> None:
    """The cool-down's clock, as --target local keeps it."""
    import redis as redis_sync  # noqa: PLC0415

    from services.cli import fleet_orders as fo  # noqa: PLC0415
    from services.state.redis_auth import RedisCredentials  # noqa: PLC0415
    client = redis_sync.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0,
                                       **RedisCredentials.from_env().client_kwargs())
    try:
        fo.mark_change(client, NAMESPACE)
    finally:
        client.close()


def _advisory(args: argparse.Namespace, sizes: dict[str, int]) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    exported = Exported(args.metrics_port)
    print(f"kvfleet rebalance (advisory): metrics at {exported.url}; audit log {args.audit_log}",
          flush=True)
    state, n = RebalanceState(), 0
    try:
        while not stop.is_set() and (args.decisions is None or n < args.decisions):
            windows = asyncio.run(measure(args.redis_url, args.window_s, targets_of(args)))
            outcome, cfg = _decide(args, sizes, windows, state)
            state, n = outcome.state, n + 1
            exported.show(outcome)
            line = record(outcome, "advisory", cfg, windows)
            append_audit(args.audit_log, line)
            show(line, args.json)
    finally:
        exported.close()
    return 0
