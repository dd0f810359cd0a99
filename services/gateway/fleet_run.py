"""How the gateway runs one request through the fleet: ask a router for a plan, then stream from
the workers it names (DESIGN 3: one relay, worker -> gateway -> client).

  1. `Routers.admit`: Admit on one of the routers (round robin; a router that does not answer is
     skipped for the next, so killing one router only moves new requests to another), as one
     ask on the gateway's long-lived AdmitStream call to that router (services/protocol/
     shared_call.py: the request's deadline and trace context travel in the ask);
  2. co-located plan: a subscription carrying the request on the gateway's one long-lived
     DecodeStream call to the mixed worker (a step's tokens for all of this gateway's requests
     there come as one message);
     disaggregated plan: Prefill on prefill[0] (an ask on the gateway's long-lived PrefillStream
     call to that worker; its accept, first token and end come back as notes), and a
     subscription on the gateway's one long-lived DecodeStream call to the decode worker (a
     decode step's tokens for all of this gateway's streams come as one message), opened
     together. The first token comes from the prefill stream (before any KV moves; n > 1: each
     sample's, indexed); tokens 2..N from the decode stream, which the decode worker starts on
     its own when the KV (carrying the first token) has landed. A prefill that fails before its
     first token is retried once on prefill[1], and so is one whose worker does not accept it
     (services/protocol/accept.py) within Timeouts.prefill_start_s (a frozen worker or engine
     core);
  3. `close()`: a run that did not finish cancels its calls and sends Cancel to every worker it
     touched (fire and forget: the decode worker owns the safety of its blocks, so the order of
     these Cancels does not matter).

Where a cancel can fall between the router's answer and the decode stream owning the request,
and what frees the plan's decode reservation then (docs/architecture.md, "Cancel windows"):
  - the plan on its way back (the caller went; its ask's cancel found the router done): the
    answer comes to no one, and the admit call hands it to `Channels.release`, which ends the
    reservation on its decode worker by a Cancel naming it (request id and the reservation's
    deadline, so a late one ends nothing else);
  - the plan taken but its calls not opened (a Cancel call while the Admit ran, `close()` before
    the first read): the run is closed, so it opens none and releases the plan the same way;
  - the calls opened (prefill accepted or not, KV on its way, decode running): `close()` cancels
    the subscription on the DecodeStream call, and the decode worker ends the reservation.

Words: the router's answer is the request's plan (pb.Plan); a FleetRun is one request's calls to
the workers the plan names; how the REST answer is shaped is openai_schema.ResponseShape.

Every call has a deadline (services/protocol/timeouts.py); failures come back typed
(services/protocol/status.py) and are raised as status.CallFailed carrying a CallStatus: the
stubs convert grpc's exception once (services/protocol/typed_stub.py), and the run raises the same
type for a failure it decides itself (a deadline it keeps, a worker that never accepted).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time

import grpc
from opentelemetry import context as otel_context

from services.protocol import shared_call, status
from services.protocol.accept import accepted_within
from services.protocol.aio import internal_channel
from services.protocol.fleet_token import FleetAuth
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.protocol.timeouts import Timeouts
from services.protocol.shared_call import StreamedRequest
from services.protocol.typed_stub import TypedStub
from services.telemetry import tracing

log = logging.getLogger(__name__)

# Failures of a prefill worker before its first token that another replica may not share.
RETRYABLE = (pb.UNAVAILABLE, pb.ENGINE_FAILED, pb.REASON_UNSPECIFIED)


class Channels:
    """One channel per service address, made on first use, carrying the fleet token."""

    def __init__(self, auth: FleetAuth | None = None, cancel_s: float = 2.0) -> None:
        self._auth = auth
        self._cancel_s = cancel_s            # a release's Cancel call (Timeouts.cancel_s)
        self._releases: set[asyncio.Task] = set()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._links: dict[str, DecodeLink] = {}
        self._admits: dict[str, shared_call.SharedCall] = {}
        self._prefills: dict[str, shared_call.SharedCall] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = internal_channel(address, self._auth)
        return channel

    def worker(self, address: str) -> TypedStub:
        """A Worker stub whose calls raise status.CallFailed."""
        return TypedStub(pb_grpc.WorkerStub(self.get(address)))

    def admit_call(self, address: str) -> shared_call.SharedCall:
        """The one AdmitStream call to this router (a new one once the last broke)."""
        call = self._admits.get(address)
        if call is None:
            call = self._admits[address] = shared_call.admit_call(
                TypedStub(pb_grpc.RouterStub(self.get(address))), address, self._orphaned)
        return call

    def _orphaned(self, answer: pb.AdmitAnswer) -> None:
        if answer.HasField("plan"):
            self.release(answer.plan)

    def release(self, plan: pb.Plan) -> None:
        """End a plan that will not run (its caller went before it opened any call): the decode
        worker ends the reservation the plan names, by a Cancel carrying the request id and that
        reservation's deadline. Idempotent, and safe whatever the reservation's stage: one already
        ended, or one a later request made under the same id, is left alone. A co-located plan
        holds nothing on its worker until its subscription comes."""
        if plan.mode != pb.Plan.DISAGGREGATED or not plan.decode.address:
            return
        log.info("%s: its plan went unused; releasing its reservation on %s", plan.request_id,
                 plan.decode.worker_id)
        task = asyncio.get_running_loop().create_task(self._release(plan))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, plan: pb.Plan) -> None:
        request = pb.CancelRequest(request_id=plan.request_id,
                                   reservation_deadline_unix_s=plan.deadline_unix_s)
        try:
            await self.worker(plan.decode.address).Cancel(request, timeout=self._cancel_s)
        except status.CallFailed as e:
            log.warning("%s: releasing its reservation on %s: %s", plan.request_id,
                        plan.decode.worker_id, e.status.message)

    def prefill_call(self, address: str) -> shared_call.SharedCall:
        """The one PrefillStream call to this prefill worker (a new one once the last broke)."""
        call = self._prefills.get(address)
        if call is None:
            call = self._prefills[address] = shared_call.prefill_call(self.worker(address),
                                                                      address)
        return call

    def decode_link(self, address: str) -> DecodeLink:
        """The one DecodeStream call to this decode or mixed worker (a new one once the last
        broke)."""
        link = self._links.get(address)
        if link is None or link.broken:
            link = self._links[address] = DecodeLink(self.worker(address), address)
        return link

    async def close(self) -> None:
        if self._releases:            # plans released just before: their Cancels go out first
            await asyncio.wait(self._releases, timeout=self._cancel_s)
        for link in self._links.values():
            link.close()
        for call in [*self._admits.values(), *self._prefills.values()]:
            call.close()
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)


class DecodeLink:
    """This gateway's one long-lived DecodeStream call to one decode worker. Each disaggregated
    request subscribes once its plan names the worker; the worker answers with batches (a decode
    step's chunks for every subscribed request in one message), which the link routes to each
    request's queue. If the call breaks (the worker died), every request on it fails UNAVAILABLE
    and the next subscription opens a new call."""

    def __init__(self, stub: TypedStub, address: str) -> None:
        self.address = address
        self.broken = False
        self._subs: dict[str, asyncio.Queue] = {}
        self._out: asyncio.Queue[pb.DecodeSubscribe | None] = asyncio.Queue()
        self._call = stub.DecodeStream(self._requests())
        self._reader = asyncio.get_running_loop().create_task(self._read())

    def subscribe(self, request_id: str, deadline_s: float, generate: pb.WorkRequest | None = None,
                  metadata: tuple[tuple[str, str], ...] | None = None) -> Subscription:
        """Subscribe to a request's tokens; `generate` (a mixed worker) starts the request there,
        with `deadline_s` and the trace context in `metadata`."""
        queue: asyncio.Queue = asyncio.Queue()
        self._subs[request_id] = queue
        sub = pb.DecodeSubscribe(request_id=request_id)
        if generate is not None:
            sub.generate.CopyFrom(generate)
            sub.terms.CopyFrom(shared_call.terms(deadline_s, metadata))
        self._out.put_nowait(sub)
        return Subscription(self, request_id, queue, deadline_s)

    def cancel(self, request_id: str) -> bool:
        """End the request on the worker, over the link; False when the link is broken (the
        caller then sends a Cancel RPC, since the subscription may never have arrived)."""
        self._subs.pop(request_id, None)
        if self.broken:
            return False
        self._out.put_nowait(pb.DecodeSubscribe(request_id=request_id, cancel=True))
        return True

    def close(self) -> None:
        self.broken = True
        self._call.cancel()

    async def _requests(self):
        while (sub := await self._out.get()) is not None:
            yield sub

    async def _read(self) -> None:
        why: status.CallFailed
        try:
            async for batch in self._call:
                for chunk in batch.chunks:
                    queue = self._subs.get(chunk.request_id)
                    if queue is not None:
                        queue.put_nowait(chunk)
                for end in batch.ends:
                    queue = self._subs.pop(end.request_id, None)
                    if queue is not None:
                        queue.put_nowait(end)
            why = status.CallFailed(status.failed(
                pb.UNAVAILABLE, f"decode worker {self.address} ended its decode stream"))
        except status.CallFailed as e:
            why = e
        except asyncio.CancelledError:
            why = status.CallFailed(status.failed(pb.UNAVAILABLE, "the gateway closed the link"))
        self.broken = True
        subs, self._subs = self._subs, {}
        for queue in subs.values():
            queue.put_nowait(why)


PAST_DEADLINE = object()    # queued by a subscription's deadline timer


class Subscription:
    """One request's tokens 2..N from its decode worker's link, as an async iterator: chunks,
    then the end; a failure (the request's, or the link's) raises status.CallFailed.
    The request's own deadline (Timeouts.stream_s) is kept here, since the link has none."""

    def __init__(self, link: DecodeLink, request_id: str, queue: asyncio.Queue,
                 deadline_s: float) -> None:
        self.link = link
        self.request_id = request_id
        self._queue = queue
        self._deadline = asyncio.get_running_loop().time() + deadline_s

    async def __aiter__(self):
        # one timer for the request's deadline, not one per chunk: it queues PAST_DEADLINE
        timer = asyncio.get_running_loop().call_at(self._deadline, self._queue.put_nowait,
                                                   PAST_DEADLINE)
        try:
            while True:
                queue = self._queue
                item = queue.get_nowait() if not queue.empty() else await queue.get()
                if isinstance(item, pb.TokenChunk):
                    yield item
                elif isinstance(item, pb.DecodeEnd):
                    if item.HasField("failure"):
                        raise status.CallFailed(item.failure)
                    return
                elif item is PAST_DEADLINE:
                    self.cancel()
                    raise status.CallFailed(status.failed(
                        pb.UNAVAILABLE, f"{self.request_id}: no end from decode worker "
                        f"{self.link.address} within the request's deadline"))
                else:
                    raise item
        finally:
            timer.cancel()

    def cancel(self) -> bool:
        # wake a reader waiting on the queue (the link stops routing to it): it ends cancelled
        self._queue.put_nowait(asyncio.CancelledError())
        return self.link.cancel(self.request_id)


class Routers:
    """The routers a gateway may ask, round robin. Any of them decides alike (their state is in
    Redis), so a router that fails at the transport level is skipped for the next one."""

    def __init__(self, addresses: list[str], channels: Channels, timeouts: Timeouts) -> None:
        if not addresses:
            raise ValueError("at least one router address is needed")
        self.addresses = list(addresses)
        self._channels = channels
        self._timeouts = timeouts
        self._next = itertools.cycle(range(len(self.addresses)))

    def stub(self, address: str) -> TypedStub:
        """A Router stub whose calls raise status.CallFailed."""
        return TypedStub(pb_grpc.RouterStub(self._channels.get(address)))

    async def admit(self, request: pb.WorkRequest,
                    metadata: tuple[tuple[str, str], ...] | None = None) -> pb.Plan:
        first = next(self._next)
        last: status.CallFailed | None = None
        for i in range(len(self.addresses)):
            address = self.addresses[(first + i) % len(self.addresses)]
            try:
                return await shared_call.admit(self._channels.admit_call(address), request,
                                               self._timeouts.admit_call_s(), metadata)
            except status.CallFailed as e:
                if not _router_unreachable(e):
                    raise           # the router decided (a refusal, a bad request): final
                log.warning("router %s did not answer (%s); asking the next", address,
                            e.untyped_code.name)
                last = e
        raise status.CallFailed(status.failed(
            pb.UNAVAILABLE, f"no router answered ({', '.join(self.addresses)}): "
            f"{last.untyped_code.name if last else ''}", retry_after_s=2.0))

    async def health(self) -> list[tuple[str, pb.HealthResponse | None, str]]:
        async def one(address: str):
            try:
                resp = await self.stub(address).Health(pb.HealthRequest(),
                                                        timeout=self._timeouts.health_s)
                return address, resp, ""
            except status.CallFailed as e:
                return address, None, e.status.message
        return list(await asyncio.gather(*(one(a) for a in self.addresses)))


def _router_unreachable(e: status.CallFailed) -> bool:
    """The router itself did not answer (dead, restarting), as opposed to a decision of its."""
    return e.untyped_code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                              grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)


