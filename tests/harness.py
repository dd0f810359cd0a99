"""How a test starts kvfleet: the one module for it.

A whole fleet: `up_fleet(model, ...)` runs `kvfleet up` as a real subprocess (the product's
runner, loadtests/local_fleet.py, which the benches use too) and yields an `UpFleet`: gateway
`http` / `grpc`, `redis_url`, `routers` and `workers` (name -> Service: role, address, pid,
metrics_url), `lines`, `pid(name)` / `signal(name, sig)` (following restarts). It stops it on
exit: SIGTERM, SIGKILL past a grace, nothing of it left running. The probes below (`stats`,
`holds_nothing`, `open_streams`, `serves`) read such a fleet from outside.

Services by hand, on the code path `kvfleet up` and `kvfleet serve` use: `running_fleet(redis,
model, mode, ...)` yields a `Fleet` (redis db of its own, one Launcher, one fleet token) whose
`worker(...)`, `start_router(...)` and `start_gateway(fleet, ...)` start one process each;
`Fleet.generate` runs a request as the gateway does. `worker_process(model, role, ...)` is one
`kvfleet serve ROLE` alone, without Redis. In the test process itself:
`in_process_worker` (a worker as build_worker assembles it: engine core process, role, gRPC,
/metrics) and `InProcessGateway`, for tests that read their objects or spans.

`ENGINE` is the engine every fleet here runs unless a test passes `engine=` ("real": the model;
"sim": the simulated engine core, no weights, with `sim_args`).

TTFT targets: a fleet started here without an engine config of its own (`up_fleet`, and every
worker and router of `running_fleet` not given `--config`) runs `fleet_targets_config()`: the
production classes with TTFT targets of at least TEST_TTFT_TARGET_S. Its routers predict from the
rates the fleet measures, so on a loaded box they would refuse a test's request at admission
against the production targets (1 s interactive); a test whose claim is about cancellation, KV
transfer, leaks, streaming or kills is then not about that. A test about admission, refusals or
stages passes `targets="production"` (or its own config). docs/loadtests.md, "Test fleets' TTFT
targets".
"""
from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import itertools
import os
import threading
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import cache

import grpc
import httpx
import yaml

from loadtests import local_fleet
from loadtests.local_fleet import Service, UpFleet  # noqa: F401 - the harness's types
from services.cli.launcher import Launcher
from services.gateway.fleet_run import Channels, FleetRun, Routers
from services.protocol.fleet_token import METADATA_KEY, FleetAuth
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.protocol.listeners import listening_sockets  # noqa: F401 - the tests' import
from services.protocol.timeouts import Timeouts
from services.state import redis_auth
from tests.waiting import wait_until

ENGINE = "sim"              # real | sim: what every fleet of the tests runs unless told otherwise
KV_CACHE_MIB = 32           # each worker's KV cache in a `kvfleet up` fleet of the tests
# The simulated core stands in for the tiny model: its KV capacity the blocks the tiny model gets
# from the same --kv-cache-mib (512 tokens a MiB: 4 layers x 2 KV heads x 32 dims x K,V x fp32),
# a short fixed step, and no drawn EOS a test could meet before max_tokens (the tiny model's random
# weights end a request at max_tokens as well).
TINY_KV_TOKENS_PER_MIB = 512
SIM_STEP_MS = 2
SIM_OUTPUT_LEN = "fixed:100000"
UP_READY_S = 300.0          # a loaded 2-core box takes minutes to load the model in every worker
# The least TTFT target of every class in a test fleet (targets="test"): far above what a loaded
# 2-core box's rates predict for a test's few small requests, so admission never refuses them.
TEST_TTFT_TARGET_S = 60.0
TARGETS = ("test", "production")


# ------------------------------------------------------------------ the classes' TTFT targets

