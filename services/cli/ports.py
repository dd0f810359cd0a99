"""`kvfleet up --port-base P`: every listener of the fleet on a port fixed by one table.

    offset      listener                                         index
    P+0         gateway HTTP (OpenAI REST, /metrics)
    P+1         gateway gRPC
    P+2         Redis (the embedded one, when `up` starts it)
    P+10+k      router-k gRPC                                    k < 10
    P+20+k      router-k /metrics
    P+30+i      prefill-i gRPC                                   i < 10
    P+40+i      prefill-i /metrics
    P+50+i      prefill-i KV receiver (tcp backend)
    P+60+i      decode-i gRPC (mixed-i when --mode colocated)    i < 10
    P+70+i      decode-i /metrics
    P+80+i      decode-i KV receiver (tcp backend; a mixed worker moves no KV)

A port depends only on P, the service's role and index and the listener's kind, never on how
many of the others there are. Without --port-base every listener but the gateway's takes a free
port from the OS, as before. `up` checks every planned port before it starts anything, and
refuses with the first that is taken (`taken`). The NIXL backend's UCX sockets are UCX's own:
only the tcp backend's KV receiver is on the table.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass

HOST = "127.0.0.1"
PER_BLOCK = 10            # services of one role on one table: indexes 0..9
SPAN = 90                 # P .. P+SPAN-1 may be used
OFFSETS = {("gateway", "http"): 0, ("gateway", "grpc"): 1, ("redis", "redis"): 2,
           ("router", "grpc"): 10, ("router", "metrics"): 20,
           ("prefill", "grpc"): 30, ("prefill", "metrics"): 40, ("prefill", "kv"): 50,
           ("decode", "grpc"): 60, ("decode", "metrics"): 70, ("decode", "kv"): 80,
           ("mixed", "grpc"): 60, ("mixed", "metrics"): 70}
CHILD_FLAGS = {"grpc": "--port", "metrics": "--metrics-port", "kv": "--kv-port"}


@dataclass(frozen=True)
class Listener:
    service: str          # gateway | redis | router-0 | prefill-1 | decode-0 | mixed-0 ...
    kind: str             # http | grpc | metrics | kv | redis
    port: int
    host: str = HOST          # the gateway binds up's --host; everything else loopback

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def offset(service: str, kind: str) -> int:
    """P + offset(service, kind) is the listener's port; `service` as `up` names it."""
    role, _, index = service.partition("-")
    return OFFSETS[(role, kind)] + (int(index) if index else 0)


def kinds(service: str, kv: bool) -> list[str]:
    """The listeners a service has (`kv`: its workers move KV over the tcp backend)."""
    role = service.partition("-")[0]
    return [kind for (r, kind) in OFFSETS if r == role and (kind != "kv" or kv)]


def plan(base: int, services: list[str], kv: bool, gateway_host: str = "127.0.0.1"
         ) -> list[Listener]:
    """Every listener of `services` on its table port; ValueError if the table cannot hold them."""
    if not 1024 <= base <= 65535 - SPAN:
        raise ValueError(f"--port-base must be in 1024..{65535 - SPAN}, got {base}")
    too_many = [s for s in services if int(s.partition("-")[2] or 0) >= PER_BLOCK]
    if too_many:
        raise ValueError(f"--port-base has room for {PER_BLOCK} services of each role; "
                         f"{', '.join(too_many)} has none")
    return [Listener(s, kind, base + offset(s, kind), gateway_host if s == "gateway" else HOST)
            for s in services for kind in kinds(s, kv)]


def child_args(listeners: list[Listener], service: str) -> list[str]:
    """The flags that put a router or worker on its table ports (`--port`, `--metrics-port`,
    `--kv-port`)."""
    return [arg for x in listeners if x.service == service and x.kind in CHILD_FLAGS
            for arg in (CHILD_FLAGS[x.kind], str(x.port))]


def taken(listeners: list[Listener]) -> Listener | None:
    """The first listener whose port cannot be bound now (something listens there).
    SO_REUSEADDR as the servers set it: a port with only TIME_WAIT connections counts as free."""
    for x in listeners:
        with socket.socket(socket.AF_INET6 if ":" in x.host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((x.host, x.port))
            except OSError:
                return x
    return None
