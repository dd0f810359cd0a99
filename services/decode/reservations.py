"""What only a decode worker does: reservations, KV import, the decode stream (DESIGN 3, step 4).

A reservation's life, all of it owned here:

  Reserve   engine.reserve (authoritative: refused when it cannot be backed), transport.expect on
            its blocks for the class's lifetime (Timeouts.reservation_for: the base reservation_s
            plus a multiple of the class's TTFT target, capped), the engine output stream opened (so no token is missed whenever decode
            starts), a watcher task started;
  watcher   awaits the transfer handle. Landed: the first token from the transfer's HandOff seeds
            the engine (`start_decode`) at once: no one relays it here. n > 1: the HandOff holds
            every sample's first token, and the engine forks the samples there, sharing the
            prompt's blocks (the reservation counted the prompt once and each sample's own). Failed or past its
            deadline: the request fails (its DecodeStream subscription ends KV_TRANSFER_FAILED)
            and is freed;
  subscribe a request's subscription on a gateway's DecodeStream call (`decode`) attaches to the
            open stream and relays tokens 2..N (one attach per reservation);
  Cancel    (or the subscription ending early, or none attached by the deadline) ends it.

Every reservation the engine makes has an owner, even when the Reserve's caller (the router, its
`reserve_s` deadline) has gone: the engine core refuses a Reserve it reaches past the call's
deadline; one it ran after the handler was cancelled is cancelled in the core when its reply comes
(EngineClient.reserve); one whose answer could not go out (the call ended meanwhile) is ended
here. Each is logged and counted (kvfleet_reservations_abandoned_total{how}).

The invariant (R2, item 3): a reservation's blocks go back to the engine only once its transfer
handle is done, because a done handle means no byte of that transfer is written into the pool
afterwards (kv_transfer/base.py). A backend whose receiver stops writes itself (tcp, local) is
told to stop (`handle.finish`) and the blocks are freed at once; with one-sided writes (nixl)
they stay held until the write lands or the reservation's deadline passes (the writer ends its
write kv_deadline_margin_s before that). No ordering of anyone's Cancel calls matters.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, Span

from services.engine.errors import InvalidRequestError
from services.kv_transfer.base import KVTransferError, KVTransport, wait_done
from services.protocol import status
from services.protocol.convert import chunk_from_output, params_from_pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.telemetry import tracing
from services.worker.config import WorkerConfig
from services.worker.engine_client import EngineClient, EngineFailed, OutputStream
from services.worker.outcomes import Ending, engine_failed, invalid_request, output_failure
from services.worker.role import RoleCalls, RoleLoad, RoleParts, RoleState
from services.worker.telemetry import TRANSFER_S, WorkerTelemetry, end_span
from services.worker.token_stream import serve_token_stream

log = logging.getLogger(__name__)


@dataclass
class Reservation:
    request_id: str
    blocks: int
    handle: object                      # the transfer's expect() handle
    stream: OutputStream                # the engine's output for this request, open from the start
    expires_at_unix_s: float
    started: asyncio.Future             # set once decode started; failed when the KV did not land
    attached: asyncio.Event = field(default_factory=asyncio.Event)   # a DecodeStream subscription reads it
    ending: bool = False                # cancelled or failed: blocks go back once the handle is done
    freed: bool = False                 # its blocks went back to the engine (once)
    watcher: asyncio.Task | None = field(default=None, repr=False)
    # telemetry: the `decode` span runs from the KV landing to the request's end, under the
    # Reserve call's trace context; the last chunk carries transfer_s and decode_s
    kv_bytes: int = 0
    reserved_at: float = field(default_factory=time.monotonic)
    trace_parent: Context | None = None
    span_attributes: dict | None = None     # None: tracing was off at Reserve
    span: Span = INVALID_SPAN
    landed_at: float | None = None          # time.monotonic()
    transfer_s: float | None = None         # HandOff.sent_at_unix_s -> landed, wall clock
    ending_as: Ending = field(default_factory=Ending)
    output_tokens: int = 0
    finish_reason: str = ""


class DecodeRole:
    name = "decode"
    moves_kv = True

    config: WorkerConfig          # these four: the worker's parts, from `start`
    engine: EngineClient
    transport: KVTransport
    telemetry: WorkerTelemetry

    def __init__(self) -> None:
        self.state = RoleState()
        self._reservations: dict[str, Reservation] = {}
        self._held: dict[str, int] = {}     # ending reservations whose blocks a write may still hit
        # told the blocks of every freed reservation (the worker tells waiting routers)
        self.on_freed: Callable[[int], None] = lambda blocks: None
        self._calls: set[Callable[[], None]] = set()   # each open DecodeStream call's `stop`

    def calls(self) -> RoleCalls:
        return RoleCalls(reserve=self.reserve, decode_stream=self.decode_stream)

    async def start(self, parts: RoleParts) -> None:
        self.config, self.engine = parts.config, parts.engine
        self.transport, self.telemetry = parts.transport, parts.telemetry
        self.on_freed = parts.capacity.freed
        self.state.started = True

    def stop(self) -> None:
        """The worker is stopping: end every DecodeStream call, then every reservation."""
        self.state.stopped = True
        for stop in list(self._calls):
            stop()
        for rid in list(self._reservations):
            self.end(rid)

    def readiness(self) -> str | None:
        return self.state.readiness()

    async def cancel(self, request_id: str, reservation: float | None = None) -> bool:
        """End the request (the Cancel RPC, or a late cancel on a ReserveStream call);
        `reservation`: only while it holds the reservation that expires then (a plan's release,
        which may come after the request ended and its id was taken again)."""
        res = self._reservations.get(request_id)
        if reservation is not None and (res is None or res.expires_at_unix_s != reservation):
            return False
        return self.end(request_id)

    def load(self) -> RoleLoad:
        return RoleLoad(kv_blocks_held=self.held_blocks)

    @property
    def held_blocks(self) -> int:
        return sum(self._held.values())

    async def reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:
        rid = request.request_id
        if rid in self._reservations or rid in self._held:
            await status.abort(context, status.failed(
                pb.INVALID_REQUEST, f"request {rid} already holds a reservation here",
                code="duplicate_request_id", param="request_id"))
        stream = self.engine.stream(rid)        # before the request exists: nothing is missed
        try:
            blocks = await self.engine.reserve(
                rid, list(request.prompt_token_ids), params_from_pb(request.params),
                request.tenant or None, request.traffic_class or None,
                deadline_s=_deadline(context), abandoned=self._abandoned)
        except asyncio.CancelledError:          # the caller gave up: the engine undoes it
            self.engine.close_stream(rid)
            raise
        except InvalidRequestError as e:
            self.engine.close_stream(rid)
            self.telemetry.ended("invalid")
            await invalid_request(context, e)
        except EngineFailed as e:
            self.telemetry.ended("error")
            await engine_failed(context, e)
        if blocks is None:
            self.engine.close_stream(rid)
            self.telemetry.ended("rejected")
            stats = await self.engine.stats()
            return pb.ReserveResponse(request_id=rid, accepted=False, reason=(
                f"cannot back the reservation: "
                f"{stats.kv_blocks_free - stats.kv_blocks_reserved - self.held_blocks} blocks "
                f"available, {stats.num_running} running"))
        lifetime_s = self._lifetime_s(request.traffic_class)
        expires = time.time() + lifetime_s
        handle = self.transport.expect(rid, blocks, lifetime_s)
        target = self.transport.descriptor(blocks)
        res = self._reservations[rid] = Reservation(
            rid, len(blocks), handle, stream, expires, asyncio.get_running_loop().create_future(),
            kv_bytes=len(blocks) * target.bytes_per_block)
        if tracing.on():
            res.trace_parent = tracing.incoming(context) if context is not None else None
            res.span_attributes = self.telemetry.request_attributes(request, self.engine.model)
        res.watcher = asyncio.get_running_loop().create_task(self._watch(res))
        if context is not None:
            context.add_done_callback(lambda ctx: self._answered(ctx, res))
        return pb.ReserveResponse(request_id=rid, accepted=True, target=target,
                                  expires_at_unix_s=expires)

    def _lifetime_s(self, class_name: str) -> float:
        """How long a reservation of this class waits for its KV (Timeouts.reservation_for): a
        document's prefill may take as long as its target allows, and more on a loaded fleet."""
        sched = self.engine.config.scheduler
        cls = sched.traffic_class(class_name or sched.interactive_class)
        return self.config.timeouts.reservation_for(cls.ttft_target_s if cls else None)

    def _abandoned(self, rid: str, how: str) -> None:
        """A Reserve whose caller had gone was undone (services/worker/telemetry.py, ABANDONED)."""
        log.warning("%s: the Reserve's caller had gone; reservation undone (%s)", rid, how)
        self.telemetry.abandoned(how)

    def _answered(self, context, res: Reservation) -> None:
        """The Reserve call is over: if it ended before its answer reached the caller, no one
        will use the reservation, so it ends now."""
        if context.cancelled() and self._reservations.get(res.request_id) is res:
            self.end(res.request_id)
            self._abandoned(res.request_id, "unanswered")

    async def _watch(self, res: Reservation) -> None:
        """Start decode the moment the KV lands; free the reservation once its transfer is over
        and it has ended (cancelled, failed, or never attached by its deadline)."""
        rid = res.request_id
        try:
            await wait_done(res.handle)
            hand_off = res.handle.hand_off
            if res.ending:
                return
            if hand_off is None:
                raise KVTransferError(f"the KV for {rid} landed without its first token")
            self._landed(res, hand_off)
            await self.engine.start_decode(rid, hand_off.first_token,
                                           list(hand_off.more_first_tokens))
            if not res.started.done():
                res.started.set_result(None)
            try:                        # landed: a subscription must come by the deadline
                await asyncio.wait_for(res.attached.wait(),
                                       max(0.0, res.expires_at_unix_s - time.time()))
            except asyncio.TimeoutError:
                log.warning("%s: no DecodeStream subscription came by the reservation's deadline",
                            rid)
                self.end(rid)
        except (KVTransferError, EngineFailed) as e:
            if not res.ending:
                self._failed(res, e)
            if not res.started.done():
                res.started.set_exception(e)
                res.started.exception()      # retrieved: a reader may never come
            self.end(rid)
        finally:
            if res.ending:
                self._free(res)

    async def decode(self, rid: str) -> AsyncIterator[pb.TokenChunk]:
        """Tokens 2..N of a reserved request, once its own KV transfer has landed. Failures raise
        status.CallFailed (NO_RESERVATION, KV_TRANSFER_FAILED, ENGINE_FAILED, OVERLOADED). Ending
        early (the caller stops iterating) ends the reservation here."""
        res = self._reservations.get(rid)
        if res is None or res.attached.is_set():
            raise status.CallFailed(status.failed(
                pb.NO_RESERVATION, f"no reservation awaiting a DecodeStream subscription for {rid} "
                f"on {self.config.worker_id}"))
        res.attached.set()
        try:
            try:
                await asyncio.shield(res.started)    # a reader cancelled here leaves it be
            except KVTransferError as e:
                raise status.CallFailed(res.ending_as.failed(status.failed(
                    pb.KV_TRANSFER_FAILED, f"the KV for {rid} did not arrive: {e}"))) from None
            async for out in res.stream:
                failure = output_failure(out)
                if failure is not None:
                    raise status.CallFailed(res.ending_as.failed(failure))
                chunk = chunk_from_output(out, self.config.worker_id)
                if out.finished:
                    self._last_chunk(res, out, chunk)
                yield chunk
        except EngineFailed as e:
            raise status.CallFailed(res.ending_as.failed(
                status.failed(pb.ENGINE_FAILED, str(e)))) from None
        finally:
            self.end(rid)

    def _landed(self, res: Reservation, hand_off: pb.HandOff) -> None:
        """The KV landed: count its bytes, note the transfer's time, open the `decode` span."""
        res.landed_at = time.monotonic()
        if hand_off.sent_at_unix_s:
            res.transfer_s = max(0.0, time.time() - hand_off.sent_at_unix_s)
        self.telemetry.kv_moved(self.config.kv_backend, "received", res.kv_bytes, res.transfer_s)
        res.span = self.telemetry.span("decode", res.trace_parent, res.span_attributes)
        if res.span.is_recording():
            res.span.set_attribute(tracing.QUEUE_WAIT, res.landed_at - res.reserved_at)
            if res.transfer_s is not None:
                res.span.set_attribute(TRANSFER_S, res.transfer_s)

    def _failed(self, res: Reservation, e: Exception) -> None:
        """The KV did not land (or decode could not start): a failure by reason, and a `decode`
        span that says so."""
        if isinstance(e, KVTransferError):
            self.telemetry.kv_failed(self.config.kv_backend, e.failure)
            res.ending_as.failed(status.failed(pb.KV_TRANSFER_FAILED, str(e)))
        else:
            res.ending_as.failed(status.failed(pb.ENGINE_FAILED, str(e)))
        if res.span is INVALID_SPAN:
            res.span = self.telemetry.span("decode", res.trace_parent, res.span_attributes)

    def _last_chunk(self, res: Reservation, out, chunk: pb.TokenChunk) -> None:
        """The request's last token: its chunk carries transfer_s and decode_s."""
        if out.finish_reason == "abort":
            res.ending_as.outcome = "cancelled"
        else:
            res.ending_as.outcome = "finished"
        res.output_tokens, res.finish_reason = out.num_output_tokens, out.finish_reason or ""
        if res.transfer_s is not None:
            chunk.timing.transfer_s = res.transfer_s
        if res.landed_at is not None:
            chunk.timing.decode_s = time.monotonic() - res.landed_at

    def decode_stream(self, subscriptions, context=None) -> AsyncIterator[pb.DecodeBatch]:
        """One gateway's decode streams over one call (services/worker/token_stream.py): each
        subscription relays its request's tokens 2..N (`decode`)."""
        return serve_token_stream(subscriptions, lambda sub: self.decode(sub.request_id),
                                  self.end, self._calls, self.config.worker_id)

    def end(self, rid: str) -> bool:
        """End a reservation whatever its state (synchronous: safe in `finally`). Its blocks go
        back now if no write can land any more, else once its transfer handle is done."""
        res = self._reservations.pop(rid, None)
        if res is None:
            return False
        res.ending = True
        self.engine.close_stream(rid)
        self._count_end(res)
        if not res.handle.done() and self.transport.receiver_stops_writes:
            res.handle.finish(f"the reservation for {rid} ended")   # nothing lands after this
        if res.handle.done():
            if res.watcher is not None and not res.watcher.done():
                res.watcher.cancel()
            self._free(res)
        else:
            self._held[rid] = res.blocks   # the watcher frees it when the handle is done
        return True

    def _count_end(self, res: Reservation) -> None:
        ending = res.ending_as
        self.telemetry.ended(ending.outcome)
        end_span(res.span, output_tokens=res.output_tokens or None,
                 finish_reason=res.finish_reason or None, error=ending.error)

    def _free(self, res: Reservation) -> None:
        if res.freed:
            return
        res.freed = True
        self._held.pop(res.request_id, None)
        self.engine.cancel_soon(res.request_id)
        self.on_freed(res.blocks)


def _deadline(context) -> float | None:
    """The Reserve call's deadline on this host's monotonic clock (the engine core's too)."""
    left = context.time_remaining() if context is not None else None
    return None if left is None else time.monotonic() + left
