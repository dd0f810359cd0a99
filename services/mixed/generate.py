"""What only a mixed (co-located) worker does: a whole request here, its first token to its last
(DESIGN 3, co-located mode).

The gateway's one DecodeStream call to this worker carries all its co-located requests
(services/worker/token_stream.py): a subscription carrying the WorkRequest, its deadline and trace
context (`pb.CallTerms`) starts the request here, and a step's chunks for every request on the
call go as one message. Generate(WorkRequest) does the same for one request on a call of its own.
Either way the request is queued on the engine core and every output goes back as it comes, the
first chunk carrying the first token's timing and the last the decode time. Ending early (the
caller gone or cancelled, its deadline, a failure) cancels the request in the core; each ended
request tells waiting routers a sequence's room is free.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from opentelemetry.trace import SpanKind

from services.protocol import status
from services.protocol.shared_call import StreamedContext, deadline_passed
from services.protocol.convert import chunk_from_output
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.telemetry import tracing
from services.worker.engine_client import EngineFailed
from services.worker.outcomes import Ending, add_request, engine_failed, output_failure
from services.worker.role import RoleCalls, RoleLoad, RoleParts, RoleState
from services.worker.telemetry import end_span, first_token_timing
from services.worker.token_stream import serve_token_stream


class MixedRole:
    name = "mixed"
    moves_kv = False              # the whole request stays here

    def __init__(self) -> None:
        self.state = RoleState()
        self.parts: RoleParts | None = None
        self._calls: set[Callable[[], None]] = set()   # each open DecodeStream call's `stop`

    def calls(self) -> RoleCalls:
        return RoleCalls(generate=self.generate, decode_stream=self.decode_stream)

    async def start(self, parts: RoleParts) -> None:
        self.parts = parts
        self.state.started = True

    def stop(self) -> None:
        """End every DecodeStream call (each open Generate ends with the server's stop)."""
        self.state.stopped = True
        for stop in list(self._calls):
            stop()

    def readiness(self) -> str | None:
        return self.state.readiness()

    async def cancel(self, request_id: str, reservation: float | None = None) -> bool:
        """End the request here. A plan's release (`reservation`) names a decode reservation:
        a co-located request holds none."""
        if reservation is not None:
            return False
        return bool(await self.parts.engine.cancel(request_id))

    def load(self) -> RoleLoad:
        return RoleLoad()

    def decode_stream(self, subscriptions, context=None) -> AsyncIterator[pb.DecodeBatch]:
        """One gateway's co-located requests over one call: each subscription starts one."""
        return serve_token_stream(subscriptions, self._subscribed,
                                  lambda rid: self.parts.engine.cancel_soon(rid), self._calls,
                                  self.parts.config.worker_id)

    async def _subscribed(self, sub: pb.DecodeSubscribe) -> AsyncIterator[pb.TokenChunk]:
        """A subscription's request, run as Generate runs it, within the deadline it carries."""
        if not sub.HasField("generate") or sub.generate.request_id != sub.request_id:
            raise status.CallFailed(status.failed(
                pb.INVALID_REQUEST, f"{sub.request_id}: a mixed worker's subscription carries "
                "its request (DecodeSubscribe.generate, with the same request id)"))
        context = StreamedContext(sub.terms)
        cancelled = True
        try:
            async with asyncio.timeout(context.time_remaining()):
                async for chunk in self.generate(sub.generate, context):
                    yield chunk
            cancelled = False
        except TimeoutError:
            raise status.CallFailed(deadline_passed(sub.request_id)) from None
        except status.CallFailed:
            cancelled = False
            raise
        finally:
            context.end(cancelled)

    async def generate(self, request: pb.WorkRequest, context) -> AsyncIterator[pb.TokenChunk]:
        """The request's `generate` span runs from receipt to its last token."""
        engine, tel, worker_id = self.parts.engine, self.parts.telemetry, self.parts.config.worker_id
        rid = request.request_id
        parent = tracing.incoming(context) if context is not None else None
        span = tel.start_span("generate", parent, request, engine.model, SpanKind.SERVER)
        tel.prefilling(rid, span)
        ending, last = Ending(), None
        first_at: float | None = None        # time.monotonic() of the first token
        stream = engine.stream(rid)
        try:
            await add_request(engine, request, context, ending)
            async for out in stream:
                failure = output_failure(out)
                if failure is not None:
                    await status.abort(context, ending.failed(failure))
                chunk = chunk_from_output(out, worker_id)
                if first_at is None and out.new_token_ids:
                    first_at = time.monotonic()
                    first_token_timing(chunk, out)
                    tel.queued(out.queue_s)
                    tel.prefilled(rid)
                    span.add_event("first_token")
                if out.finished:
                    last = out
                    ending.outcome = "cancelled" if out.finish_reason == "abort" else "finished"
                    if first_at is not None:
                        chunk.timing.decode_s = time.monotonic() - first_at
                yield chunk
        except EngineFailed as e:
            await engine_failed(context, e, ending)
        finally:
            engine.close_stream(rid)
            engine.cancel_soon(rid)          # a no-op once finished
            self.parts.capacity.freed(1)     # a sequence ended: waiting routers retry
            tel.prefilled(rid)
            tel.ended(ending.outcome)
            end_span(span, output_tokens=last.num_output_tokens if last else None,
                     finish_reason=last.finish_reason if last else None, error=ending.error)
