"""The standard gRPC health protocol (`grpc.health.v1.Health`: what Kubernetes' gRPC probes and
`grpc_health_probe` call) on every kvfleet gRPC server, answered from the service's own Health.

  names:  "" (the server as a whole) and the kvfleet service's full name, e.g. "kvfleet.v1.Worker";
          any other name is NOT_FOUND, as the protocol says
  Check:  asks the service's own `Health` at that moment (no cached answer): SERVING or NOT_SERVING
  Watch:  grpcio-health-checking's; the status it streams is refreshed on every Check and every
          `refresh_s` while the server runs
  stop:   `stopping()` at the start of a shutdown or a drain: NOT_SERVING from then on, before the
          server stops taking calls, so a probe takes the process out of rotation first
  auth:   health calls need no fleet token (a kubelet has none; services/protocol/fleet_token.py
          lets this service through); they reveal SERVING or not, and nothing else
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb

log = logging.getLogger(__name__)

SERVICE = "grpc.health.v1.Health"
REFRESH_S = 1.0          # how often a Watch's status is refreshed from the service's own Health

OwnHealth = Callable[[pb.HealthRequest, object], Awaitable[pb.HealthResponse]]
_SERVING = {pb.HealthResponse.SERVING: health_pb2.HealthCheckResponse.SERVING}


class StandardHealth(health.aio.HealthServicer):
    """`grpc.health.v1.Health` for one kvfleet service (`name`), from its `own` Health call."""

    def __init__(self, name: str, own: OwnHealth, refresh_s: float = REFRESH_S) -> None:
        super().__init__()
        self._name, self._own, self._refresh_s = name, own, refresh_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._refresh_forever())

    async def stopping(self) -> None:
        """NOT_SERVING from now on, whatever the service's own Health says."""
        await self.enter_graceful_shutdown()

    async def close(self) -> None:
        await self.stopping()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def Check(self, request, context):
        await self.refresh()
        return await super().Check(request, context)

    async def refresh(self) -> None:
        try:
            own = await self._own(pb.HealthRequest(), None)
            status = _SERVING.get(own.status, health_pb2.HealthCheckResponse.NOT_SERVING)
        except Exception as e:  # noqa: BLE001 - a failing Health is an unhealthy service, not a crash
            log.warning("%s: its own Health failed (%s); standard health says NOT_SERVING",
                        self._name, e)
            status = health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", self._name):
            await self.set(name, status)

    async def _refresh_forever(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self._refresh_s)


def add_standard_health(server, name: str, own: OwnHealth) -> StandardHealth:
    """Serve `grpc.health.v1.Health` on `server` for the kvfleet service `name`; call `start()`
    once the event loop runs and `stopping()` / `close()` at shutdown."""
    servicer = StandardHealth(name, own)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer
