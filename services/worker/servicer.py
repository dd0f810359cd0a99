"""The Worker gRPC service, the server half of every worker process (DESIGN 3, step 5).

The engine core runs in its own process (engine_client.py); this process speaks gRPC and KV
transfer and hands each call to the role it serves (role.py), which it knows only through the
Role protocol:

  prefill  Prefill       services/prefill/handler.py: first token to the gateway, then KV to decode
           PrefillStream the same for a gateway's requests on one long-lived call
  decode   Reserve       services/decode/reservations.py: reserve, import KV, ...
           ReserveStream ... the same for a router's requests on one long-lived call
           DecodeStream  ... stream tokens 2..N once the request's own transfer has landed:
                         one call per gateway, a decode step's chunks batched into one message
  mixed    DecodeStream  services/mixed/generate.py: co-located, the whole request here, started
                         by its subscription, a step's chunks batched as for decode
           Generate      the same, one call per request
  all      Cancel, Stats, Health (here, asking the role for its part)

A call the role does not answer fails WRONG_ROLE. Every path that ends a request early (the caller
went away, an error, a deadline) frees what it holds here: the handlers' `finally` blocks end it
without awaiting anything.
"""
from __future__ import annotations

import asyncio

from services.protocol import shared_call, status
from services.protocol.convert import tenant_queues
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.worker.engine_client import EngineFailed
from services.worker.outcomes import engine_failed
from services.worker.role import Role, RoleParts


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, parts: RoleParts, role: Role) -> None:
        self.config = parts.config
        self.engine = parts.engine
        self.telemetry = parts.telemetry
        self.role = role
        self._calls = role.calls()
        self._cancels: set[asyncio.Task] = set()
        self.address = ""              # host:port, once serving (Stats names it)
        self.engine_stalled = False    # the core has not answered for engine_stall_s (heartbeat)

    # ------------------------------------------------------- the role's calls
    async def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:
        handler = await self._handler(context, self._calls.reserve, "Reserve")
        return await handler(request, context)

    async def ReserveStream(self, asks, context):
        """Reserve for each of a router's requests on one long-lived call (shared_call.py); a
        `cancel` after the answer ends the reservation (the router gave up on it)."""
        handler = await self._handler(context, self._calls.reserve, "ReserveStream")
        async for answer in shared_call.answer_asks(
                asks, lambda ask, ctx: handler(ask.request, ctx), shared_call.RESERVE,
                late_cancel=self._cancel_soon):
            yield answer

    def _cancel_soon(self, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self.role.cancel(request_id))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def DecodeStream(self, request_iterator, context):
        handler = await self._handler(context, self._calls.decode_stream, "DecodeStream")
        async for batch in handler(request_iterator, context):
            yield batch

    async def Prefill(self, request: pb.PrefillRequest, context):
        handler = await self._handler(context, self._calls.prefill, "Prefill")
        async for reply in handler(request, context):
            yield reply

    async def PrefillStream(self, asks, context):
        """Prefill for each of a gateway's requests on one long-lived call (shared_call.py): each
        request's accept, replies and end travel as notes carrying its id."""
        handler = await self._handler(context, self._calls.prefill, "PrefillStream")

        async def one(ask: pb.PrefillAsk, ctx) -> None:
            rid = ask.request.request_id
            async for reply in handler(ask.request, ctx):
                ctx.send(pb.PrefillNote(request_id=rid, reply=reply))

        async for note in shared_call.answer_asks(asks, one, shared_call.PREFILL):
            yield note

    async def Generate(self, request: pb.WorkRequest, context):
        handler = await self._handler(context, self._calls.generate, "Generate")
        async for chunk in handler(request, context):
            yield chunk

    # ------------------------------------------------------------------ common
    async def Cancel(self, request: pb.CancelRequest, context) -> pb.CancelResponse:
        """The whole request, by its role; or one sample of its n, in the engine alone (what the
        role holds for the request stays: its other samples go on)."""
        try:
            if request.HasField("sample_index"):
                return pb.CancelResponse(cancelled=await self.engine.cancel(
                    request.request_id, request.sample_index))
            reservation = (request.reservation_deadline_unix_s
                           if request.HasField("reservation_deadline_unix_s") else None)
            return pb.CancelResponse(cancelled=await self.role.cancel(request.request_id,
                                                                      reservation))
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
        load = self.role.load()
        writes, held = load.kv_writes_in_flight, load.kv_blocks_held
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
            queued_prefill_tokens_ahead=s.prefill_tokens_ahead,
            prefill_queues=tenant_queues(s),
            num_decoding=s.num_decoding,
            decode_context_tokens=s.decode_context_tokens, max_running=s.max_running,
            max_prefill_attention=s.max_prefill_attention,
            prefill_step_tokens_ahead=s.prefill_step_tokens_ahead,
            **(self.telemetry.rates.fields(busy=s.num_running + s.num_queued > 0)
               if self.telemetry.rates else {}))

    async def Health(self, request, context) -> pb.HealthResponse:
        if self.engine.failure is not None:
            return pb.HealthResponse(status=pb.HealthResponse.NOT_SERVING,
                                     detail=f"{self.config.role}: {self.engine.failure}")
        if self.engine_stalled:
            return pb.HealthResponse(
                status=pb.HealthResponse.NOT_SERVING,
                detail=f"{self.config.role}: the engine core has not answered for "
                       f"{self.config.timeouts.engine_stall_s:g} s or more")
        unready = self.role.readiness()
        if unready is not None:
            return pb.HealthResponse(status=pb.HealthResponse.NOT_SERVING,
                                     detail=f"{self.config.role}: {unready}")
        return pb.HealthResponse(status=pb.HealthResponse.SERVING, detail=self.config.role)

    async def _handler(self, context, handler, rpc: str):
        """The role's handler for `rpc`; the call fails WRONG_ROLE when the role has none."""
        if handler is None:
            await status.abort(context, status.failed(
                pb.WRONG_ROLE, f"worker {self.config.worker_id} has role {self.config.role}, "
                f"which does not answer {rpc}"))
        return handler
