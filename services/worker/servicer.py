"""The engine as a gRPC Worker service, in one of three roles (DESIGN.md section 3, steps 3-5).

  decode   Reserve   -> engine.reserve_remote (authoritative: refused if it cannot be backed),
                        returns the KV descriptor the prefill worker writes into
           Decode    -> waits for the KV to land, engine.start_decode, streams tokens
  prefill  Prefill   -> engine prefill, streams the first token at once (TTFT), then writes the
                        prompt's KV into the decode worker's reservation and ends with "prefilled"
  mixed    Generate  -> co-located: the whole request here
  all      Cancel, Release, Stats, Health
           Mux       -> Reserve, Prefill, Decode, Generate and Cancel calls over one long-lived
                        connection (the router keeps one per worker; services/protocol/mux.py)

Every path that ends a request early (client gone, error, timeout) frees what the request holds on
this worker: `finally` blocks submit a cancel to the engine thread without awaiting it.

A KV write, once started, runs to its end (done, failed, or its deadline) even if the Prefill call
that started it is cancelled: a prefill worker's Cancel answers only once the request's write is
over, so that whoever then frees the decode reservation it writes into (the router cancels prefill
workers first, decode workers after) cannot hand those blocks to another request mid-write.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc

from services.protocol.convert import chunk_from_output, params_from_pb
from services.worker.engine_loop import EngineFailed, EngineLoop
from services.protocol.mux import MuxServer, unary
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.engine.engine import LLMEngine
from services.engine.errors import InvalidRequestError
from services.kv_transfer.base import TransferHandle


DEADLINE_MARGIN_S = 1.0   # a KV write ends this long before the reservation it targets expires


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    role: str                     # prefill | decode | mixed
    kv_backend: str = "tcp"       # nixl | tcp | local
    reserve_timeout_s: float = 30.0   # a reservation whose KV never comes is released after this
    transfer_timeout_s: float = 30.0


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, config: WorkerConfig, loop: EngineLoop, transport) -> None:
        self.config = config
        self.loop = loop
        self.engine: LLMEngine = loop.engine
        self.transport = transport
        self._awaiting_kv: dict[str, tuple[object, asyncio.TimerHandle]] = {}
        self._writes: dict[str, TransferHandle] = {}   # prefill: request id -> its KV write
        self.mux = MuxServer({"reserve": unary(self.Reserve), "prefill": self.Prefill,
                              "decode": self.Decode, "generate": self.Generate,
                              "release": unary(self.Cancel)})
        self.mux_address = ""        # set once a MuxListener serves self.mux (Health names it)

    async def Mux(self, frames, context):
        async for replies in self.mux.serve(frames, context):
            yield replies

    # ------------------------------------------------------------ decode role
    async def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:
        await self._require(context, "decode")
        rid = request.request_id
        try:
            blocks = await self.loop.call(
                self.engine.reserve_remote, list(request.prompt_token_ids),
                params_from_pb(request.params), request_id=rid,
                tenant=request.tenant or None, traffic_class=request.traffic_class or None)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{e.code}: {e.message}")
        except EngineFailed as e:
            await _engine_failed(context, e)
        if blocks is None:
            stats = await self.loop.call(self.engine.stats)
            return pb.ReserveResponse(request_id=rid, accepted=False, reason=(
                f"cannot back the reservation: {stats.kv_blocks_free - stats.kv_blocks_reserved} "
                f"blocks available, {stats.num_running} running"))
        handle = self.transport.expect(rid, blocks, self.config.reserve_timeout_s)
        timer = asyncio.get_running_loop().call_later(
            self.config.reserve_timeout_s, self._expire_reservation, rid)
        self._awaiting_kv[rid] = (handle, timer)
        return pb.ReserveResponse(request_id=rid, accepted=True,
                                  target=self.transport.descriptor(blocks),
                                  expires_at_unix_s=time.time() + self.config.reserve_timeout_s)

    async def Decode(self, request: pb.DecodeRequest, context):
        await self._require(context, "decode")
        rid = request.request_id
        entry = self._awaiting_kv.pop(rid, None)
        if entry is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no reservation awaiting KV for {rid}")
        handle, timer = entry
        timer.cancel()
        stream = self.loop.stream(rid)
        try:
            await asyncio.to_thread(handle.wait, self.config.transfer_timeout_s)
            await self.loop.call(self.engine.start_decode, rid, request.first_token)
            async for out in stream:
                yield chunk_from_output(out, self.config.worker_id)
        except EngineFailed as e:
            await _engine_failed(context, e)
        except Exception as e:  # noqa: BLE001 - transfer failures end the stream with a status
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV for {rid} did not arrive: {e}")
        finally:
            self._end(rid)

    def _expire_reservation(self, rid: str) -> None:
        entry = self._awaiting_kv.pop(rid, None)
        if entry is not None:
            entry[0].finish(f"the reservation for {rid} expired")   # its id may be used again
            self.loop.submit(self.engine.cancel, rid)

    # ----------------------------------------------------------- prefill role
    async def Prefill(self, request: pb.PrefillRequest, context):
        await self._require(context, "prefill")
        rid = request.request_id
        stream = self.loop.stream(rid)
        try:
            await self._add(context, request)
            async for out in stream:
                if out.finish_reason == "prefilled":
                    out.finished, out.finish_reason = False, None
                    yield chunk_from_output(out, self.config.worker_id)   # first token: TTFT
                    break
                yield chunk_from_output(out, self.config.worker_id)       # ended here (EOS, error)
                if out.finished:
                    return
            await self._transfer(rid, request.target, request.kv_deadline_unix_s)
            yield pb.TokenChunk(request_id=rid, finished=True, finish_reason="prefilled",
                                served_by=self.config.worker_id)
        except EngineFailed as e:
            await _engine_failed(context, e)
        finally:
            self._end(rid)

    async def _transfer(self, rid: str, target: pb.KVDescriptor, deadline: float) -> None:
        """Write the prompt's KV into the decode reservation. The write must be over before the
        reservation can expire, or it could land in blocks already given to someone else."""
        timeout = self.config.transfer_timeout_s
        if deadline:
            timeout = min(timeout, deadline - time.time() - DEADLINE_MARGIN_S)
        if timeout <= 0:
            raise TimeoutError(f"the decode reservation for {rid} expires before KV could move")
        # A request cancelled before this point has no blocks any more: the write below refuses
        # an empty block list, so a Cancel that found no write in flight leaves none to come.
        blocks = await self.loop.call(self._prompt_blocks, rid, len(target.block_ids))
        self._writes = {r: h for r, h in self._writes.items() if not h.done()}
        handle = self._writes[rid] = self.transport.write(rid, blocks, target, timeout)
        await asyncio.to_thread(handle.wait, timeout)

    def _prompt_blocks(self, rid: str, n: int) -> list[int]:
        return list(self.engine.pool.block_table(rid)[:n])

    # ------------------------------------------------------------- mixed role
    async def Generate(self, request: pb.RouteRequest, context):
        await self._require(context, "mixed")
        stream = self.loop.stream(request.request_id)
        try:
            await self._add(context, request)
            async for out in stream:
                yield chunk_from_output(out, self.config.worker_id)
        except EngineFailed as e:
            await _engine_failed(context, e)
        finally:
            self._end(request.request_id)

    # ------------------------------------------------------------------ common
    async def Cancel(self, request: pb.CancelRequest, context) -> pb.CancelResponse:
        entry = self._awaiting_kv.pop(request.request_id, None)
        if entry is not None:
            entry[1].cancel()
            entry[0].finish(f"the reservation for {request.request_id} was released")
        try:
            cancelled = await self.loop.call(self.engine.cancel, request.request_id)
        except EngineFailed:
            cancelled = False          # a dead engine holds nothing any more
        write = self._writes.get(request.request_id)   # (pruned once done, at the next write)
        if write is not None and not write.done():
            try:                       # bounded: a write ends by its deadline, done or failed
                await asyncio.to_thread(write.wait, self.config.transfer_timeout_s)
            except Exception:  # noqa: BLE001 - failed or timed out: either way it writes no more
                pass
        return pb.CancelResponse(cancelled=bool(cancelled or entry or write))

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        response = await self.Cancel(pb.CancelRequest(request_id=request.request_id), context)
        return pb.ReleaseResponse(released=response.cancelled)

    async def Stats(self, request, context) -> pb.WorkerStats:
        try:
            engine_stats = await self.loop.call(self.engine.stats)
        except EngineFailed as e:
            await _engine_failed(context, e)
        stats = stats_to_pb(self.config, self.engine, engine_stats)
        stats.kv_writes_in_flight = sum(not h.done() for h in self._writes.values())
        return stats

    async def Health(self, request, context) -> pb.HealthResponse:
        if self.loop.failure is not None:
            return pb.HealthResponse(status=pb.HealthResponse.NOT_SERVING,
                                     detail=f"{self.config.role}: {self.loop.failure}",
                                     mux_address=self.mux_address)
        return pb.HealthResponse(status=pb.HealthResponse.SERVING, detail=self.config.role,
                                 mux_address=self.mux_address)

    async def _add(self, context, request) -> None:
        try:
            await self.loop.call(
                self.engine.add_request, list(request.prompt_token_ids),
                params_from_pb(request.params), request_id=request.request_id,
                tenant=request.tenant or None, traffic_class=request.traffic_class or None)
        except InvalidRequestError as e:
            self.loop.close_stream(request.request_id)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{e.code}: {e.message}")

    def _end(self, rid: str) -> None:
        """Whatever happened, nothing of `rid` stays on this worker (no-op if already done)."""
        self.loop.close_stream(rid)
        self.loop.submit(self.engine.cancel, rid)

    async def _require(self, context, role: str) -> None:
        if self.config.role != role:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"worker {self.config.worker_id} has role {self.config.role}; "
                                f"this call needs a {role} worker")


async def _engine_failed(context, e: EngineFailed) -> None:
    """A call that met a dead engine: UNAVAILABLE, so the router retries a prefill elsewhere
    and the gateway answers 503 (or an SSE error event once tokens were sent)."""
    await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))


def stats_to_pb(config: WorkerConfig, engine: LLMEngine, s) -> pb.WorkerStats:
    return pb.WorkerStats(
        worker_id=config.worker_id, role=config.role, kv_blocks_total=s.kv_blocks_total,
        kv_blocks_free=s.kv_blocks_free, kv_blocks_used=s.kv_blocks_used,
        kv_blocks_reserved=s.kv_blocks_reserved, kv_blocks_cached=s.kv_blocks_cached,
        num_running=s.num_running, num_queued=s.num_queued,
        queued_prefill_tokens=s.queued_prefill_tokens,
        prefill_tokens_per_s=s.prefill_tokens_per_s, decode_tokens_per_s=s.decode_tokens_per_s,
        block_size=engine.pool.block_size)
