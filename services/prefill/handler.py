"""What only a prefill worker does: run a prompt to its first token, ship its KV (DESIGN 3, step 3).

Prefill(PrefillRequest) streams PrefillReply:
  1. the first token, as soon as it is sampled (TTFT), straight to the gateway: before any KV moves;
  2. the KV write into the decode worker's reservation (`target`), carrying the first token as
     the transfer's HandOff, so the decode worker starts on its own once its transfer completes;
  3. `shipped` once the write landed (the call then ends OK), or KV_TRANSFER_FAILED.
A request that ends here (EOS or max_tokens at the first token) ends with a finished chunk and
ships nothing; the gateway then ends the decode reservation.

The write is bounded by the reservation's deadline less kv_deadline_margin_s. If the call ends
early (the gateway cancelled it) the write is not cut short; the request's prompt blocks here are
freed once the write is over, so a sender never reads blocks already handed to another request.
The decode side's safety does not depend on this worker (services/decode/reservations.py).
A write whose request was cancelled meanwhile is *abandoned*: the decode side ends its
reservation and drops the connection, so the write ends as "peer gone". That is the cancel
working, not a transfer failure: it is logged and marked on its span, but not counted in
kvfleet_kv_transfer_failures_total (which the KV alert reads).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from opentelemetry.trace import SpanKind

from services.kv_transfer.base import (KVFailure, KVTransferError, KVTransport, checksum_result,
                                       wait_done)
from services.protocol import status
from services.protocol.accept import send_accept
from services.protocol.convert import chunk_from_output
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.telemetry import tracing
from services.worker.config import WorkerConfig
from services.worker.engine_client import EngineClient, EngineFailed
from services.worker.outcomes import Ending, add_request, engine_failed, output_failure
from services.worker.role import RoleCalls, RoleLoad, RoleParts, RoleState
from services.worker.telemetry import WorkerTelemetry, child_context, end_span, first_token_timing

log = logging.getLogger(__name__)

ABANDONED = "kvfleet.kv_transfer.abandoned"   # span attribute: the request was cancelled mid-write


class PrefillRole:
    name = "prefill"
    moves_kv = True

    config: WorkerConfig          # these four: the worker's parts, from `start`
    engine: EngineClient
    transport: KVTransport
    telemetry: WorkerTelemetry

    def __init__(self) -> None:
        self.state = RoleState()
        self._writes: dict[str, asyncio.Task] = {}    # request id -> its KV write, while running
        self._abandoned: set[str] = set()   # ids in _writes whose request was cancelled meanwhile

    def calls(self) -> RoleCalls:
        return RoleCalls(prefill=self.prefill)

    async def start(self, parts: RoleParts) -> None:
        self.config, self.engine = parts.config, parts.engine
        self.transport, self.telemetry = parts.transport, parts.telemetry
        self.state.started = True

    def stop(self) -> None:
        """Open Prefill calls end with the server's stop; a KV write under way runs to its
        deadline."""
        self.state.stopped = True

    def readiness(self) -> str | None:
        return self.state.readiness()

    def load(self) -> RoleLoad:
        return RoleLoad(kv_writes_in_flight=self.writes_in_flight)

    @property
    def writes_in_flight(self) -> int:
        return len(self._writes)

    async def prefill(self, request: pb.PrefillRequest, context) -> AsyncIterator[pb.PrefillReply]:
        """The call's `prefill` span runs from receipt to the first token sent (under the
        caller's trace context); the KV write gets a `kv_transfer` span of its own (_ship)."""
        rid, tel = request.request_id, self.telemetry
        parent = tracing.incoming(context) if context is not None else None
        span = tel.start_span("prefill", parent, request, self.engine.model, SpanKind.SERVER)
        tel.prefilling(rid, span)
        span_open = True                   # until the first token
        ending = Ending()
        stream = self.engine.stream(rid)
        write: asyncio.Task | None = None
        try:
            await add_request(self.engine, request, context, ending)
            await send_accept(context)         # the core took it: the gateway's start deadline
            first: pb.TokenChunk | None = None
            blocks: list[int] = []
            firsts: dict[int, int] = {}        # sample index -> its first token (n > 1)
            samples = max(1, request.params.n)
            async for out in stream:
                failure = output_failure(out)
                if failure is not None:
                    await status.abort(context, ending.failed(failure))
                chunk = chunk_from_output(out, self.config.worker_id)
                is_first = out.new_token_ids and span_open
                if is_first:
                    first_token_timing(chunk, out)
                    tel.queued(out.queue_s)
                    tel.prefilled(rid)
                yield pb.PrefillReply(chunk=chunk)
                if is_first:                       # the first token is sent: the prefill is over
                    end_span(span, output_tokens=out.num_output_tokens,
                             finish_reason=out.finish_reason if out.finished else None)
                    span_open = False
                if out.prefilled:
                    firsts[out.index] = out.new_token_ids[0]
                    if out.index == 0:
                        first, blocks = chunk, out.block_ids
                    if len(firsts) == samples:   # every sample's first token is out
                        break
                    continue
                if out.finished:
                    ending.outcome = "cancelled" if out.finish_reason == "abort" else "finished"
                    return                 # ended here: nothing to ship
            if first is None or not request.HasField("target"):
                ending.outcome = "finished"
                return
            # the write's span is a child of `prefill` (which ended at the first token)
            more = [firsts[i] for i in range(1, samples)]
            write = asyncio.get_running_loop().create_task(
                self._ship(request, first, more, blocks, child_context(span)))
            self._writes[rid] = write
            try:
                shipped = await asyncio.shield(write)
            except KVTransferError as e:
                await status.abort(context, ending.failed(status.failed(
                    pb.KV_TRANSFER_FAILED, f"the KV for {rid} could not be written to "
                    f"{request.target.worker_id}: {e}")))
            ending.outcome = "handed_off"
            yield pb.PrefillReply(shipped=shipped)
        except EngineFailed as e:
            await engine_failed(context, e, ending)
        finally:
            self.engine.close_stream(rid)
            tel.prefilled(rid)
            if span_open:                     # no first token: the span ends with the call
                end_span(span, error=ending.error if ending.outcome != "cancelled" else None)
            tel.ended(ending.outcome)
            if write is not None and not write.done() and ending.outcome == "cancelled":
                self._abandoned.add(rid)       # the caller went away while the KV was moving
            if write is not None and not write.done():
                write.add_done_callback(lambda _t, rid=rid: self._written(rid))
            else:
                self._written(rid)

    async def _ship(self, request: pb.PrefillRequest, first: pb.TokenChunk, more: list[int],
                    blocks: list[int], parent) -> pb.KVShipped:
        """The KV write, in a `kv_transfer` span (a child of the request's `prefill` span),
        counted as bytes sent and its seconds, or as a failure by reason."""
        rid, target = request.request_id, request.target
        backend, checksum = self.config.kv_backend, False
        blocks = blocks[:len(target.block_ids)]
        nbytes = len(blocks) * target.bytes_per_block
        span = self.telemetry.start_span("kv_transfer", parent, request, self.engine.model,
                                         SpanKind.CLIENT)
        started, error, failure = time.monotonic(), None, None
        try:
            handle = self._write(request, first, more, blocks, checksum)
            await wait_done(handle)
        except KVTransferError as e:
            error, failure = str(e), e.failure
            if rid in self._abandoned:         # the cancel ended it: not a transfer failure
                span.set_attribute(ABANDONED, True)
            else:
                self.telemetry.kv_failed(backend, failure)
            raise
        finally:
            seconds = time.monotonic() - started
            if span.is_recording():
                span.set_attributes({tracing.KV_BYTES: nbytes, tracing.KV_BACKEND: backend,
                                     "kvfleet.kv_transfer.blocks": len(blocks),
                                     "kvfleet.kv_transfer.seconds": seconds})
                result = checksum_result(checksum, failure, landed=error is None)
                if result is not None:
                    span.set_attribute(tracing.KV_CHECKSUM, result)
            end_span(span, error=None if rid in self._abandoned else error)
        self.telemetry.kv_moved(backend, "sent", nbytes, seconds)
        return pb.KVShipped(request_id=rid, blocks=len(blocks), seconds=seconds)

    def _write(self, request: pb.PrefillRequest, first: pb.TokenChunk, more: list[int],
               blocks: list[int], checksum: bool):
        """Start the KV write (its HandOff carries the first token, n > 1 every sample's, and the
        start's wall time)."""
        rid, target = request.request_id, request.target
        t = self.config.timeouts
        timeout = t.kv_transfer_s
        if request.kv_deadline_unix_s:
            timeout = min(timeout, request.kv_deadline_unix_s - time.time() - t.kv_deadline_margin_s)
        if timeout <= 0:
            raise KVTransferError(f"the decode reservation for {rid} expires before KV could move",
                                  KVFailure.DEADLINE)
        hand_off = pb.HandOff(request_id=rid, first_token=first.token_ids[0],
                              num_prompt_tokens=first.num_prompt_tokens,
                              sent_at_unix_s=time.time(), more_first_tokens=more)
        if first.logprobs:
            hand_off.first_logprob.CopyFrom(first.logprobs[0])
        return self.transport.write(rid, blocks, target, timeout, checksum=checksum,
                                    hand_off=hand_off)

    def _written(self, rid: str) -> None:
        """The request's write is over (or never started): its prompt blocks here go back."""
        task = self._writes.pop(rid, None)
        abandoned = rid in self._abandoned
        self._abandoned.discard(rid)
        if task is not None and task.done() and not task.cancelled() and task.exception():
            log.info("%s: KV write ended with %s%s", rid, task.exception(),
                     " (abandoned: the request was cancelled)" if abandoned else "")
        self.engine.cancel_soon(rid)

    async def cancel(self, rid: str, reservation: float | None = None) -> bool:
        """Stop the request here; a KV write already under way runs to its end (bounded by its
        deadline), and the request's blocks go back after it. A plan's release (`reservation`)
        names a decode reservation: none is held here."""
        if reservation is not None:
            return False
        if rid in self._writes:
            self._abandoned.add(rid)
            return True            # the Prefill call's own ending frees it after the write
        self.engine.cancel_soon(rid)
        return True