class FleetRun:
    """One request's run through the fleet. `next()` returns TokenChunks (client-visible fields
    only) until None; any failure raises status.CallFailed.

    `trace` is the request's span context (services/telemetry/tracing.py): the Admit ask and
    the co-located subscription carry it in their terms, the Prefill call in its metadata. It is
    passed explicitly, since `_read` runs in whatever task asks for the next chunk (a streaming
    response's task, not the request's)."""

    def __init__(self, request: pb.WorkRequest, routers: Routers, channels: Channels,
                 timeouts: Timeouts, trace: otel_context.Context | None = None) -> None:
        self.request = request
        self.routers = routers
        self.channels = channels
        self.timeouts = timeouts
        self.plan: pb.Plan | None = None
        self.admitted_at: float | None = None       # monotonic time the router's plan came
        self._metadata = tracing.outgoing(trace) if trace is not None else None
        self._calls: list[StreamedRequest] = []    # Prefill asks, to stop early
        self._touched: set[str] = set()            # prefill workers, to Cancel on
        self._decode: Subscription | None = None   # decode / mixed side, ended once (_end_decode)
        self._reader = self._read()
        self._prefill_tail: asyncio.Task | None = None
        self.finished = False
        self.closed = False                         # close() ran: no call opens after it
        self._admitting: asyncio.Future | None = None   # the Admit, while it runs
        self._opened = False                        # the plan's calls were opened

    @property
    def request_id(self) -> str:
        return self.request.request_id

    async def start(self) -> pb.Plan:
        """The router's plan. The Admit runs in a task of its own, so that `close()` (a Cancel
        call, not the reader's task) ends it too; a plan that comes anyway, or that this task
        was cancelled before it could take, is released at once, and the run ends cancelled."""
        admitting = self._admitting = asyncio.ensure_future(
            self.routers.admit(self.request, self._metadata))
        try:
            plan = await admitting
        except asyncio.CancelledError:
            if admitting.done() and not admitting.cancelled() and admitting.exception() is None:
                self.channels.release(admitting.result())    # answered as the caller went
            raise
        finally:
            self._admitting = None
        self.plan, self.admitted_at = plan, time.monotonic()
        if self.closed:
            self.channels.release(plan)
            raise asyncio.CancelledError()
        return plan

    async def next(self) -> pb.TokenChunk | None:
        try:
            return await self._reader.__anext__()
        except StopAsyncIteration:
            return None
        except status.CallFailed:
            self.close()     # a failed run frees what it holds now: the decode reservation too
            raise

    async def _read(self):
        plan = self.plan if self.plan is not None else await self.start()
        if self.closed:               # closed after `start` and before this first read
            raise asyncio.CancelledError()
        self._opened = True
        if plan.mode == pb.Plan.COLOCATED:
            async for chunk in self._colocated(plan):
                yield chunk
        else:
            async for chunk in self._disaggregated(plan):
                yield chunk
        self.finished = True

    async def _colocated(self, plan: pb.Plan):
        if plan.output_cap and plan.output_cap < self.request.params.max_tokens:
            self.request.params.max_tokens = plan.output_cap    # the stage capped it
        self._decode = self.channels.decode_link(plan.prefill[0].address).subscribe(
            self.request_id, self.timeouts.stream_s(self.request.params.max_tokens),
            generate=self.request, metadata=self._metadata)
        async for chunk in self._decode:
            yield chunk

    async def _disaggregated(self, plan: pb.Plan):
        decode = self._decode = self.channels.decode_link(plan.decode.address).subscribe(
            self.request_id, self.timeouts.stream_s(self.request.params.max_tokens))
        prefill, first = await self._first_token(plan)
        if first.finished:           # ended at the prefill worker: no KV moves, no decode
            self._end_decode()       # (before the yield: a caller may stop reading at the end)
            yield first
            return
        yield first
        replies = aiter(prefill)     # n > 1: samples 1..n-1's first tokens follow sample 0's
        for _ in range(max(1, self.request.params.n) - 1):
            reply = await anext(replies, None)
            if reply is not None and reply.HasField("chunk"):
                yield reply.chunk
        self._prefill_tail = asyncio.get_running_loop().create_task(_drain(prefill))
        _TAILS.add(self._prefill_tail)
        self._prefill_tail.add_done_callback(_tail_done)
        try:
            # the KV write can only fail before decode's first chunk: until then its failure ends
            # the run at once (the decode stream alone would wait out the reservation's lifetime)
            chunks = aiter(decode)
            first_chunk = await _first_unless_failed(chunks, self._prefill_tail)
            if first_chunk is not None:
                yield first_chunk
                async for chunk in chunks:
                    yield chunk
        except status.CallFailed:
            # the decode stream failed: if the KV write failed, that is the cause to report
            failed_write = await _failure_of(self._prefill_tail)
            if failed_write is not None:
                raise failed_write from None
            raise

    async def _first_token(self, plan: pb.Plan):
        """The prefill call that produced the first token, and that token's chunk."""
        attempts = list(plan.prefill)
        request = pb.PrefillRequest(
            request_id=self.request_id, tenant=self.request.tenant,
            traffic_class=self.request.traffic_class,
            prompt_token_ids=self.request.prompt_token_ids, params=self.request.params,
            target=plan.target, kv_deadline_unix_s=plan.deadline_unix_s)
        for attempt, worker in enumerate(attempts):
            self._touched.add(worker.address)
            call = shared_call.prefill(self.channels.prefill_call(worker.address), request,
                                       self.timeouts.prefill_s(), self._metadata)
            self._calls.append(call)
            try:
                await self._accepted(call, worker)
                async for reply in call:
                    if reply.HasField("chunk"):
                        return call, reply.chunk
                raise status.CallFailed(status.failed(
                    pb.UNAVAILABLE, f"prefill worker {worker.worker_id} ended without a token"))
            except status.CallFailed as e:
                if e.status.reason not in RETRYABLE or attempt + 1 == len(attempts):
                    raise
                log.warning("%s: prefill on %s failed before its first token (%s); retrying "
                            "on %s", self.request_id, worker.worker_id, e.status.message,
                            attempts[attempt + 1].worker_id)
                self._cancel(worker.address)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _accepted(self, call, worker: pb.WorkerRef) -> None:
        """The prefill worker accepts within prefill_start_s, or the call is cancelled and
        fails UNAVAILABLE (retried on the fallback): a frozen worker or engine core never holds
        a client for longer."""
        start_s = min(self.timeouts.prefill_start_s, self.timeouts.first_token_s)
        if not await accepted_within(call, start_s):
            call.cancel()
            raise status.CallFailed(status.failed(
                pb.UNAVAILABLE, f"prefill worker {worker.worker_id} did not accept the request "
                f"within {start_s:g} s (prefill_start_s)"))

    def close(self) -> None:
        """Idempotent and synchronous (safe in `finally` of a cancelled task): a run that did
        not finish stops its calls and cancels the request on every worker it touched."""
        if self.finished:
            return                    # a prefill call still shipping KV ends by itself
        if self.plan is not None and not self._opened and not self.closed:
            self.channels.release(self.plan)    # a plan taken but never run
        self.closed = True
        if self._admitting is not None:
            self._admitting.cancel()            # the router is told (or the answer released)
        for call in self._calls:
            call.cancel()
        if self._prefill_tail is not None:
            self._prefill_tail.cancel()
        for address in self._touched:
            self._cancel(address)
        self._touched.clear()
        self._end_decode()

    def end_sample(self, index: int) -> None:
        """n > 1: end sample `index` alone on the worker that runs the request's decode (the
        gateway matched a stop string in it); its KV is freed there, the other samples go on.
        Fire-and-forget, as a whole request's Cancel is."""
        if self.finished or self.plan is None:
            return
        address = (self.plan.prefill[0].address if self.plan.mode == pb.Plan.COLOCATED
                   else self.plan.decode.address)
        self._cancel(address, index)

    def _end_decode(self) -> None:
        """End the decode side once: over the link, or by a Cancel RPC when the link broke."""
        decode, self._decode = self._decode, None
        if decode is not None and not decode.cancel():
            self._cancel(decode.link.address)

    def _cancel(self, address: str, sample: int | None = None) -> None:
        asyncio.get_running_loop().create_task(self._cancel_call(address, sample))

    async def _cancel_call(self, address: str, sample: int | None) -> None:
        request = pb.CancelRequest(request_id=self.request_id, sample_index=sample)
        try:
            await self.channels.worker(address).Cancel(request, timeout=self.timeouts.cancel_s)
        except status.CallFailed as e:
            log.info("%s: Cancel on %s: %s", self.request_id, address, e.status.message)