@cache
def fleet_targets_config() -> str:
    """An engine config YAML (written once per test process, removed at its exit): the production
    classes of services/engine/config.py, each TTFT target raised to TEST_TTFT_TARGET_S; every
    other knob, tenants included, is the production default."""
    from services.engine.config import SchedulerConfig  # noqa: PLC0415
    classes = [asdict(replace(c, ttft_target_s=max(c.ttft_target_s, TEST_TTFT_TARGET_S)))
               for c in SchedulerConfig().classes]
    folder = tempfile.mkdtemp(prefix="kvfleet-test-targets-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = os.path.join(folder, "engine.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump({"scheduler": {"classes": classes}}, f)
    return path


def targets_args(targets: str) -> tuple[str, ...]:
    """The --config a process of a fleet with these `targets` gets ("production": none)."""
    if targets not in TARGETS:
        raise ValueError(f"targets must be one of {TARGETS}, got {targets!r}")
    return ("--config", fleet_targets_config()) if targets == "test" else ()


# ------------------------------------------------------------------ the whole fleet: kvfleet up

# The embedded Redis's password of every `kvfleet up` these tests start (kvfleet up takes the one
# in its environment; UpFleet.redis_url carries it): `redis_env()` gives it to a test's own
# `kvfleet status` or Redis client.
REDIS_PASSWORD = redis_auth.generate()


def redis_env() -> dict[str, str]:
    return {**os.environ, redis_auth.ENV_PASSWORD: REDIS_PASSWORD}


def sim_args(kv_cache_mib: int, step_ms: float = SIM_STEP_MS) -> tuple[str, ...]:
    """The --sim-* flags that make the simulated core a stand-in for the tiny model given
    `kv_cache_mib` of KV cache (a test whose stream must outlast an event passes a longer
    `step_ms`)."""
    return ("--sim-step-ms", str(step_ms), "--sim-kv-tokens",
            str(kv_cache_mib * TINY_KV_TOKENS_PER_MIB), "--sim-output-len", SIM_OUTPUT_LEN,
            "--sim-network-gbps", "100")


def engine_flags(kv_cache_mib: int, step_ms: float = SIM_STEP_MS) -> tuple[str, ...]:
    """A worker's engine flags when ENGINE is the simulated core (none for the real model)."""
    return () if ENGINE == "real" else ("--engine", ENGINE, *sim_args(kv_cache_mib, step_ms))


def _engine_args(engine: str | None, args: tuple[str, ...], kv_cache_mib: int) -> tuple[str, ...]:
    """A worker's command-line flags for `engine` (None: ENGINE); the last --kv-cache-mib in
    `args` sizes the simulated core's KV like the tiny model's."""
    if (engine or ENGINE) == "real":
        return args
    for i, arg in enumerate(args[:-1]):
        if arg == "--kv-cache-mib":
            kv_cache_mib = int(args[i + 1])
    given = "--engine" in args
    return (*(() if given else ("--engine", engine or ENGINE, *sim_args(kv_cache_mib))), *args)


def up_fleet(model, *args: str, env: dict[str, str] | None = None, targets: str = "test",
             **flags):
    """loadtests.local_fleet.kvfleet_up with the tests' defaults (KV_CACHE_MIB per worker, ENGINE,
    UP_READY_S, the embedded Redis's password REDIS_PASSWORD; on the simulated core, sim_args of
    the fleet's KV_CACHE_MIB unless the test gives its own or passes --engine itself; the test
    TTFT targets unless `targets="production"` or the test gives its own config)."""
    defaults = dict(kv_cache_mib=KV_CACHE_MIB, engine=ENGINE, ready_s=UP_READY_S)
    if "--config" not in args and targets_args(targets):
        defaults["config"] = targets_args(targets)[1]
    if "--engine" in args:                       # the test starts its own engine flags
        defaults["engine"] = "real"
    elif flags.get("engine", ENGINE) != "real" and "sim_args" not in flags:
        defaults["sim_args"] = sim_args(flags.get("kv_cache_mib", KV_CACHE_MIB))
    return local_fleet.kvfleet_up(str(model), *args, env={redis_auth.ENV_PASSWORD: REDIS_PASSWORD,
                                                         **(env or {})}, **{**defaults, **flags})


def stats(fleet: UpFleet, name: str) -> pb.WorkerStats:
    """A worker's Stats over gRPC, presenting the fleet's token."""
    with grpc.insecure_channel(fleet.workers[name].address) as ch:
        return pb_grpc.WorkerStub(ch).Stats(pb.StatsRequest(), timeout=5,
                                            metadata=((METADATA_KEY, fleet.token or ""),))


def holds_nothing(fleet: UpFleet) -> bool:
    """Every worker: no KV block in use or reserved, nothing running or queued."""
    try:
        every = [stats(fleet, name) for name in fleet.workers]
    except grpc.RpcError:
        return False
    return all(s.kv_blocks_used == 0 and s.kv_blocks_reserved == 0 and s.num_running == 0
               and s.num_queued == 0 and s.kv_writes_in_flight == 0 for s in every)


def open_streams(redis_url: str, tenant: str = "default") -> int:
    """Stream slots the tenant holds in Redis: its live leases (services/state/fleet_state.py)."""
    import redis  # noqa: PLC0415
    client = redis.Redis.from_url(redis_url)
    try:
        return client.zcount(f"kvfleet:tenant:{tenant}:leases", f"({int(time.time() * 1000)}",
                             "+inf")
    finally:
        client.close()


def serves(fleet: UpFleet, timeout_s: float = 60.0) -> bool:
    """A small completion succeeds within `timeout_s` (retrying while the fleet heals)."""
    def ok() -> bool:
        try:
            r = httpx.post(f"{fleet.url}/v1/completions", timeout=10, json={
                "model": fleet.model, "prompt": "are you back?", "max_tokens": 2})
        except httpx.HTTPError:
            return False
        return r.status_code == 200
    return wait_until(ok, timeout_s, interval_s=0.2)


# ------------------------------------------------------------------- services started by hand

_db = itertools.count(1)


class _Loop:
    """An event loop on a thread of its own, for blocking tests to drive grpc.aio code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


class FleetCall:
    """One request through the fleet, as a blocking call: iterate for its chunks; `cancel()`."""

    def __init__(self, loop: _Loop, run: FleetRun) -> None:
        self._loop = loop
        self.run = run
        self._pending: asyncio.Future | None = None   # a first read start() began

    def start(self) -> pb.Plan:
        """Admit and open the plan's calls now (iterating does it on first read otherwise)."""
        async def first():
            plan = await self.run.start()
            self._pending = asyncio.ensure_future(self.run.next())
            return plan
        return self._loop.run(first())

    def __iter__(self):
        if self._pending is not None:
            chunk = self._loop.run(_result(self._pending))
            self._pending = None
            if chunk is None:
                return
            yield chunk
        while True:
            chunk = self._loop.run(self.run.next())
            if chunk is None:
                return
            yield chunk

    def cancel(self) -> None:
        async def close():
            if self._pending is not None:
                self._pending.cancel()
            self.run.close()
        self._loop.run(close())


async def _result(future: asyncio.Future):
    return await future


class Fleet:
    def __init__(self, launcher: Launcher, redis_url: str, targets: str = "test") -> None:
        self.launcher = launcher
        self.redis_url = redis_url
        self.targets = targets_args(targets)   # the --config of a process not given its own
        self.workers: dict[str, str] = {}
        self.routers: list[str] = []
        self.auth = FleetAuth.from_env(launcher.env)      # the token its processes ask for
        self.timeouts = Timeouts()
        self._loop: _Loop | None = None
        self._channels: Channels | None = None
        self._routers: Routers | None = None

    @property
    def router(self) -> str:
        return self.routers[0]

    def generate(self, request: pb.WorkRequest) -> FleetCall:
        """Run `request` as the gateway would: Admit on a router, then the plan's workers."""
        if self._loop is None:         # one Routers for the fleet's life: its round robin spreads
            self._loop = _Loop()
            self._channels = Channels(self.auth)
            self._routers = Routers(self.routers, self._channels, self.timeouts)
        return FleetCall(self._loop, FleetRun(request, self._routers, self._channels,
                                             self.timeouts))

    def close(self) -> None:
        if self._loop is not None:
            self._loop.run(self._channels.close())
            self._loop.close()

    def channel(self, address: str) -> grpc.Channel:
        """A channel to one of the fleet's services, presenting the fleet token on every call."""
        return token_channel(address, self.auth)

    def worker(self, name: str, role: str, model: str, kv_backend: str = "tcp",
               extra_args: tuple[str, ...] = (), engine: str | None = None) -> str:
        """`kvfleet serve ROLE` as a process; returns its gRPC address once READY."""
        extra_args = self._with_targets(_engine_args(engine, tuple(extra_args), 64))
        args = ["services.cli.cli", "serve", role, "--model", model, "--worker-id", name,
                "--redis-url", self.redis_url, "--kv-backend", kv_backend, "--kv-cache-mib", "64",
                "--timeout-heartbeat-s", "0.3", "--timeout-heartbeat-ttl-s", "0.9", *extra_args]
        self.workers[name] = self.launcher.start(name, args)
        return self.workers[name]

    def _with_targets(self, args: tuple[str, ...]) -> tuple[str, ...]:
        return args if "--config" in args else (*args, *self.targets)

    def start_router(self, mode: str, name: str = "router", *extra: str) -> str:
        address = self.launcher.start(name, ["services.router", "--redis-url", self.redis_url,
                                             "--mode", mode, "--router-id", name,
                                             *self._with_targets(extra)])
        self.routers.append(address)
        return address

    def serving(self, timeout_s: float = 10.0) -> bool:
        """The first router reports SERVING (a worker registered with it) within `timeout_s`."""
        return wait_until(lambda: self.router_stub().Health(pb.HealthRequest()).status ==
                          pb.HealthResponse.SERVING, timeout_s)

    def router_stub(self) -> pb_grpc.RouterStub:
        return pb_grpc.RouterStub(self.channel(self.router))

    def stats(self, name: str) -> pb.WorkerStats:
        with self.channel(self.workers[name]) as ch:
            return pb_grpc.WorkerStub(ch).Stats(pb.StatsRequest(), timeout=5)


class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                  "wait_for_ready", "compression")),
               grpc.ClientCallDetails):
    pass


