"""A real fleet on 127.0.0.1 for tests: redis-server, workers and router as processes. Their
Launcher hands them one fleet token; `Fleet.channel` makes channels whose calls carry it."""
from __future__ import annotations

import collections
import ipaddress
import itertools
import os
from contextlib import contextmanager

import grpc

from services.protocol.fleet_token import FleetAuth
from services.cli.launcher import Launcher
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc

_db = itertools.count(1)


class Fleet:
    def __init__(self, launcher: Launcher, redis_url: str) -> None:
        self.launcher = launcher
        self.redis_url = redis_url
        self.workers: dict[str, str] = {}
        self.router = ""
        self.auth = FleetAuth.from_env(launcher.env)      # the token its processes ask for

    def channel(self, address: str) -> grpc.Channel:
        """A channel to one of the fleet's services, presenting the fleet token on every call."""
        return token_channel(address, self.auth)

    def worker(self, name: str, role: str, model: str, kv_backend: str = "tcp",
               extra_args: tuple[str, ...] = ()) -> str:
        args = ["services.cli.cli", "serve", role, "--model", model, "--worker-id", name,
                "--redis-url", self.redis_url, "--kv-backend", kv_backend, "--kv-cache-mib", "64",
                "--heartbeat-s", "0.3", *extra_args]
        self.workers[name] = self.launcher.start(name, args)
        return self.workers[name]

    def start_router(self, mode: str) -> str:
        self.router = self.launcher.start("router", ["services.router", "--redis-url",
                                                     self.redis_url, "--mode", mode])
        return self.router

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
                  kv_backend: str = "tcp", worker_args: tuple[str, ...] = ()):
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
        fleet.start_router(mode)
        yield fleet
    finally:
        launcher.stop_all()


def route_request(rid: str, ids: list[int], max_tokens: int, **params) -> pb.RouteRequest:
    return pb.RouteRequest(request_id=rid, prompt_token_ids=ids,
                           params=pb.SamplingParams(max_tokens=max_tokens, **params))


def listening_sockets(pids: list[int]) -> set[tuple[str, int]]:
    """(ip, port) of every TCP socket in LISTEN that one of `pids` holds (Linux /proc)."""
    inodes = set()
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        for fd in os.listdir(fd_dir):
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue                    # closed meanwhile
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state != "0A" or inode not in inodes:     # 0A: LISTEN
                    continue
                hex_ip, hex_port = local.split(":")
                raw = bytes.fromhex(hex_ip)
                # /proc prints the address as 32-bit words in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                ip = ipaddress.ip_address(raw[:width])
                ip = getattr(ip, "ipv4_mapped", None) or ip       # ::ffff:127.0.0.1 is 127.0.0.1
                found.add((str(ip), int(hex_port, 16)))
    return found
