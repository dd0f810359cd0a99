"""What REST and gRPC share: authenticate, admit (quotas), run the request's plan, end it cleanly.

A `Session` is one live generation:
  1. `GatewayCore.open(gen)`: quota admitted (slot + request + prompt tokens), then a `FleetRun`
     (fleet_run.py): a router's Admit answers with the plan, and the run streams from the workers it
     names; the session is registered under its request id;
  2. `first()`, then `next()` until None: the workers' TokenChunks, their text made here
     (output_processor.py: detokenizing, stop strings); typed failures
     (services/protocol/status.py) become GatewayErrors;
  3. the front end calls `sent(chunk)` once a chunk is on its way to the client: those tokens,
     and only those, are charged to the tenant (usage accounting, below);
  4. `close()`, exactly once whatever happened (finished, client gone, error, Cancel): a run that
     did not finish cancels its calls and the request on every worker it touched, and the stream
     slot is released in a task of its own, so it also runs from a cancelled task.

Usage accounting, the same on every ending (finished, client cancel or disconnect, error, worker
death, shutdown): the tokens the client was sent are charged when the session closes, to the
tenant's Redis token window (Quotas.finish -> FleetState.finish_stream) and to
kvfleet_generation_tokens_total (telemetry.RequestTelemetry.end), from the one count
`sent_tokens`. A Cancel call only stops the run (`stop`): the front end still sends what it has
and closes the session, so a chunk in flight when the Cancel came is charged if it was sent.
"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import TypeVar

from services.protocol import status
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.timeouts import Timeouts
from services.state.fleet_state import StreamLease
from services.gateway import errors
from services.gateway.auth import KeyRing
from services.gateway.config import ANONYMOUS_KEY, ApiKey, GatewayConfig
from services.gateway.door import Door, Seat
from services.gateway.model import ServedModel
from services.gateway.output_processor import OutputProcessor
from services.gateway.fleet_run import Channels, FleetRun, Routers
from services.gateway.quota import Quotas
from services.gateway.telemetry import GatewayTelemetry, RequestTelemetry
from services.gateway.validation import Generation, Validator

T = TypeVar("T")

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


class Session:
    def __init__(self, core: GatewayCore, gen: Generation, run: FleetRun,
                 telemetry: RequestTelemetry, seat: Seat | None = None) -> None:
        self.core = core
        self.seat = seat                 # its place inside the front door, left at close
        self.gen = gen
        self.run = run                   # the request's plan, run against the workers
        self.telemetry = telemetry
        self.output_tokens = 0           # tokens received from the fleet
        self.sent_tokens = 0             # ... and sent to the client: what is charged
        self.prompt_tokens = len(gen.prompt_ids)
        self.aborted = False             # ended by a Cancel call, or by shutdown
        self.shutting_down = False       # ... by shutdown: the client gets an error, not a finish
        self.error: errors.GatewayError | None = None   # what ended it, when a failure did
        self.finished = False            # its last chunk (stop | length) was sent
        # the text of the fleet's token ids, made here once
        self.output = OutputProcessor(core.model.tokenizer, gen.prompt_ids, gen.params)
        self._closed = False
        self._ended = False

    @property
    def request_id(self) -> str:
        return self.gen.request_id

    async def next(self) -> pb.TokenChunk | None:
        """The next chunk, or None after the last one. A fleet failure raises GatewayError."""
        if self._ended:
            return None
        try:
            chunk = await self._next()
        except errors.GatewayError as e:
            self.error = e
            raise
        finally:
            self.telemetry.admitted(self.run.plan, self.run.admitted_at)
        if chunk is not None:
            self.telemetry.arrived(chunk)
        return chunk

    async def _next(self) -> pb.TokenChunk | None:
        try:
            if self.aborted:             # stopped before it asked: nothing more will come
                raise asyncio.CancelledError()
            chunk = await self._fleet_chunk()
        except status.CallFailed as e:
            self._ended = True
            raise errors.from_status(e.status) from None
        except asyncio.CancelledError:
            if not self.aborted or asyncio.current_task().cancelling():
                raise
            self._ended = True
            if self.shutting_down:
                raise errors.unavailable("the gateway is shutting down; retry", None,
                                         "shutting_down").tagged("SHUTTING_DOWN") from None
            chunk = pb.TokenChunk(request_id=self.request_id, finished=True, finish_reason="abort")
        if chunk is None:
            self._ended = True
            return None
        self.output_tokens += len(chunk.token_ids)
        self.prompt_tokens = chunk.num_prompt_tokens or self.prompt_tokens
        self._ended = chunk.finished
        if chunk.finished and chunk.finish_reason not in CLIENT_FINISH_REASONS and not self.aborted:
            raise errors.GatewayError(502, f"a worker ended the request with "
                                      f"{chunk.finish_reason or 'no reason'}: {chunk.error}",
                                      code="upstream_error").tagged("WORKER_ENDED")
        return chunk

    async def _fleet_chunk(self) -> pb.TokenChunk | None:
        """The fleet's next chunk with its text (output_processor.py). A stop string that ends
        the request here ends the run too: the workers cancel it and free what it holds. One that
        ends a sample while others run (n > 1) ends that sample alone on its worker."""
        while (chunk := await self.run.next()) is not None:
            ended_by_fleet, sample_ended_by_fleet = chunk.finished, bool(chunk.finish_reason)
            if (chunk := self.output.process(chunk)) is None:
                continue          # a sample stopped here: what the workers still send is dropped
            if chunk.finished and not ended_by_fleet:
                self.run.close()
            elif chunk.finish_reason and not sample_ended_by_fleet and not chunk.finished:
                self.run.end_sample(chunk.index)
            return chunk
        return None

    def sent(self, chunk: pb.TokenChunk) -> None:
        """`chunk` is on its way to the client (written to its connection, or collected for its
        non-streamed body): its tokens count as delivered, and are charged."""
        if self._closed:
            return
        self.sent_tokens += len(chunk.token_ids)
        self.telemetry.sent(len(chunk.token_ids))
        if chunk.finished and chunk.finish_reason in CLIENT_FINISH_REASONS:
            self.finished = True

    def outcome(self) -> str:
        """How it ended, for telemetry: finished | cancelled | error | rejected."""
        if self.finished:
            return "finished"
        if self.error is not None:
            return "error" if self.telemetry.first_at is not None else "rejected"
        return "error" if self.shutting_down else "cancelled"

    async def first(self) -> pb.TokenChunk:
        """The first chunk; a request the fleet refused before any token raises GatewayError."""
        chunk = await self.next()
        if chunk is None:
            raise errors.GatewayError(502, "the fleet ended the stream without output",
                                      code="upstream_error")
        return chunk

    def stop(self) -> None:
        """Stop the run (a Cancel call): the front end's next() ends it, and it closes."""
        self.aborted = True
        if not self._ended:
            self.run.close()

    def close(self) -> None:
        """Idempotent and synchronous, so `finally` blocks of cancelled tasks can call it."""
        if self._closed:
            return
        self._closed = True
        if not self._ended or self.error is not None:
            self.run.close()     # stops its calls; Cancel on every worker it touched
        self.core._ended(self)


