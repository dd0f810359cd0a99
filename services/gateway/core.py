"""What REST and gRPC share: authenticate, admit (quotas), open the router stream, end it cleanly.

A `Session` is one live generation:
  1. `GatewayCore.open(gen)`: quota admitted (slot + request + prompt tokens), then a
     `Router.Generate(RouteRequest)` call started on the gateway's mux call to the router
     (services/protocol/mux.py); the session is registered under its request id;
  2. `first()`, then `next()` until None: the router's TokenChunks; router statuses become GatewayErrors;
  3. `close()`, exactly once whatever happened (finished, client gone, error, Cancel): cancels the
     router call if it still runs (the router then cancels the request on every worker it touched)
     and releases the stream slot in a task of its own, so it also runs from a cancelled task.
"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import TypeVar

import grpc

from services.state.fleet_state import StreamLease
from services.protocol.mux import MuxCall, MuxChannel, connect_to
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.gateway import errors
from services.gateway.auth import KeyRing
from services.gateway.config import ApiKey, GatewayConfig
from services.gateway.model import ServedModel
from services.gateway.quota import Quotas
from services.gateway.validation import Generation, Validator

T = TypeVar("T")

HEALTH_TIMEOUT_S = 2.0
# A body this small validates and tokenizes in well under a millisecond: done on the event loop,
# since a hop to a worker thread (and back, under the GIL) costs more than the work. Larger bodies
# (long prompts: tokenizing 32K tokens of text takes tens of ms) go to a thread.
INLINE_BUILD_BYTES = 16 * 1024


async def build_generation(size: int, build: Callable[..., T], *args) -> T:
    """build(*args) (validate and tokenize) for a request of `size` bytes: on the event loop when
    small, in a thread otherwise (INLINE_BUILD_BYTES)."""
    return build(*args) if size <= INLINE_BUILD_BYTES else await asyncio.to_thread(build, *args)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def internal_request_id(client_id: str, tenant: str) -> str:
    """The fleet-wide id of a request whose id the client chose ("" if it chose none)."""
    return f"{tenant}:{client_id}" if client_id else ""


# The finish reasons a client sees (OpenAI's); any other ending the fleet reports becomes an error
# (a status before the first token, an SSE error event after it). "abort" reaches a client only
# when it cancelled the request itself (gRPC Cancel).
CLIENT_FINISH_REASONS = ("stop", "length")


def _ending_error(chunk: pb.TokenChunk) -> errors.GatewayError:
    if chunk.finish_reason == "rejected":
        retry = chunk.retry_after_s if chunk.HasField("retry_after_s") else None
        return errors.overloaded(chunk.error or "rejected by admission", retry)
    if chunk.finish_reason == "abort":
        return errors.unavailable("the request was aborted inside the fleet (a worker stopped "
                                  "or cancelled it)")
    return errors.GatewayError(502, f"a worker failed: {chunk.finish_reason}: {chunk.error}",
                               code="upstream_error")


class Session:
    def __init__(self, core: GatewayCore, gen: Generation, call: MuxCall) -> None:
        self.core = core
        self.gen = gen
        self.call = call                 # Router.Generate, on the mux to the router
        self.output_tokens = 0
        self.prompt_tokens = len(gen.prompt_ids)
        self.aborted = False             # ended by a Cancel call, or by shutdown
        self.shutting_down = False       # ... by shutdown: the client gets an error, not a finish
        self._closed = False
        self._ended = False

    @property
    def request_id(self) -> str:
        return self.gen.request_id

    async def next(self) -> pb.TokenChunk | None:
        """The next chunk, or None after the last one. A router failure raises GatewayError."""
        if self._ended:
            return None
        try:
            chunk = await self.call.read()
        except grpc.aio.AioRpcError as e:
            self._ended = True
            raise errors.from_router(e) from None
        except asyncio.CancelledError:
            if not self.aborted or asyncio.current_task().cancelling():
                raise
            if self.shutting_down:
                raise errors.unavailable("the gateway is shutting down; retry", None,
                                         "shutting_down") from None
            chunk = pb.TokenChunk(request_id=self.request_id, finished=True, finish_reason="abort")
        if chunk is grpc.aio.EOF:
            self._ended = True
            return None
        self.output_tokens += len(chunk.token_ids)
        self.prompt_tokens = chunk.num_prompt_tokens or self.prompt_tokens
        self._ended = chunk.finished
        if chunk.finished and chunk.finish_reason not in CLIENT_FINISH_REASONS and not self.aborted:
            raise _ending_error(chunk)
        return chunk

    async def first(self) -> pb.TokenChunk:
        """The first chunk; a request the fleet refused before any token raises GatewayError."""
        chunk = await self.next()
        if chunk is None:
            raise errors.GatewayError(502, "the router ended the stream without output",
                                      code="upstream_error")
        return chunk

    def close(self) -> None:
        """Idempotent and synchronous, so `finally` blocks of cancelled tasks can call it."""
        if self._closed:
            return
        self._closed = True
        if not self._ended:
            self.call.cancel()   # the router stops it and cancels it on every worker it touched
        self.core._ended(self)


class GatewayCore:
    def __init__(self, config: GatewayConfig, model: ServedModel, quotas: Quotas,
                 channel: grpc.aio.Channel) -> None:
        self.config = config
        self.model = model
        self.keys = KeyRing(config.api_keys)
        self.validator = Validator(model)
        self.quotas = quotas
        self.channel = channel
        self.router = pb_grpc.RouterStub(channel)
        self.router_mux = MuxChannel(connect_to(self.router, config.router), config.router)
        self._live: dict[str, Session] = {}
        self._opening: set[str] = set()          # request ids whose quota admission is under way
        self._leases: dict[str, StreamLease] = {}   # request id -> its stream slot, while live
        self._cleanup: set[asyncio.Task] = set()

    def authenticate(self, authorization: str | None) -> ApiKey:
        return self.keys.authenticate(authorization)

    async def open(self, gen: Generation) -> Session:
        rid = gen.request_id
        if rid in self._live or rid in self._opening:
            raise errors.bad_request(f"request id {rid!r} is already in use", "request_id",
                                     "duplicate_request_id")
        self._opening.add(rid)       # a second open of this id waits for nothing: it is refused
        try:
            lease = await self.quotas.admit(gen.key, len(gen.prompt_ids))
        finally:
            self._opening.discard(rid)
        try:
            call = self.router_mux.call("generate", pb.RouteRequest(
                request_id=rid, tenant=gen.key.tenant, traffic_class=gen.traffic_class.name,
                prompt_token_ids=gen.prompt_ids, params=gen.params))
        except BaseException:
            self._finish_soon(lease, 0)
            raise
        # invariant: a live session's lease is in _leases until _ended gives it back
        self._leases[rid] = lease
        session = self._live[rid] = Session(self, gen, call)
        return session

    def cancel(self, request_id: str, tenant: str) -> bool:
        """Only the tenant that owns a request may cancel it; `request_id` as the client knows it."""
        session = self._live.get(request_id) or self._live.get(internal_request_id(request_id, tenant))
        if session is None or session.gen.key.tenant != tenant:
            return False
        session.aborted = True
        session.close()
        return True

    def _ended(self, session: Session) -> None:
        self._live.pop(session.request_id, None)
        lease = self._leases.pop(session.request_id, None)
        if lease is not None:
            self._finish_soon(lease, session.output_tokens)

    def _finish_soon(self, lease: StreamLease, output_tokens: int) -> None:
        """Give the slot back in a task of its own (so it also runs from a cancelled task)."""
        task = asyncio.get_running_loop().create_task(self.quotas.finish(lease, output_tokens))
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

    async def health(self) -> tuple[bool, str]:
        """(serving, detail): the router's health, and whether the quota store answers."""
        try:
            resp = await self.router.Health(pb.HealthRequest(), timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            return False, f"router {self.config.router} unreachable: {e.code().name}"
        try:
            problem = await asyncio.wait_for(self.quotas.check(), HEALTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            problem = "quota store unavailable (Redis): no answer in time"
        if problem:
            return False, problem
        return resp.status == pb.HealthResponse.SERVING, f"router: {resp.detail}"

    async def close(self) -> None:
        """Shutdown: every live request ends with an error (503 shutting_down, or an SSE error
        event once streaming), and its slot is released."""
        for session in list(self._live.values()):
            session.aborted = session.shutting_down = True
            session.close()
        if self._cleanup:
            await asyncio.gather(*self._cleanup, return_exceptions=True)
