"""A real fleet on 127.0.0.1 for tests: redis-server, workers and router as processes."""
from __future__ import annotations

import itertools
from contextlib import contextmanager

import grpc

from services.common.launcher import Launcher
from services.common.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.common.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc

_db = itertools.count(1)


class Fleet:
    def __init__(self, launcher: Launcher, redis_url: str) -> None:
        self.launcher = launcher
        self.redis_url = redis_url
        self.workers: dict[str, str] = {}
        self.router = ""

    def worker(self, name: str, role: str, model: str, kv_backend: str = "tcp") -> str:
        args = ["services.common.cli", "serve", role, "--model", model, "--worker-id", name,
                "--redis-url", self.redis_url, "--kv-backend", kv_backend, "--kv-cache-mib", "64",
                "--heartbeat-s", "0.3"]
        self.workers[name] = self.launcher.start(name, args)
        return self.workers[name]

    def start_router(self, mode: str) -> str:
        self.router = self.launcher.start("router", ["services.router", "--redis-url",
                                                     self.redis_url, "--mode", mode])
        return self.router

    def router_stub(self) -> pb_grpc.RouterStub:
        return pb_grpc.RouterStub(grpc.insecure_channel(self.router))

    def stats(self, name: str) -> pb.WorkerStats:
        with grpc.insecure_channel(self.workers[name]) as ch:
            return pb_grpc.WorkerStub(ch).Stats(pb.StatsRequest(), timeout=5)


@contextmanager
def running_fleet(redis_base_url: str, model: str, mode: str, prefill: int = 1, decode: int = 1,
                  kv_backend: str = "tcp"):
    """Yields a Fleet; always stops every process it started."""
    launcher = Launcher()
    fleet = Fleet(launcher, f"{redis_base_url.rsplit('/', 1)[0]}/{next(_db) % 16}")
    import redis
    redis.Redis.from_url(fleet.redis_url).flushdb()
    try:
        if mode == "colocated":
            for i in range(decode):
                fleet.worker(f"mixed-{i}", "mixed", model)
        else:
            for i in range(prefill):
                fleet.worker(f"prefill-{i}", "prefill", model, kv_backend)
            for i in range(decode):
                fleet.worker(f"decode-{i}", "decode", model, kv_backend)
        fleet.start_router(mode)
        yield fleet
    finally:
        launcher.stop_all()


def route_request(rid: str, ids: list[int], max_tokens: int, **params) -> pb.RouteRequest:
    return pb.RouteRequest(request_id=rid, prompt_token_ids=ids,
                           params=pb.SamplingParams(max_tokens=max_tokens, **params))
