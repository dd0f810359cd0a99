"""What a role is to the worker: the typed protocol a role package implements, and what the worker
hands it when it starts.

The worker (build.py) serves one role and knows none by name: it makes the engine core, the KV
transport when the role `moves_kv`, the telemetry and the capacity notifier, starts the role with
them (`RoleParts`), and answers the Worker RPCs the role's `calls()` names; any other of those RPCs
fails WRONG_ROLE. Cancel, Stats and Health are the worker's, asking the role for its part
(`cancel`, `load`, `readiness`). The roles live in services/prefill, services/decode and
services/mixed; the process entry (services/cli/serve_cmd.py) picks one by name.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.worker.capacity import CapacityNotifier
from services.worker.config import WorkerConfig
from services.worker.engine_client import EngineClient
from services.worker.telemetry import WorkerTelemetry

if TYPE_CHECKING:                 # the transports load torch; a type needs none of it
    from services.kv_transfer.base import KVTransport

Context = Any     # a grpc.aio.ServicerContext; None where a test calls a handler directly


@dataclass(frozen=True)
class RoleParts:
    """What the worker gives its role at start."""
    config: WorkerConfig
    engine: EngineClient               # started
    transport: KVTransport | None      # registered on the engine's KV pool; None unless moves_kv
    telemetry: WorkerTelemetry
    capacity: CapacityNotifier         # tell it the KV blocks a request gave back (waiting routers)


@dataclass(frozen=True)
class RoleCalls:
    """The role's own Worker RPCs; one left None is not this role's (WRONG_ROLE)."""
    reserve: Callable[[pb.ReserveRequest, Context], Awaitable[pb.ReserveResponse]] | None = None
    decode_stream: Callable[[AsyncIterator[pb.DecodeSubscribe], Context],
                            AsyncIterator[pb.DecodeBatch]] | None = None
    prefill: Callable[[pb.PrefillRequest, Context], AsyncIterator[pb.PrefillReply]] | None = None
    generate: Callable[[pb.WorkRequest, Context], AsyncIterator[pb.TokenChunk]] | None = None


@dataclass(frozen=True)
class RoleLoad:
    """What the role holds beyond the engine's own stats (WorkerStats carries both)."""
    kv_writes_in_flight: int = 0       # KV writes this worker is sending
    kv_blocks_held: int = 0            # blocks of ended reservations a write may still land in


@runtime_checkable
class Role(Protocol):
    name: str          # prefill | decode | mixed: the role WorkerConfig.role names
    moves_kv: bool     # the worker makes it a KV transport (config.kv_backend)

    def calls(self) -> RoleCalls:
        """The RPC handlers this role answers."""
        ...

    async def start(self, parts: RoleParts) -> None:
        """Take the worker's parts; called once, before the server takes calls."""
        ...

    def stop(self) -> None:
        """The worker is stopping: end every open call and request (synchronous)."""
        ...

    def readiness(self) -> str | None:
        """Why this role cannot take calls now (Health: NOT_SERVING), or None when it can."""
        ...

    async def cancel(self, request_id: str, reservation: float | None = None) -> bool:
        """End a request here (the Cancel RPC); whether this worker held it. `reservation`: only
        while it holds the reservation that expires then (a plan's release, CancelRequest's
        reservation_deadline_unix_s); a role that makes no reservations holds none."""
        ...

    def load(self) -> RoleLoad:
        ...


class RoleState:
    """The life a role goes through (not started, serving, stopped) and its readiness answer:
    the part every role shares."""

    def __init__(self) -> None:
        self.started = False
        self.stopped = False

    def readiness(self) -> str | None:
        if self.stopped:
            return "stopping"
        if not self.started:
            return "starting"
        return None