_TAILS: set[asyncio.Task] = set()     # prefill calls still shipping KV after their first token


def _tail_done(task: asyncio.Task) -> None:
    _TAILS.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.info("a prefill call ended with %s", task.exception())


async def _drain(call) -> None:
    """The rest of a prefill call after its first token: `shipped`, or a KV failure (raised)."""
    async for _ in call:
        pass


_ENDED = object()


async def _first_unless_failed(decode, tail: asyncio.Task):
    """Decode's first chunk (None: the stream ended without one), or the prefill call's KV
    failure if that comes first (raised)."""
    first = asyncio.ensure_future(anext(decode, _ENDED))
    try:
        await asyncio.wait((first, tail), return_when=asyncio.FIRST_COMPLETED)
        if not first.done() and not tail.cancelled() and isinstance(tail.exception(),
                                                                     status.CallFailed):
            raise tail.exception()
        chunk = await first
    finally:
        if not first.done():
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
    return None if chunk is _ENDED else chunk


async def _failure_of(task: asyncio.Task | None) -> status.CallFailed | None:
    if task is None:
        return None
    try:
        await asyncio.wait_for(asyncio.shield(task), 1.0)
    except status.CallFailed as e:
        return e
    except (asyncio.TimeoutError, asyncio.CancelledError):
        return None
    return None