class _Present(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
               grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """What internal_channel does for grpc.aio, for a test's blocking channel."""

    def __init__(self, auth: FleetAuth) -> None:
        self._metadata = auth.metadata()

    def _with_token(self, d):
        return _Details(d.method, d.timeout, (*(d.metadata or ()), *self._metadata),
                        d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._with_token(details), requests)


def token_channel(address: str, auth: FleetAuth) -> grpc.Channel:
    """A blocking channel whose calls present `auth`'s token (a wrong one, or none, for tests)."""
    return grpc.intercept_channel(grpc.insecure_channel(address), _Present(auth))


@contextmanager
def running_fleet(redis_base_url: str, model: str, mode: str, prefill: int = 1, decode: int = 1,
                  kv_backend: str = "tcp", worker_args: tuple[str, ...] = (), routers: int = 1,
                  engine: str | None = None, hybrid_threshold_tokens: int = 0,
                  targets: str = "test"):
    """Yields a Fleet; always stops every process it started. `worker_args`: more flags for
    every worker. mode "hybrid": one mixed worker besides the prefill and decode ones, and routers
    splitting at `hybrid_threshold_tokens` (0: the router's default). `targets`: the classes' TTFT
    targets of every worker and router not given its own --config ("test" or "production")."""
    launcher = Launcher()
    fleet = Fleet(launcher, f"{redis_base_url.rsplit('/', 1)[0]}/{next(_db) % 16}", targets)
    import redis
    redis.Redis.from_url(fleet.redis_url).flushdb()
    try:
        if mode in ("colocated", "hybrid"):
            for i in range(decode if mode == "colocated" else 1):
                fleet.worker(f"mixed-{i}", "mixed", model, extra_args=worker_args,
                             engine=engine)
        if mode != "colocated":
            for i in range(prefill):
                fleet.worker(f"prefill-{i}", "prefill", model, kv_backend, worker_args, engine)
            for i in range(decode):
                fleet.worker(f"decode-{i}", "decode", model, kv_backend, worker_args, engine)
        split = ("--hybrid-threshold-tokens", str(hybrid_threshold_tokens)) \
            if mode == "hybrid" and hybrid_threshold_tokens else ()
        for i in range(routers):
            fleet.start_router(mode, "router" if i == 0 else f"router-{i}", *split)
        yield fleet
    finally:
        fleet.close()
        launcher.stop_all()


def route_request(rid: str, ids: list[int], max_tokens: int, **params) -> pb.WorkRequest:
    return pb.WorkRequest(request_id=rid, prompt_token_ids=ids,
                          params=pb.SamplingParams(max_tokens=max_tokens, **params))


@dataclass(frozen=True)
class Gateway:
    http: str
    grpc: str
    model: str

    def client(self, key_name: str | None = "acme", timeout: float = 30.0) -> httpx.Client:
        """An HTTP client with the bearer of tests/gateway's key `key_name` (None: no key)."""
        from tests.gateway.gateway_helpers import bearer  # noqa: PLC0415
        return httpx.Client(base_url=f"http://{self.http}", timeout=timeout,
                            headers=bearer(key_name) if key_name else {})


def start_gateway(fleet: Fleet, model_dir: str, name: str = "gateway", *extra: str) -> Gateway:
    """`python -m services.gateway` against the fleet's routers, as `kvfleet up` starts it."""
    http = fleet.launcher.start(name, ["services.gateway", "--model", model_dir, "--router",
                                       ",".join(fleet.routers), "--redis-url", fleet.redis_url, *extra])
    grpc_line = next(line for line in fleet.launcher.children[name].lines if line.startswith("GRPC "))
    model = model_dir.rstrip("/").rsplit("/", 1)[-1]
    return Gateway(http=http, grpc=grpc_line.split()[-1], model=model)



@contextmanager
def worker_process(model_dir, role: str, *args: str, stderr, ready_s: float = 60.0,
                   engine: str | None = None):
    """`kvfleet serve ROLE` alone (no Redis, no fleet token, one torch thread): yields (its
    Popen, its gRPC address) once READY; `stderr` (an open file) gets its log. On exit whatever
    is left of it and of what it started (its engine core, tensor-parallel ranks) is SIGKILLed."""
    import signal  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from services.cli.launcher import descendants, running  # noqa: PLC0415
    from tests.waiting import ready_line  # noqa: PLC0415
    args = _engine_args(engine, args, 512)      # kvfleet serve's default --kv-cache-mib
    proc = subprocess.Popen([sys.executable, "-m", "services.cli.cli", "serve", role, "--model",
                             str(model_dir), "--insecure-internal", "--threads", "1", *args],
                            stdout=subprocess.PIPE, stderr=stderr)
    tree: list[int] = []
    try:
        line = ready_line(proc, ready_s)
        stderr.flush()
        stderr.seek(0)
        assert line.startswith("READY "), f"the worker ended or never said READY:\n" \
                                          f"{stderr.read()[-3000:]}"
        tree = descendants(proc.pid)
        yield proc, line.split()[2]
    finally:
        tree += [pid for pid in descendants(proc.pid) if pid not in tree]
        for pid in [proc.pid, *tree]:
            if running(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        proc.wait(10)


# ------------------------------------------------------------------ in the test process

@dataclass
class Worker:
    """One in-process worker (services/worker/build.py: engine core process, transport, role,
    gRPC server, /metrics) and a client of it."""
    role: str
    built: object                 # services.worker.build.Worker
    channel: grpc.aio.Channel
    stub: pb_grpc.WorkerStub

    @property
    def address(self) -> str:
        return self.built.address

    @property
    def engine(self):             # services.worker.engine_client.EngineClient
        return self.built.engine

    @property
    def transport(self):
        return self.built.transport

    @property
    def telemetry(self):          # services.worker.telemetry.WorkerTelemetry
        return self.built.telemetry

    async def close(self) -> None:
        await self.channel.close()
        await self.built.stop()


def sim_config(kv_cache_mib: int):
    """sim_args as the SimConfig an in-process engine config takes."""
    from services.engine.config import SimConfig  # noqa: PLC0415
    return SimConfig(step_s=SIM_STEP_MS / 1000.0, kv_tokens=kv_cache_mib * TINY_KV_TOKENS_PER_MIB,
                     output_len=SIM_OUTPUT_LEN, network_gbps=100.0)


async def in_process_worker(model_dir: str, role: str, engine: str | None = None,
                            **scheduler) -> Worker:
    """A worker in this process, built by build_worker as `kvfleet serve` builds one (without
    Redis): its role from the serve entry's registry, its engine core a real process (on
    `engine`, None: ENGINE), its /metrics served. KV over tcp for prefill / decode (the test sets
    the fleet token the transports ask for)."""
    from services.cli.serve_cmd import role_named  # noqa: PLC0415
    from services.engine.engine import engine_config  # noqa: PLC0415
    from services.worker.build import build_worker  # noqa: PLC0415
    from services.worker.config import WorkerConfig  # noqa: PLC0415
    if (engine or ENGINE) != "real":
        scheduler = {"sim": sim_config(8), **scheduler}
    config = WorkerConfig(f"{role}-0", role, "tcp", metrics_port=0, engine=engine_config(
        model_dir, kv_cache_mib=8, role=role, **scheduler))
    built = build_worker(config, role_named(role))
    await built.start()
    channel = grpc.aio.insecure_channel(built.address)
    return Worker(role, built, channel, pb_grpc.WorkerStub(channel))


class InProcessGateway:
    """The gateway's HTTP app and gRPC service on a thread of the test process, against a real
    fleet: what an in-process span exporter needs to see the gateway's spans. Built as
    services/gateway/server.py builds it, less the signals, the lease renewer and the registry."""

    def __init__(self, fleet: Fleet, model_dir: str, engine_yaml: str, keys_yaml: str) -> None:
        import asyncio  # noqa: PLC0415
        import threading  # noqa: PLC0415
        from services.gateway.__main__ import build_config, parse_args  # noqa: PLC0415
        self._config = build_config(parse_args([
            "--model", model_dir, "--router", ",".join(fleet.routers), "--redis-url",
            fleet.redis_url, "--config", engine_yaml, "--api-keys", keys_yaml]))
        self._fleet = fleet
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete,
                                        args=(self._serve(),), daemon=True)
        self.http = self.grpc = ""
        self.model = self._config.served_model_name

    async def _serve(self) -> None:
        import asyncio  # noqa: PLC0415
        import grpc  # noqa: PLC0415
        from services.gateway.app import create_app  # noqa: PLC0415
        from services.gateway.core import GatewayCore  # noqa: PLC0415
        from services.gateway.grpc_api import GatewayServicer, add_to_server  # noqa: PLC0415
        from services.gateway.model import load_served_model  # noqa: PLC0415
        from services.gateway.fleet_run import Channels  # noqa: PLC0415
        from services.gateway.quota import Quotas  # noqa: PLC0415
        from services.gateway.server import _HttpServer, bind, gateway_id  # noqa: PLC0415
        from services.state.fleet_state import FleetState  # noqa: PLC0415
        import uvicorn  # noqa: PLC0415
        c = self._config
        model = load_served_model(c.model_dir, c.served_model_name, c.max_model_len,
                                  c.quality_version)
        state = FleetState(c.redis_url)
        channels = Channels(self._fleet.auth)
        self.core = GatewayCore(c, model, Quotas(state, gateway_id()), channels)
        grpc_server = grpc.aio.server()
        add_to_server(GatewayServicer(self.core), grpc_server)
        self.grpc = f"127.0.0.1:{grpc_server.add_insecure_port('127.0.0.1:0')}"
        await grpc_server.start()
        sock = bind("127.0.0.1", 0)
        self._http = _HttpServer(uvicorn.Config(create_app(self.core), lifespan="off",
                                                log_level="warning", access_log=False))
        task = asyncio.create_task(self._http.serve(sockets=[sock]))
        while not self._http.started:
            await asyncio.sleep(0.01)
        self.http = f"127.0.0.1:{sock.getsockname()[1]}"
        self._ready.set()
        await task
        await self.core.close()
        await grpc_server.stop(0)
        await channels.close()
        await state.close()

    def __enter__(self) -> "InProcessGateway":
        self._thread.start()
        assert self._ready.wait(30), "the in-process gateway did not start"
        return self

    def __exit__(self, *exc) -> None:
        self._http.should_exit = True
        self._thread.join(10)
        self._loop.close()


def engine_core_pid(worker_pid: int) -> int:
    """The pid of the engine core process under a worker process."""
    from services.cli.launcher import descendants  # noqa: PLC0415
    for pid in descendants(worker_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"services.worker.engine_core" in f.read():
                    return pid
        except OSError:
            continue                              # gone meanwhile
    raise AssertionError(f"process {worker_pid} has no engine core")
