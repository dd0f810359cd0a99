"""`kvfleet up`: the whole fleet on one host, as processes (DESIGN.md section 9, local).

  Redis      an embedded Redis-protocol server in this process, unless --redis-url names one
  workers    --prefill N prefill + --decode M decode workers (disagg), M mixed (colocated), or
             --mixed K mixed + N prefill + M decode (hybrid: short prompts co-located)
  routers    --routers N (default 1), router-0..N-1: they keep all state in Redis, so any decides
  gateway    OpenAI REST on --http-port and gRPC on --grpc-port; asks any of the routers

Workers and routers start side by side, then the gateway. Every timeout of the fleet is one
`Timeouts` (services/protocol/timeouts.py): `kvfleet up` takes its flags, refuses to start on a
contradiction, and hands the same values to every child.

Ports: without --port-base the gateway takes --http-port / --grpc-port (8000 / 50051) and every
other listener a free port; with --port-base P each listener is on P + its offset in the table of
services/cli/ports.py (docs/operations.md), and a taken one refuses the start before anything
runs. The banner prints every listener (`  listen  <service> <kind> <host:port>`, Banner.listeners).

Telemetry: every router and worker serves Prometheus /metrics on a free loopback port (their
--metrics-port defaults to 0; P + offset with --port-base), the gateway on its HTTP port at /metrics; each registers its
metrics URL in Redis, so `kvfleet status --redis-url URL` (printed below) lists them and writes a
Prometheus file_sd. A restarted router or worker gets a new metrics port and registers it. The
OTEL_* environment of `kvfleet up` reaches every child (launcher.py passes the environment on).

Prints the endpoints, then supervises: a child that exits, or answers no health probe for
--timeout-unresponsive-s (it is SIGKILLed), is restarted with backoff, on the same port
(services/cli/supervisor.py), while the rest keep serving. `kvfleet rebalance --apply --target
local` adds a worker or drains one through Redis (services/cli/fleet_orders.py). Children get SIGTERM from the kernel
when `kvfleet up` dies, even by kill -9 (services/cli/lifeline.py). Only Ctrl-C or SIGTERM stops
the fleet, within SHUTDOWN_BUDGET_S (3 s) even with streams in flight: SIGTERM to every child
at once, SIGKILL to whatever of them and their own children is left at the grace
(services/cli/launcher.py), then the embedded Redis; no orphan process and no port left open.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass

from services.cli import ports, ray_fleet
from services.cli.launcher import LaunchError, Launcher
from services.cli.health_watch import FleetProbe, HealthWatch
from services.cli.supervisor import RestartPolicy, Supervisor
from services.engine.config import (KV_CACHE_MIB, add_engine_args, add_sim_args, sim_args,
                                    sim_config_from_args)
from services.router.paths import DEFAULT_THRESHOLD_TOKENS, MODES
from services.protocol import fleet_token, timeouts
from services.protocol.fleet_token import FleetAuth
from services.protocol.timeouts import SHUTDOWN_BUDGET_S, Timeouts
from services.state import records, redis_auth
from services.state.redis_server import EmbeddedRedis


SUPERVISE_EVERY_S = 0.2   # how often children are checked (a dead one is seen this late at most)


def add_up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="tiny (default), smollm2 (SmolLM2-135M-Instruct, "
                   "made into the cache on first use), or a checkpoint directory")
    p.add_argument("--mode", choices=MODES, default="disagg",
                   help="disagg (default), colocated, or hybrid: --mixed co-located workers serve "
                        "prompts of at most --hybrid-threshold-tokens, --prefill and --decode "
                        "workers the longer ones")
    p.add_argument("--mixed", type=int, default=1, metavar="N",
                   help="hybrid: co-located (mixed) workers; default 1")
    p.add_argument("--hybrid-threshold-tokens", type=int, default=None, metavar="N",
                   help="hybrid: the longest prompt served co-located (default: from the capacity "
                        "model for an --engine sim target, else "
                        f"{DEFAULT_THRESHOLD_TOKENS}, the gateway's document boundary)")
    p.add_argument("--fallback-model", default=None, metavar="DIR",
                   help="a second, smaller or quantized checkpoint served by the fallback pool "
                        "(overload stage S3 sends degradable classes there); it must have the "
                        "primary's tokenizer. Default: no fallback pool")
    p.add_argument("--fallback-workers", type=int, default=1, metavar="N",
                   help="the fallback pool's size: N mixed workers (colocated) or N prefill + N "
                        "decode workers (disagg); default 1. Only with --fallback-model")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--placement", choices=["prefix", "load"], default="prefix",
                   help="the routers' placement: prefix-cache aware (default) or by load alone")
    p.add_argument("--routers", type=int, default=1,
                   help="router processes; the gateway spreads its Admit calls over them")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=None,
                   help="the gateway's OpenAI REST port (default 8000, or P+0 with --port-base)")
    p.add_argument("--grpc-port", type=int, default=None,
                   help="the gateway's gRPC port (default 50051, or P+1 with --port-base)")
    p.add_argument("--port-base", type=int, default=None, metavar="P",
                   help="every listener on P + its offset (services/cli/ports.py, "
                        "docs/operations.md); default: routers' and workers' ports are free ones")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME", default=None,
                   help="the model names requests may use (vLLM's flag), given to the gateway; "
                        "responses carry the first. Default: the model dir's name")
    p.add_argument("--redis-url", default=None,
                   help="an external Redis (redis:// or rediss:// for TLS); credentials in it "
                        "(redis://user:pass@host:port) reach the children by environment, as "
                        "$KVFLEET_REDIS_PASSWORD would. Default: an embedded Redis with a "
                        "password of its own")
    p.add_argument("--allowed-networks", default=None, metavar="CIDR,...",
                   help="addresses worker and service records in Redis may name (default "
                        "127.0.0.0/8,::1; $KVFLEET_ALLOWED_NETWORKS)")
    p.add_argument("--api-keys", default=None)
    p.add_argument("--max-in-progress", type=int, default=None, metavar="N",
                   help="generation requests the gateway process holds at once, shared fairly "
                        "by tenant (its front door, docs/operations.md; 0: no bound). Default: "
                        "the gateway's own")
    p.add_argument("--kv-backend", choices=["nixl", "tcp"], default="tcp")
    p.add_argument("--kv-cache-mib", type=int, default=KV_CACHE_MIB)
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="shard the model over N rank processes in every primary-pool worker, "
                        "prefill and decode alike (KV ships rank to rank, so both roles need the "
                        "same N); NCCL on CUDA, gloo on the CPU. Default 1")
    add_engine_args(p, "the workers'")
    add_sim_args(p)
    p.add_argument("--insecure", action="store_true")
    ray_fleet.add_args(p)
    p.add_argument("--config", default=None,
                   help="engine config YAML (classes, tenants, budgets) for workers and gateway")
    timeouts.add_args(p)


def model_dir(model: str) -> str:
    """A model directory; "tiny" or a named model (`smollm2`) is made into the cache on first use,
    here, once, before any child starts (only then is torch imported here)."""
    from services.engine.model_zoo import resolve  # noqa: PLC0415
    return resolve(model)


def worker_roles(args: argparse.Namespace) -> list[tuple[str, int]]:
    if args.mode == "hybrid":
        return [("mixed", args.mixed), ("prefill", args.prefill), ("decode", args.decode)]
    return ([("mixed", args.decode)] if args.mode == "colocated"
            else [("prefill", args.prefill), ("decode", args.decode)])


def hybrid_threshold(args: argparse.Namespace) -> int:
    """The routers' --hybrid-threshold-tokens: the operator's, else the capacity model's split for
    a simulated target (services/planner/hybrid.py), else the gateway's document boundary."""
    if getattr(args, "hybrid_threshold_tokens", None) is not None:
        if args.hybrid_threshold_tokens < 1:
            raise SystemExit("kvfleet up: --hybrid-threshold-tokens must be at least 1")
        return args.hybrid_threshold_tokens
    sim = sim_config_from_args(args)
    if sim is None or sim.step_s is not None or sim.profile is not None:
        return DEFAULT_THRESHOLD_TOKENS
    from services.planner.capacity import CostModel  # noqa: PLC0415 - only for a sim target
    from services.planner.hybrid import threshold_tokens  # noqa: PLC0415
    return threshold_tokens(CostModel.for_target(model=sim.target_model, gpu=sim.gpu, tp=sim.tp,
                                                 dtype=sim.dtype, kv_dtype=sim.kv_dtype))


