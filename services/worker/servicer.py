"""The Worker gRPC service, the server half of every worker process (DESIGN 3, step 5).

The engine core runs in its own process (engine_client.py); this process speaks gRPC and KV
transfer and hands each call to what its role does:

  prefill  Prefill   services/prefill/handler.py: first token to the gateway, then KV to decode
  decode   Reserve   services/decode/reservations.py: reserve, import KV, ...
           DecodeStream  ... stream tokens 2..N once the request's own transfer has landed:
                     one call per gateway, a decode step's chunks batched into one message
  mixed    Generate  co-located: the whole request here (below)
  all      Cancel, Stats, Health

A call for another role fails WRONG_ROLE. Every path that ends a request early (the caller went
away, an error, a deadline) frees what it holds here: the handlers' `finally` blocks end it
without awaiting anything.
"""
from __future__ import annotations

import time

from opentelemetry.trace import SpanKind

from services.decode.reservations import DecodeRole
from services.prefill.handler import PrefillRole
from services.protocol import status
from services.protocol.convert import chunk_from_output
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.telemetry import tracing
from services.worker.capacity import CapacityNotifier
from services.worker.config import WorkerConfig
from services.worker.engine_client import EngineClient, EngineFailed
from services.worker.outcomes import Ending, add_request, engine_failed, output_failure
from services.worker.telemetry import WorkerTelemetry, end_span, first_token_timing


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, config: WorkerConfig, engine: EngineClient, transport,
                 telemetry: WorkerTelemetry | None = None) -> None:
        self.config = config
        self.engine = engine
        self.transport = transport
        self.telemetry = telemetry or WorkerTelemetry(config.role, config.worker_id)
        self.address = ""              # host:port, once serving (Stats names it)
        self.engine_stalled = False    # the core has not answered for engine_stall_s (heartbeat)
        self.decode = (DecodeRole(config, engine, transport, self.telemetry)
                       if config.role == "decode" else None)
        self.prefill = (PrefillRole(config, engine, transport, self.telemetry)
                        if config.role == "prefill" else None)
        self.capacity = CapacityNotifier(None)   # serve.py gives it the fleet's wait queue
        if self.decode is not None:
            self.decode.on_freed = lambda blocks: self.capacity.freed(blocks)

    # ------------------------------------------------------------ decode role
    async def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:
        await self._require(context, "decode")
        return await self.decode.reserve(request, context)

    async def DecodeStream(self, request_iterator, context):
        await self._require(context, "decode")
        async for batch in self.decode.decode_stream(request_iterator):
            yield batch

    # ----------------------------------------------------------- prefill role
    async def Prefill(self, request: pb.PrefillRequest, context):
        await self._require(context, "prefill")
        async for reply in self.prefill.prefill(request, context):
            yield reply

    # ------------------------------------------------------------- mixed role
    async def Generate(self, request: pb.WorkRequest, context):
        await self._require(context, "mixed")
        rid, tel = request.request_id, self.telemetry
        span = tel.start_span("generate", tracing.incoming(context), request, self.engine.model,
                              SpanKind.SERVER)
        tel.prefilling(rid, span)
        ending, last = Ending(), None
        first_at: float | None = None        # time.monotonic() of the first token
        stream = self.engine.stream(rid)
        try:
            await add_request(self.engine, request, context, ending)
            async for out in stream:
                failure = output_failure(out)
                if failure is not None:
                    await status.abort(context, ending.failed(failure))
                chunk = chunk_from_output(out, self.config.worker_id)
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
            self.engine.close_stream(rid)
            self.engine.cancel_soon(rid)     # a no-op once finished
            self.capacity.freed(1)           # a sequence ended: waiting routers retry
            tel.prefilled(rid)
            tel.ended(ending.outcome)
            end_span(span, output_tokens=last.num_output_tokens if last else None,
                     finish_reason=last.finish_reason if last else None, error=ending.error)

    # ------------------------------------------------------------------ common
    async def Cancel(self, request: pb.CancelRequest, context) -> pb.CancelResponse:
        rid = request.request_id
        if self.decode is not None:
            return pb.CancelResponse(cancelled=self.decode.end(rid))
        if self.prefill is not None:
            return pb.CancelResponse(cancelled=self.prefill.cancel(rid))
        try:
            return pb.CancelResponse(cancelled=bool(await self.engine.cancel(rid)))
        except EngineFailed:
            return pb.CancelResponse(cancelled=False)   # a dead engine holds nothing any more

    async def Stats(self, request, context) -> pb.WorkerStats:
        try:
            return await self.stats()
        except EngineFailed as e:
            await engine_failed(context, e)

    async def stats(self) -> pb.WorkerStats:
        """This worker's capacity as the stats message (the Stats RPC and the Redis heartbeat)."""
        s = await self.engine.stats()
        writes = self.prefill.writes_in_flight if self.prefill else 0
        held = self.decode.held_blocks if self.decode else 0
        self.telemetry.refresh(s, writes_in_flight=writes, held_blocks=held)
        return pb.WorkerStats(
            worker_id=self.config.worker_id, role=self.config.role,
            kv_blocks_total=s.kv_blocks_total, kv_blocks_free=s.kv_blocks_free,
            kv_blocks_used=s.kv_blocks_used, kv_blocks_reserved=s.kv_blocks_reserved,
            kv_blocks_cached=s.kv_blocks_cached, num_running=s.num_running,
            num_queued=s.num_queued, queued_prefill_tokens=s.queued_prefill_tokens,
            prefill_tokens_per_s=s.prefill_tokens_per_s, decode_tokens_per_s=s.decode_tokens_per_s,
            block_size=self.engine.block_size,
            kv_writes_in_flight=writes, kv_blocks_held=held,
            grpc_address=self.address, kv_backend=self.config.kv_backend,
            model=self.engine.model, max_model_len=self.engine.max_model_len,
            metrics_url=self.telemetry.metrics_url,
            pool=self.config.pool, quality_version=self.config.quality_version,
            tenants=[pb.TenantShare(tenant=t, sequences=n, kv_blocks=b)
                     for t, n, b in s.tenants],          # the engine's order: largest KV first
            queued_prefill_tokens_ahead=s.prefill_tokens_ahead, num_decoding=s.num_decoding,
            decode_context_tokens=s.decode_context_tokens, max_running=s.max_running,
            max_prefill_attention=s.max_prefill_attention,
            prefill_step_tokens_ahead=s.prefill_step_tokens_ahead,
            **(self.telemetry.rates.fields() if self.telemetry.rates else {}))

    async def Health(self, request, context) -> pb.HealthResponse:
        if self.engine.failure is not None:
            return pb.HealthResponse(status=pb.HealthResponse.NOT_SERVING,
                                     detail=f"{self.config.role}: {self.engine.failure}")
        if self.engine_stalled:
            return pb.HealthResponse(
                status=pb.HealthResponse.NOT_SERVING,
                detail=f"{self.config.role}: the engine core has not answered for "
                       f"{self.config.timeouts.engine_stall_s:g} s or more")
        return pb.HealthResponse(status=pb.HealthResponse.SERVING, detail=self.config.role)

    def close(self) -> None:
        if self.decode is not None:
            self.decode.close()

    async def _require(self, context, role: str) -> None:
        if self.config.role != role:
            await status.abort(context, status.failed(
                pb.WRONG_ROLE, f"worker {self.config.worker_id} has role {self.config.role}; "
                f"this call needs a {role} worker"))
