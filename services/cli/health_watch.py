"""Whether `kvfleet up`'s children still answer: a health probe of each, in the background.

The supervisor (services/cli/supervisor.py) restarts a child that exits; a child that stops without
exiting (SIGSTOP, a deadlock, a worker whose engine core is frozen) is seen only here. Every
`every_s`, each child that has printed its READY line is probed on a thread of a small pool (a
probe of a frozen child waits out its own timeout, and holds up nothing else):

  worker-like (prefill-*, decode-*, mixed-*)  Worker.Health over gRPC; healthy only when SERVING
                                              (a worker reports a stalled engine core NOT_SERVING,
                                              services/worker/serve.py)
  router-*                                    Router.Health over gRPC; any answer (NOT_SERVING only
                                              says that the fleet lacks a role, not the router)
  gateway                                     GET /metrics over HTTP; any answer (/health asks the
                                              routers, which may be what is down)

`silent_s(name, child, now)` is how long a child has gone without a healthy answer: counted from
its READY line, or its last healthy answer; None before READY (it is still loading). A new child
under the same name (a restart) starts over.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import httpx

from services.cli.launcher import Child
from services.protocol.fleet_token import FleetAuth
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc

Probe = Callable[[str, str], bool]      # (child name, its address) -> answered healthy
WORKER_ROLES = ("prefill", "decode", "mixed")


class FleetProbe:
    """The probe of a `kvfleet up` fleet's children (see the module docstring)."""

    def __init__(self, auth: FleetAuth, timeout_s: float) -> None:
        self._metadata = auth.metadata()
        self._timeout_s = timeout_s
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def __call__(self, name: str, address: str) -> bool:
        try:
            if name == "gateway":
                httpx.get(f"http://{address}/metrics", timeout=self._timeout_s)
                return True
            if name.startswith("router-"):
                pb_grpc.RouterStub(self._channel(address)).Health(
                    pb.HealthRequest(), timeout=self._timeout_s, metadata=self._metadata)
                return True
            answer = pb_grpc.WorkerStub(self._channel(address)).Health(
                pb.HealthRequest(), timeout=self._timeout_s, metadata=self._metadata)
            return answer.status == pb.HealthResponse.SERVING
        except grpc.RpcError:
            self._forget(address)
            return False
        except httpx.HTTPError:
            return False

    def _forget(self, address: str) -> None:
        """A failed probe's channel is dropped: a channel that failed to connect waits out a
        growing reconnect backoff (grpc's, up to 120 s), during which a service restarted on the
        same port would look silent; the next probe connects afresh."""
        with self._lock:
            channel = self._channels.pop(address, None)
        if channel is not None:
            channel.close()

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = grpc.insecure_channel(address)
            return channel


@dataclass
class _Watch:
    child: Child
    healthy_at: float                    # READY, or the last healthy answer
    probed_at: float = float("-inf")
    probe: Future | None = None


@dataclass
class HealthWatch:
    probe: Probe
    every_s: float = 1.0
    clock: Callable[[], float] = time.monotonic
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(8, thread_name_prefix="kvfleet-probe"))
    _watches: dict[str, _Watch] = field(default_factory=dict)

    def silent_s(self, name: str, child: Child, now: float) -> float | None:
        """Seconds since `child` last answered healthy (or printed READY); None before READY.
        Starts a probe when one is due and none is in flight."""
        if not child.address:
            return None
        watch = self._watches.get(name)
        if watch is None or watch.child is not child:
            watch = self._watches[name] = _Watch(child, healthy_at=now)
        if watch.probe is None and now - watch.probed_at >= self.every_s:
            watch.probed_at = now
            watch.probe = self.pool.submit(self.probe, name, child.address)
            watch.probe.add_done_callback(lambda done, w=watch: self._answered(w, done))
        return now - watch.healthy_at

    def probing(self) -> int:
        """Probes in flight now."""
        return sum(1 for w in self._watches.values() if w.probe is not None)

    def forget(self, name: str) -> None:
        self._watches.pop(name, None)

    def _answered(self, watch: _Watch, done: Future) -> None:
        if not done.cancelled() and done.exception() is None and done.result():
            watch.healthy_at = max(watch.healthy_at, self.clock())
        watch.probe = None