def fallback_roles(args: argparse.Namespace) -> list[tuple[str, int]]:
    """The fallback pool's workers: none without --fallback-model."""
    if not getattr(args, "fallback_model", None):
        return []
    n = args.fallback_workers
    return ([("mixed", n)] if args.mode in ("colocated", "hybrid")     # hybrid: chats only
            else [("prefill", n), ("decode", n)])


def worker_threads(args: argparse.Namespace) -> int:
    """Torch threads per worker process: the engine's own count for this host (vLLM's rule,
    services/engine/model/threads.py) split between the workers (a tensor-parallel worker's N
    ranks each run with this many)."""
    from services.engine.model.threads import engine_threads  # noqa: PLC0415
    tp = getattr(args, "tensor_parallel", 1)
    workers = sum(n * tp for _, n in worker_roles(args)) + sum(n for _, n in fallback_roles(args))
    return max(1, engine_threads(0) // workers)


def check_tensor_parallel(args: argparse.Namespace) -> None:
    """--tensor-parallel N: refused before anything starts unless N >= 1 divides the model's
    query and KV heads (every rank needs whole heads)."""
    tp = getattr(args, "tensor_parallel", 1)
    if tp < 1:
        raise SystemExit(f"kvfleet up: --tensor-parallel must be >= 1, got {tp}")
    if tp == 1:
        return
    if getattr(args, "engine", "real") == "sim":
        raise SystemExit("kvfleet up: --tensor-parallel shards a real model; the simulated core "
                         "models its target's tensor parallelism with --sim-tp")
    from services.engine.model.config import ModelConfig  # noqa: PLC0415
    from services.engine.model.tensor_parallel import check_shardable  # noqa: PLC0415
    try:
        check_shardable(ModelConfig.from_dir(model_dir(args.model)), tp)
    except ValueError as e:
        raise SystemExit(f"kvfleet up: --tensor-parallel: {e}") from None


def check_fallback(args: argparse.Namespace) -> str | None:
    """The fallback checkpoint's directory (None: no fallback pool), refused before anything
    starts unless it has the primary's tokenizer: the gateway tokenizes and detokenizes every
    request with one tokenizer, whichever pool serves it."""
    if not getattr(args, "fallback_model", None):
        return None
    if args.fallback_workers < 1:
        raise SystemExit(f"kvfleet up: --fallback-workers must be >= 1, got {args.fallback_workers}")
    from services.gateway.model import CheckpointFacts  # noqa: PLC0415
    primary, fallback = model_dir(args.model), model_dir(args.fallback_model)
    try:
        vocab = {d: CheckpointFacts.from_dir(d).vocab_size for d in (primary, fallback)}
    except (ValueError, OSError) as e:
        raise SystemExit(f"kvfleet up: --fallback-model: {e}") from None
    if vocab[primary] != vocab[fallback] or _tokenizer(primary) != _tokenizer(fallback):
        raise SystemExit(
            f"kvfleet up: --fallback-model {fallback} has another tokenizer than --model {primary} "
            f"(vocab {vocab[fallback]} vs {vocab[primary]}, or tokenizer.json differs): the "
            "gateway detokenizes with one tokenizer, so the fallback must share the primary's")
    return fallback


def _tokenizer(model: str) -> bytes | None:
    path = os.path.join(model, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return f.read()


def gateway_ports(args: argparse.Namespace) -> tuple[int, int]:
    """(HTTP, gRPC): the flags', else the --port-base table's, else 8000 and 50051."""
    base = getattr(args, "port_base", None)
    default = (8000, 50051) if base is None else (base, base + 1)
    return (default[0] if args.http_port is None else args.http_port,
            default[1] if args.grpc_port is None else args.grpc_port)


def port_plan(args: argparse.Namespace, embedded_redis: bool) -> list[ports.Listener]:
    """Every listener on its --port-base port (the gateway's flags win); [] without --port-base.
    ValueError if the table has no room for the fleet."""
    base = getattr(args, "port_base", None)
    if base is None:
        return []
    services = ["gateway", *(["redis"] if embedded_redis else []),
                *(f"router-{k}" for k in range(getattr(args, "routers", 1))),
                *(f"{role}-{i}" for role, count in worker_roles(args) for i in range(count))]
    http, grpc = gateway_ports(args)
    pinned = {("gateway", "http"): http, ("gateway", "grpc"): grpc}
    return [ports.Listener(x.service, x.kind, pinned.get((x.service, x.kind), x.port), x.host)
            for x in ports.plan(base, services, args.kv_backend == "tcp", args.host)]


def start_fleet(args: argparse.Namespace, launcher: Launcher, redis_url: str,
                limits: Timeouts = Timeouts(), plan: list[ports.Listener] = ()) -> dict[str, str]:
    """Workers and routers side by side, then the gateway; returns every child's address (and
    `gateway-grpc`). `args` as `add_up_args` makes them (`routers` may be missing: one); `plan`:
    the --port-base ports (`port_plan`), or none (free ports)."""
    model = model_dir(args.model)
    config = ["--config", args.config] if args.config else []
    limit_args = limits.as_args()
    # split the host's cores between the workers, leaving one for the gateway and the routers
    common = ["--redis-url", redis_url, "--kv-cache-mib", str(args.kv_cache_mib),
              "--threads", str(worker_threads(args)), *config, *limit_args]
    for flag in ("device", "cuda_graphs", "attention_backend", "kv_cache_dtype",
                 "logprobs_mode"):                                                 # workers' flags
        if getattr(args, flag, None):
            common += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    if getattr(args, "kv_cache_scales", None):
        common += ["--kv-cache-scales", ",".join(map(repr, args.kv_cache_scales))]
    common += sim_args(args)
    tp = ["--tensor-parallel", str(args.tensor_parallel)] if getattr(args, "tensor_parallel", 1) > 1 else []
    specs = {f"{role}-{i}": ["services.cli.cli", "serve", role, "--worker-id", f"{role}-{i}",
                             "--kv-backend", args.kv_backend, "--model", model, *common, *tp,
                             *ports.child_args(plan, f"{role}-{i}")]
             for role, count in worker_roles(args) for i in range(count)}
    fallback = check_fallback(args)     # its workers take free ports, --port-base or not
    for role, count in fallback_roles(args):
        for i in range(count):
            name = f"{FALLBACK_PREFIX}{role}-{i}"
            specs[name] = ["services.cli.cli", "serve", role, "--worker-id", name, "--pool",
                           "fallback", "--kv-backend", args.kv_backend, "--model", fallback, *common]
    routers = [f"router-{k}" for k in range(getattr(args, "routers", 1))]
    for name in routers:
        specs[name] = ["services.router", "--redis-url", redis_url, "--mode", args.mode,
                       *(["--hybrid-threshold-tokens", str(hybrid_threshold(args))]
                         if args.mode == "hybrid" else []),
                       "--router-id", name, "--placement", getattr(args, "placement", "prefix"),
                       *config, *limit_args, *ports.child_args(plan, name)]
    endpoints = launcher.start_many(specs)
    http, grpc = gateway_ports(args)
    gateway = ["services.gateway", "--model", model,
               "--router", ",".join(endpoints[name] for name in routers),
               "--redis-url", redis_url, "--host", args.host,
               "--http-port", str(http), "--grpc-port", str(grpc), *config, *limit_args]
    if getattr(args, "served_model_name", None):
        gateway += ["--served-model-name", *args.served_model_name]
    if args.api_keys:
        gateway += ["--api-keys", args.api_keys]
    if args.insecure:
        gateway.append("--insecure")
    if getattr(args, "max_in_progress", None) is not None:
        gateway += ["--max-in-progress", str(args.max_in_progress)]
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


def check_device(args: argparse.Namespace) -> None:
    """--device cuda without CUDA: one line and exit here, not a failure in every worker."""
    if getattr(args, "device", None) not in (None, "auto", "cpu"):
        from services.engine.device import check_device as check  # noqa: PLC0415 (imports torch)
        check(args.device, "kvfleet up")


def check_routers(args: argparse.Namespace) -> None:
    if args.routers < 1:
        raise SystemExit(f"kvfleet up: --routers must be >= 1, got {args.routers}")


def check_ports(args: argparse.Namespace) -> list[ports.Listener]:
    """The --port-base plan, refused before anything starts if the table cannot hold the fleet or
    one of its ports is taken (the first one is named)."""
    try:
        plan = port_plan(args, embedded_redis=not args.redis_url)
    except ValueError as e:
        raise SystemExit(f"kvfleet up: {e}") from None
    busy = ports.taken(plan)
    if busy is not None:
        raise SystemExit(f"kvfleet up: port {busy.port} ({busy.service} {busy.kind}, "
                         f"--port-base {args.port_base} + {busy.port - args.port_base}) is "
                         f"already in use on {busy.host}: nothing was started; free it or pick "
                         f"another --port-base")
    return plan


def listeners(endpoints: dict[str, str], launcher: Launcher, redis: EmbeddedRedis | None
              ) -> list[tuple[str, str, str]]:
    """(service, kind, address) of every listener the fleet opened, as each child reported it
    (`GRPC`, `METRICS`, `KV` lines before its READY)."""
    found = [("gateway", "http", endpoints["gateway"]),
             ("gateway", "grpc", endpoints["gateway-grpc"])]
    if redis is not None:
        found.append(("redis", "redis", f"{ports.HOST}:{redis.port}"))
    for name, child in launcher.children.items():
        if name == "gateway":
            continue
        found.append((name, "grpc", endpoints[name]))
        for line in child.lines:
            kind, _, rest = line.partition(" ")
            if kind in ("METRICS", "KV", "UCX"):
                address = rest.split()[-1].removeprefix("http://").removesuffix("/metrics")
                found.append((name, kind.lower(), address))
    return found


def redis_credentials(args: argparse.Namespace, log_dir: str) -> tuple[str | None, dict[str, str], str]:
    """(the embedded Redis's password, or None with --redis-url; the variables that give the
    children the credentials; a banner line saying where they are, never what). The embedded
    password is $KVFLEET_REDIS_PASSWORD's if set, else a new one, written (mode 0600) to
    `<log_dir>/redis-password` for `kvfleet status`."""
    try:
        if args.redis_url:
            _, env = redis_auth.child_env(args.redis_url)
            return None, env, ("from --redis-url or $" + redis_auth.ENV_PASSWORD if env
                               else "none given (the server must ask for none)")
        password = redis_auth.RedisCredentials.from_env().password
    except redis_auth.RedisCredentialsError as e:
        raise SystemExit(f"kvfleet up: {e}") from None
    if password:
        return password, {redis_auth.ENV_PASSWORD: password}, f"from ${redis_auth.ENV_PASSWORD}"
    password = redis_auth.generate()
    path = os.path.join(log_dir, "redis-password")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(password + "\n")
    return password, {redis_auth.ENV_PASSWORD: password}, (
        f"generated, in {path} (status: {redis_auth.ENV_PASSWORD_FILE}={path})")


def allowed_networks_env(args: argparse.Namespace) -> dict[str, str]:
    """--allowed-networks as the children's $KVFLEET_ALLOWED_NETWORKS (checked here)."""
    spec = getattr(args, "allowed_networks", None)
    if spec is None:
        return {}
    try:
        records.parse_networks(spec)
    except ValueError as e:
        raise SystemExit(f"kvfleet up: --allowed-networks: {e}") from None
    return {records.ENV_ALLOWED_NETWORKS: spec}


def stop_grace_s(limits: Timeouts) -> float:
    """SIGTERM to SIGKILL for the children: their own stop (shutdown_grace_s) and a second to exit,
    within the budget less what SIGKILL, reaping and stopping Redis take."""
    return min(limits.shutdown_grace_s + 1.0, SHUTDOWN_BUDGET_S - 0.5)


def order_desk(launcher: Launcher, supervisor: Supervisor, redis_url: str,
               port_base: int | None = None):
    """What reads `kvfleet rebalance --apply`'s orders from Redis (services/cli/fleet_orders.py);
    with --port-base an added worker takes its ports of that table."""
    import redis as redis_sync  # noqa: PLC0415

    from services.cli.fleet_orders import OrderDesk  # noqa: PLC0415
    client = redis_sync.Redis.from_url(
        redis_url, socket_timeout=1.0, socket_connect_timeout=1.0,
        **redis_auth.RedisCredentials.from_env(launcher.env).client_kwargs())
    seal = records.RecordSeal.from_token(FleetAuth.from_env(launcher.env).token, launcher.env)
    return OrderDesk(launcher, supervisor, client, seal, port_base=port_base)


def run_up(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / SIGINT, then stop everything. Once the fleet is stopped nothing is left
    to clean up, so the process ends at once: the interpreter's own teardown (torch's, which the
    CLI imports) would eat most of the 3-s budget (docs/benchmarks.md, the time to stop)."""
    code = _up(args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _up(args: argparse.Namespace) -> int:
    started = time.monotonic()
    limits = timeouts.from_args(args)       # SystemExit naming every contradiction
    check_routers(args)
    ray_fleet.check_args(args)
    check_keys(args)
    check_fallback(args)
    check_device(args)
    check_tensor_parallel(args)
    if getattr(args, "ray", None):
        ray_fleet.pin_ports(args, lambda base: port_plan(
            argparse.Namespace(**{**vars(args), "port_base": base}), not args.redis_url))
    plan = check_ports(args)
    launcher = (ray_fleet.launcher_for(args, allowed_networks_env(args))
                if getattr(args, "ray", None) else Launcher(env=allowed_networks_env(args)))
    password, redis_env, redis_origin = redis_credentials(args, launcher.log_dir)
    launcher.env.update(redis_env)          # the children's Redis credentials: never on argv
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: launcher.stopping.set())
    redis_port = next((x.port for x in plan if x.service == "redis"), 0)
    redis = None if args.redis_url else EmbeddedRedis(port=redis_port, password=password).start()
    redis_url = redis_auth.split_url(args.redis_url)[0] if args.redis_url else redis.url
    try:
        endpoints = start_fleet(args, launcher, redis_url, limits, plan)
        print(f"kvfleet up ({args.mode}); logs in {launcher.log_dir}")
        print(f"  OpenAI REST  http://{endpoints['gateway']}/v1")
        print(f"  gRPC         {endpoints['gateway-grpc']}")
        print(f"  redis        {redis_url}")
        print(f"  redis-auth   {redis_origin}")           # where from; never the password
        print(f"  fleet token  {fleet_token.origin()}")   # where from; the token is never shown
        print(f"  status       kvfleet status --redis-url {redis_url}")
        for line in ray_fleet.banner(launcher):
            print(line)
        for name, addr in endpoints.items():
            if name not in ("gateway", "gateway-grpc"):
                print(f"  {name:<12} {addr}")
        for service, kind, address in listeners(endpoints, launcher, redis):
            print(f"  {LISTEN_PREFIX:<12} {service:<12} {kind:<8} {address}")
        print(f"  started in   {time.monotonic() - started:.1f} s")
        print(READY_PREFIX + endpoints["gateway"], flush=True)
        supervisor = Supervisor(launcher, RestartPolicy(unresponsive_s=limits.unresponsive_s),
                                pinned=pinned_ports(endpoints), health=HealthWatch(FleetProbe(
                                    FleetAuth.from_env(launcher.env), limits.health_s)))
        orders = order_desk(launcher, supervisor, redis_url, getattr(args, "port_base", None))
        while not launcher.stopping.wait(SUPERVISE_EVERY_S):
            supervisor.poll()
            orders.poll()
        return 0
    except LaunchError as e:
        if launcher.stopping.is_set():
            return 0                        # stopped while starting
        print(f"kvfleet up: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        stopping_at = time.monotonic()
        launcher.stop_all(stop_grace_s(limits))
        if redis is not None:
            redis.stop()
        print(f"kvfleet up: stopped in {time.monotonic() - stopping_at:.1f} s", flush=True)


# --- reading `kvfleet up`'s banner (loadtests/local_fleet.py: tests and benches start it as a program)

READY_PREFIX = "READY up "
FALLBACK_PREFIX = "fallback-"   # the fallback pool's workers: fallback-mixed-0, fallback-decode-0
LISTEN_PREFIX = "listen"     # `  listen  <service> <kind> <host:port>`, one line per listener
WORKER_ROLES = ("prefill", "decode", "mixed")


@dataclass(frozen=True)
class Banner:
    """What `kvfleet up` printed up to and including its READY line."""
    lines: list[str]

    @property
    def workers(self) -> dict[str, str]:
        """Each worker's name -> gRPC address (its `  decode-0   127.0.0.1:PORT` line)."""
        return {parts[0]: parts[1] for parts in (line.split() for line in self.lines)
                if len(parts) == 2 and parts[0].removeprefix(FALLBACK_PREFIX).split("-")[0]
                in WORKER_ROLES}

    @property
    def listeners(self) -> list[tuple[str, str, str]]:
        """(service, kind, address) of every listener: gateway http/grpc, redis (embedded),
        router-k grpc/metrics, worker grpc/metrics/kv (tcp) or ucx (nixl)."""
        return [(parts[1], parts[2], parts[3]) for parts in (line.split() for line in self.lines)
                if len(parts) == 4 and parts[0] == LISTEN_PREFIX]

    @property
    def redis_url(self) -> str | None:
        return next((line.split()[-1] for line in self.lines
                     if line.strip().startswith("redis ")), None)


# --- `kvfleet bench startup`: how long `kvfleet up` takes to serve, and to stop ------------------

def add_startup_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny")
    p.add_argument("--mode", choices=["disagg", "colocated"], default="colocated")
    p.add_argument("--routers", type=int, default=1)
    p.add_argument("--kv-cache-mib", type=int, default=KV_CACHE_MIB)
    p.add_argument("--timeout-s", type=float, default=300.0, help="give up after this long")


def run_startup(args: argparse.Namespace) -> int:
    """Start `kvfleet up` as a user would (loadtests/local_fleet.py, the tests' runner too), time
    its READY line and its first served completion (over HTTP, retried until it answers 200),
    then SIGTERM it and time its exit. Prints JSON."""
    import json  # noqa: PLC0415

    from loadtests.local_fleet import kvfleet_up  # noqa: PLC0415
    t0 = time.monotonic()
    try:
        with kvfleet_up(args.model, mode=args.mode, routers=args.routers,
                        kv_cache_mib=args.kv_cache_mib, ready_s=args.timeout_s) as up:
            first_s = _first_completion_after(up.url, t0, args.timeout_s)
            stop_at = time.monotonic()
            up.proc.send_signal(signal.SIGTERM)
            up.proc.wait(timeout=30)
            stopped_s = time.monotonic() - stop_at
    except RuntimeError as e:                     # it ended, or was not READY, in time
        raise SystemExit(str(e)) from None
    print(json.dumps({"mode": args.mode, "routers": args.routers,
                      "ready_s": round(up.ready_at - t0, 2), "first_request_s": round(first_s, 2),
                      "stopped_s": round(stopped_s, 2)}))
    return 0


def _first_completion_after(url: str, t0: float, timeout_s: float) -> float:
    import httpx  # noqa: PLC0415
    deadline = t0 + timeout_s
    while time.monotonic() < deadline:
        try:
            model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
            r = httpx.post(f"{url}/v1/completions", timeout=30, json={
                "model": model, "prompt": "hello", "max_tokens": 1, "temperature": 0})
            if r.status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"no completion served within {timeout_s:.0f} s")