def router_addresses(spec: str) -> list[str]:
    """`--router a:1,b:2` -> ["a:1", "b:2"]: the gateway may ask any of them."""
    return [a.strip() for a in spec.split(",") if a.strip()]


class GatewayCore:
    def __init__(self, config: GatewayConfig, model: ServedModel, quotas: Quotas,
                 channels: Channels, timeouts: Timeouts | None = None) -> None:
        self.config = config
        self.model = model
        self.keys = KeyRing(config.api_keys, config.anonymous_key)
        self.validator = Validator(model)
        self.quotas = quotas
        self.channels = channels
        self.timeouts = timeouts or Timeouts()
        self.routers = Routers(router_addresses(config.router), channels, self.timeouts)
        self._live: dict[str, Session] = {}
        self._opening: set[str] = set()          # request ids whose quota admission is under way
        self._leases: dict[str, StreamLease] = {}   # request id -> its stream slot, while live
        self._cleanup: set[asyncio.Task] = set()
        self.telemetry = GatewayTelemetry(
            model.name, quotas.holder, model.quality_version,
            tenants=[k.tenant for k in config.api_keys or (ANONYMOUS_KEY,)])
        self.door = Door(config.max_in_progress, config.tenants, self.telemetry.registry,
                         critical=[t.name for t in config.scheduler.tenants if t.critical],
                         label=self.telemetry.tenants.label)

    def request(self, operation: str, carrier) -> RequestTelemetry:
        """A generation request was received (chat | text_completion); `carrier`: its HTTP
        headers or gRPC metadata, which may continue a trace."""
        return self.telemetry.start(operation, carrier)

    def authenticate(self, authorization: str | None) -> ApiKey:
        return self.keys.authenticate(authorization)

    async def open(self, gen: Generation, telemetry: RequestTelemetry,
                   response_id: str | None = None, seat: Seat | None = None) -> Session:
        """The session of `gen`, quota admitted; `seat` (the front door's) is left when it
        closes. A refusal raises, and leaves `seat` to the caller."""
        rid = gen.request_id
        telemetry.identify(rid, response_id or rid, gen.key.tenant, gen.traffic_class,
                           gen.params, len(gen.prompt_ids))
        if rid in self._live or rid in self._opening:
            raise errors.bad_request(f"request id {rid!r} is already in use", "request_id",
                                     "duplicate_request_id")
        self._opening.add(rid)       # a second open of this id waits for nothing: it is refused
        try:
            with telemetry.phase("gateway.quota"):
                lease = await self.quotas.admit(gen.key, len(gen.prompt_ids))
        finally:
            self._opening.discard(rid)
        run = FleetRun(pb.WorkRequest(
            request_id=rid, tenant=gen.key.tenant, traffic_class=gen.traffic_class.name,
            prompt_token_ids=gen.prompt_ids, params=gen.params,
            degradable=self._degradable(gen)), self.routers, self.channels,
            self.timeouts, telemetry.context)
        # invariant: a live session's lease is in _leases until _ended gives it back
        self._leases[rid] = lease
        session = self._live[rid] = Session(self, gen, run, telemetry, seat)
        telemetry.opened()
        return session

    def _degradable(self, gen: Generation) -> bool:
        """Its class may degrade (S3: the fallback pool) and its tenant is not critical."""
        tenant = self.config.scheduler.tenant(gen.key.tenant)
        return gen.traffic_class.degradable and not (tenant is not None and tenant.critical)

    def cancel(self, request_id: str, tenant: str) -> bool:
        """Only the tenant that owns a request may cancel it; `request_id` as the client knows it."""
        session = self._live.get(request_id) or self._live.get(internal_request_id(request_id, tenant))
        if session is None or session.gen.key.tenant != tenant:
            return False
        session.stop()
        return True

    def _ended(self, session: Session) -> None:
        self._live.pop(session.request_id, None)
        if session.seat is not None:
            session.seat.leave()
        lease = self._leases.pop(session.request_id, None)
        if lease is not None:
            self._finish_soon(lease, session.sent_tokens)
        session.telemetry.end(session.outcome(), session.prompt_tokens, session.error)

    def _finish_soon(self, lease: StreamLease, output_tokens: int) -> None:
        """Give the slot back in a task of its own (so it also runs from a cancelled task)."""
        task = asyncio.get_running_loop().create_task(self.quotas.finish(lease, output_tokens))
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

    async def health(self) -> tuple[bool, str]:
        """(serving, detail): serving when a router is, and the quota store answers."""
        routers = await self.routers.health()
        try:
            problem = await asyncio.wait_for(self.quotas.check(), self.timeouts.health_s)
        except asyncio.TimeoutError:
            problem = "quota store unavailable (Redis): no answer in time"
        if problem:
            return False, problem
        serving = any(r is not None and r.status == pb.HealthResponse.SERVING
                      for _, r, _ in routers)
        return serving, "; ".join(f"router {a}: " + (r.detail if r is not None
                                                     else f"unreachable: {why}")
                                  for a, r, why in routers)

    async def close(self) -> None:
        """Shutdown: every live request ends with an error (503 shutting_down, or an SSE error
        event once streaming), and its slot is released."""
        for session in list(self._live.values()):
            session.aborted = session.shutting_down = True
            session.close()
        if self._cleanup:
            await asyncio.gather(*self._cleanup, return_exceptions=True)
