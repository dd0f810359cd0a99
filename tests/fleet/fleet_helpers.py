"""A real fleet on 127.0.0.1 for tests: redis-server, workers and routers as processes. Their
Launcher hands them one fleet token; `Fleet.channel` makes channels whose calls carry it.

`Fleet.generate(request)` runs a request the way the gateway does (services/gateway/plan.py: a
router's plan, then the workers' streams), on an event loop of its own thread, and returns a
blocking `FleetCall`: iterate it for the TokenChunks, `cancel()` it like a gRPC call."""
from __future__ import annotations

import asyncio
import collections
import itertools
import threading
from contextlib import contextmanager

import grpc

from services.protocol.fleet_token import FleetAuth
from services.protocol.listeners import listening_sockets  # noqa: F401 - the fleet tests' import
from services.cli.launcher import Launcher
from services.gateway.plan import Channels, PlanRun, Routers
from services.protocol.timeouts import Timeouts
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc

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

    def __init__(self, loop: _Loop, run: PlanRun) -> None:
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
    def __init__(self, launcher: Launcher, redis_url: str) -> None:
        self.launcher = launcher
        self.redis_url = redis_url
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
        return FleetCall(self._loop, PlanRun(request, self._routers, self._channels,
                                             self.timeouts))

    def close(self) -> None:
        if self._loop is not None:
            self._loop.run(self._channels.close())
            self._loop.close()

    def channel(self, address: str) -> grpc.Channel:
        """A channel to one of the fleet's services, presenting the fleet token on every call."""
        return token_channel(address, self.auth)

    def worker(self, name: str, role: str, model: str, kv_backend: str = "tcp",
               extra_args: tuple[str, ...] = ()) -> str:
        args = ["services.cli.cli", "serve", role, "--model", model, "--worker-id", name,
                "--redis-url", self.redis_url, "--kv-backend", kv_backend, "--kv-cache-mib", "64",
                "--timeout-heartbeat-s", "0.3", "--timeout-heartbeat-ttl-s", "0.9", *extra_args]
        self.workers[name] = self.launcher.start(name, args)
        return self.workers[name]

    def start_router(self, mode: str, name: str = "router") -> str:
        address = self.launcher.start(name, ["services.router", "--redis-url", self.redis_url,
                                             "--mode", mode, "--router-id", name])
        self.routers.append(address)
        return address

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
                  kv_backend: str = "tcp", worker_args: tuple[str, ...] = (), routers: int = 1):
    """Yields a Fleet; always stops every process it started. `worker_args`: more flags for
    every worker."""
    launcher = Launcher()
    fleet = Fleet(launcher, f"{redis_base_url.rsplit('/', 1)[0]}/{next(_db) % 16}")
    import redis
    redis.Redis.from_url(fleet.redis_url).flushdb()
    try:
        if mode == "colocated":
            for i in range(decode):
                fleet.worker(f"mixed-{i}", "mixed", model, extra_args=worker_args)
        else:
            for i in range(prefill):
                fleet.worker(f"prefill-{i}", "prefill", model, kv_backend, worker_args)
            for i in range(decode):
                fleet.worker(f"decode-{i}", "decode", model, kv_backend, worker_args)
        for i in range(routers):
            fleet.start_router(mode, "router" if i == 0 else f"router-{i}")
        yield fleet
    finally:
        fleet.close()
        launcher.stop_all()


def route_request(rid: str, ids: list[int], max_tokens: int, **params) -> pb.WorkRequest:
    return pb.WorkRequest(request_id=rid, prompt_token_ids=ids,
                          params=pb.SamplingParams(max_tokens=max_tokens, **params))


