"""`kvfleet up`: the whole fleet on one host, as processes (DESIGN.md section 9, local).

  Redis      an embedded Redis-protocol server in this process, unless --redis-url names one
  workers    --prefill N prefill + --decode M decode workers (disagg), or M mixed (colocated)
  router     one, reading worker capacity from Redis
  gateway    OpenAI REST on --http-port and gRPC on --grpc-port

Prints the endpoints, then supervises: a child that exits is restarted with backoff, on the same
port (services/cli/supervisor.py), while the rest keep serving. Only Ctrl-C or SIGTERM stops
the fleet: every child it started (SIGTERM, then SIGKILL after a grace period) and the embedded
Redis, with no orphan process and no port left open.
"""
from __future__ import annotations

import argparse
import os
import signal
import threading

from services.protocol import fleet_token
from services.cli.launcher import Launcher
from services.state.redis_server import EmbeddedRedis
from services.cli.supervisor import Supervisor
from services.engine.engine import resolve_model_dir


SUPERVISE_EVERY_S = 0.2   # how often children are checked (a dead one is seen this late at most)


def add_up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny")
    p.add_argument("--mode", choices=["disagg", "colocated"], default="disagg")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--redis-url", default=None)
    p.add_argument("--api-keys", default=None)
    p.add_argument("--kv-backend", choices=["nixl", "tcp"], default="tcp")
    p.add_argument("--kv-cache-mib", type=int, default=256)
    p.add_argument("--insecure", action="store_true")
    p.add_argument("--config", default=None,
                   help="engine config YAML (classes, tenants, budgets) for workers and gateway")


def worker_roles(args: argparse.Namespace) -> list[tuple[str, int]]:
    return ([("mixed", args.decode)] if args.mode == "colocated"
            else [("prefill", args.prefill), ("decode", args.decode)])


def worker_threads(args: argparse.Namespace) -> int:
    """Torch threads per worker: the host's cores less one, split between the workers."""
    return max(1, ((os.cpu_count() or 1) - 1) // sum(n for _, n in worker_roles(args)))


def start_fleet(args: argparse.Namespace, launcher: Launcher, redis_url: str) -> dict[str, str]:
    model = resolve_model_dir(args.model)
    config = ["--config", args.config] if args.config else []
    common = ["--model", model, "--redis-url", redis_url, "--kv-cache-mib", str(args.kv_cache_mib),
              *config]
    roles = worker_roles(args)
    threads = worker_threads(args)
    # split the host's cores between the workers, leaving one for gateway and router: they relay
    # every token, and torch threads spinning on a shared core slow them down more than a second
    # intra-op thread speeds up the tiny model (measured: 1,310 vs 1,101-1,236 tok/s, colocated)
    common += ["--threads", str(threads)]
    endpoints = {}
    for role, count in roles:
        for i in range(count):
            name = f"{role}-{i}"
            endpoints[name] = launcher.start(name, [
                "services.cli.cli", "serve", role, "--worker-id", name,
                "--kv-backend", args.kv_backend, *common])
    endpoints["router"] = launcher.start("router", ["services.router", "--redis-url", redis_url,
                                                    "--mode", args.mode])
    gateway = ["services.gateway", "--model", model, "--router", endpoints["router"],
               "--redis-url", redis_url, "--host", args.host,
               "--http-port", str(args.http_port), "--grpc-port", str(args.grpc_port), *config]
    if args.api_keys:
        gateway += ["--api-keys", args.api_keys]
    if args.insecure:
        gateway.append("--insecure")
    endpoints["gateway"] = launcher.start("gateway", gateway)
    endpoints["gateway-grpc"] = next((line.split()[-1] for line in
                                      launcher.children["gateway"].lines
                                      if line.startswith("GRPC ")), "")
    return endpoints


def pinned_ports(endpoints: dict[str, str]) -> dict[str, list[str]]:
    """The arguments that restart each child on the port it listens on now."""
    port = lambda address: address.rsplit(":", 1)[1]  # noqa: E731
    pins = {name: ["--port", port(address)] for name, address in endpoints.items()
            if name not in ("gateway", "gateway-grpc")}
    pins["gateway"] = ["--http-port", port(endpoints["gateway"]),
                       "--grpc-port", port(endpoints["gateway-grpc"])]
    return pins


def check_keys(args: argparse.Namespace) -> None:
    """Refuse to start a fleet whose keys file names tenants or classes its engine config lacks
    (the gateway would refuse too, but only after the workers loaded)."""
    if not args.api_keys:
        return
    from services.engine.config import EngineConfig  # noqa: PLC0415
    from services.engine.config_file import load_engine_config  # noqa: PLC0415
    from services.gateway.config import key_problems, load_api_keys  # noqa: PLC0415
    engine = load_engine_config(args.config) if args.config else EngineConfig()
    problems = key_problems(load_api_keys(args.api_keys), engine.scheduler)
    if problems:
        raise SystemExit(f"kvfleet up: {args.api_keys} does not fit the engine config "
                         f"({args.config or 'the defaults'}): " + "; ".join(problems))


def run_up(args: argparse.Namespace) -> int:
    check_keys(args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    redis = None if args.redis_url else EmbeddedRedis().start()
    launcher = Launcher()
    try:
        endpoints = start_fleet(args, launcher, args.redis_url or redis.url)
        print(f"kvfleet up ({args.mode}); logs in {launcher.log_dir}")
        print(f"  OpenAI REST  http://{endpoints['gateway']}/v1")
        print(f"  gRPC         {endpoints['gateway-grpc']}")
        print(f"  redis        {args.redis_url or redis.url}")
        print(f"  fleet token  {fleet_token.origin()}")   # where from; the token is never shown
        for name, addr in endpoints.items():
            if name not in ("gateway", "gateway-grpc"):
                print(f"  {name:<12} {addr}")
        print("READY up " + endpoints["gateway"], flush=True)
        supervisor = Supervisor(launcher, pinned=pinned_ports(endpoints))
        while not stop.wait(SUPERVISE_EVERY_S):
            supervisor.poll()
        return 0
    finally:
        launcher.stop_all()
        if redis is not None:
            redis.stop()
        print("kvfleet up: stopped", flush=True)
