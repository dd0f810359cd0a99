"""The Router gRPC service: place, reserve, prefill, relay (DESIGN.md section 3, step 2).

Every call to a worker goes over the router's one long-lived mux connection to that worker
(services/protocol/mux.py), and the gateway's calls come in over its mux connection to the router.

Disaggregated request, in order:
  1. Reserve on the best decode replica that accepts (its reservations are authoritative);
  2. Prefill on the best prefill replica, naming the decode target; the first token is relayed to
     the client at once, before the KV transfer finishes; a prefill that fails before any token
     reached the client is retried once on another replica;
  3. Decode on the reserving replica; its token stream is relayed until finished.
Co-located: the whole request goes to the best `mixed` worker.
Any early end (client gone, failure) cancels the request on every worker it touched.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

import grpc

from services.protocol.aio import internal_channel
from services.protocol.mux import RETRY_AFTER, MuxChannel, MuxServer, connect_to, retry_after_of
from services.state.fleet_state import FleetState, WorkerRecord
from services.state.outage import UNREACHABLE, Outage
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.router.placement import rank_decode, rank_prefill

log = logging.getLogger(__name__)

PREFILL_ATTEMPTS = 2   # the first try and one retry elsewhere
WORKERS_TTL_S = 0.1      # a worker list this old is re-read from Redis in the background
WORKERS_MAX_AGE_S = 1.0  # one older than this (an idle router) is re-read before placing
WORKERS_STALE_OK_S = 5.0  # while Redis is down, a list this young is still served
CANCEL_TIMEOUT_S = 2.0
RESERVE_TIMEOUT_S = 3.0  # a decode worker that cannot answer a Reserve in this long is skipped
# A prefill worker's Cancel waits for the request's KV write to end, at most until the decode
# reservation's deadline (WorkerConfig.reserve_timeout_s, 30 s by default).
CANCEL_WRITER_TIMEOUT_S = 35.0


# When a refused request may try again. A decode replica's blocks free as its sequences end, which
# the router cannot foresee: a reservation refused for load says retry in RESERVE_RETRY_S. No
# healthy worker of a role: `kvfleet up` restarts a dead one within a few seconds, and a new
# worker is placed on as soon as its first heartbeat lands.
RESERVE_RETRY_S = 1.0
UNHEALTHY_RETRY_S = 2.0


class NoCapacity(Exception):
    """No worker can take the request now: RESOURCE_EXHAUSTED when every replica is busy (load),
    UNAVAILABLE when none of a role is healthy; either way with when to retry."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED,
                 retry_after_s: float = RESERVE_RETRY_S) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


def unhealthy(message: str) -> NoCapacity:
    return NoCapacity(message, grpc.StatusCode.UNAVAILABLE, UNHEALTHY_RETRY_S)


class WorkerListUnavailable(grpc.aio.AioRpcError):
    """Redis is down and the last worker list is too old to place on. An AioRpcError with
    UNAVAILABLE, so Generate relays it like a failed worker (the gateway answers 503); the details
    and the `retry-after` trailing metadata carry when the router tries Redis again."""

    def __init__(self, cause: BaseException, retry_in_s: float) -> None:
        retry_s = max(1, math.ceil(retry_in_s))
        super().__init__(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                         grpc.aio.Metadata((RETRY_AFTER, str(retry_s))),
                         details=f"worker list unavailable (Redis: {cause}); retry after {retry_s} s")


@dataclass(frozen=True)
class WorkerLink:
    """What the router holds per worker: the gRPC channel (Health, to find the mux listener) and
    the mux connection that carries Reserve, Prefill, Decode, Generate and Cancel."""
    channel: grpc.aio.Channel
    mux: MuxChannel


@dataclass
class Touched:
    """Workers a live request has touched, so a cancel reaches all of them: `sources` (prefill
    and mixed workers) and `kv_targets` (decode workers, whose reservations a prefill worker may
    be writing KV into)."""

    sources: set[str] = field(default_factory=set)
    kv_targets: set[str] = field(default_factory=set)


class RouterServicer(pb_grpc.RouterServicer):
    def __init__(self, state: FleetState, mode: str = "disagg") -> None:
        self.state = state
        self.mode = mode
        self._links: dict[str, WorkerLink] = {}
        self._live: dict[str, Touched] = {}
        self._workers: tuple[float, list[WorkerRecord]] = (float("-inf"), [])
        self._refreshing: asyncio.Task | None = None
        self.redis = Outage("router worker list", log)
        self._needed_roles = {"mixed"} if mode == "colocated" else {"prefill", "decode"}
        self.mux = MuxServer({"generate": self.Generate})
        self.mux_address = ""        # set once a MuxListener serves self.mux (Health names it)

    async def live_workers(self) -> list[WorkerRecord]:
        """Live workers from Redis, at most one read per WORKERS_TTL_S and none on a request's
        path while the list is younger than WORKERS_MAX_AGE_S: a stale list is served while a
        background read replaces it. A worker that died since is caught by its failing RPC
        (retry / UNAVAILABLE), and the list is then re-read by the next request; a list that lacks a
        role this mode needs is re-read at once.

        Redis down: the last list read is served while it is younger than WORKERS_STALE_OK_S;
        past that the request fails at once with WorkerListUnavailable (UNAVAILABLE, with a retry
        hint), never waiting on Redis (`self.redis` refuses until its backoff is over)."""
        at, workers = self._workers
        age = time.monotonic() - at
        if age > WORKERS_MAX_AGE_S or not self._needed_roles <= {w.role for w in workers}:
            try:
                return await self._read_workers()
            except UNREACHABLE as e:
                if age <= WORKERS_STALE_OK_S:
                    return workers
                raise WorkerListUnavailable(e, self.redis.retry_in()) from None
        if age > WORKERS_TTL_S and self._refreshing is None:
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh_workers())
        return workers

    async def _read_workers(self) -> list[WorkerRecord]:
        workers = await self.redis.call(self.state.live_workers)
        self._workers = (time.monotonic(), workers)
        return workers

    async def _refresh_workers(self) -> None:
        try:
            await self._read_workers()
        except UNREACHABLE:
            pass         # self.redis logged it (once per outage); the next request retries
        except Exception:  # noqa: BLE001 - the next request retries
            log.exception("could not refresh the worker list")
        finally:
            self._refreshing = None

    async def Mux(self, frames, context):
        async for replies in self.mux.serve(frames, context):
            yield replies

    async def Generate(self, request: pb.RouteRequest, context):
        rid = request.request_id
        touched = self._live.setdefault(rid, Touched())
        done = False
        try:
            workers = await self.live_workers()
            relay = (self._colocated(request, workers, touched) if self.mode == "colocated"
                     else self._disaggregated(request, workers, touched, context))
            async for chunk in relay:
                yield chunk
                done = chunk.finished
        except NoCapacity as e:
            context.set_trailing_metadata(((RETRY_AFTER, f"{e.retry_after_s:g}"),))
            await context.abort(e.code, str(e))
        except grpc.aio.AioRpcError as e:
            code = _relayable(e.code())
            if code == grpc.StatusCode.UNAVAILABLE:
                self._workers = (float("-inf"), [])   # a worker failed: the next request re-reads
            retry = retry_after_of(e) or (UNHEALTHY_RETRY_S if code == grpc.StatusCode.UNAVAILABLE
                                        else None)
            if retry is not None:
                context.set_trailing_metadata(((RETRY_AFTER, f"{retry:g}"),))
            await context.abort(code, e.details() or str(e.code()))
        finally:
            self._live.pop(rid, None)
            if not done:
                self._cancel_everywhere(rid, touched)

    async def _colocated(self, request, workers, touched: Touched):
        candidates = rank_decode(workers, role="mixed")
        if not candidates:
            raise unhealthy("no healthy mixed worker")
        target = candidates[0]
        touched.sources.add(target.grpc_address)
        async for chunk in self._mux_to(target.grpc_address).call("generate", request):
            yield chunk

    async def _disaggregated(self, request, workers, touched: Touched, context):
        decode, reservation = await self._reserve(request, workers, touched)
        first = None
        async for chunk in self._prefill(request, workers, decode, reservation, touched):
            if chunk.finish_reason == "prefilled":
                break
            first = chunk if chunk.token_ids else first
            if chunk.finished:          # ended at the prefill worker (EOS, length, rejected):
                await self._cancel_all(request.request_id, Touched(kv_targets={decode.grpc_address}))
                yield chunk             # the decode reservation is freed before the client hears
                return
            yield chunk
        token = first.token_ids[0]
        logprob = first.logprobs[0].logprob if first.logprobs else 0.0
        async for chunk in self._mux_to(decode.grpc_address).call("decode", pb.DecodeRequest(
                request_id=request.request_id, first_token=token, first_logprob=logprob)):
            yield chunk

    async def _reserve(self, request, workers, touched: Touched):
        reasons, silent = [], []
        for w in rank_decode(workers):
            touched.kv_targets.add(w.grpc_address)
            try:
                resp = await asyncio.wait_for(self._mux_to(w.grpc_address).unary(
                    "reserve", pb.ReserveRequest(
                        request_id=request.request_id, tenant=request.tenant,
                        traffic_class=request.traffic_class,
                        prompt_token_ids=request.prompt_token_ids, params=request.params)),
                    RESERVE_TIMEOUT_S)
            except asyncio.TimeoutError:
                # a hung (stopped, overloaded) worker: try the next one. Should the Reserve land
                # later, the Cancel this request's end sends (queued behind it) frees it.
                silent.append(f"{w.worker_id}: no answer in {RESERVE_TIMEOUT_S:g}s")
                self._workers = (float("-inf"), [])        # re-read the list next time
                continue
            if resp.accepted:
                return w, resp
            reasons.append(f"{w.worker_id}: {resp.reason}")
        if not reasons:
            raise unhealthy("no decode replica can reserve KV for this request: "
                            + ("; ".join(silent) if silent else "none is healthy"))
        raise NoCapacity(f"no decode replica can reserve KV for this request ({'; '.join(reasons)})")

    async def _prefill(self, request, workers, decode: WorkerRecord, reservation,
                       touched: Touched):
        """Prefill stream, retried once on another replica if it fails before any token."""
        candidates = rank_prefill(workers, len(request.prompt_token_ids))
        if not candidates:
            raise unhealthy("no healthy prefill worker")
        for attempt, w in enumerate(candidates[:PREFILL_ATTEMPTS]):
            touched.sources.add(w.grpc_address)
            sent = False
            try:
                async for chunk in self._mux_to(w.grpc_address).call("prefill", pb.PrefillRequest(
                        request_id=request.request_id, tenant=request.tenant,
                        traffic_class=request.traffic_class,
                        prompt_token_ids=request.prompt_token_ids, params=request.params,
                        target=reservation.target, decode_worker=decode.grpc_address,
                        kv_deadline_unix_s=reservation.expires_at_unix_s)):
                    sent = sent or bool(chunk.token_ids)
                    yield chunk
                return
            except grpc.aio.AioRpcError as e:
                retryable = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                                         grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
                if sent or not retryable or attempt + 1 >= min(PREFILL_ATTEMPTS, len(candidates)):
                    raise

    async def Cancel(self, request: pb.CancelRequest, context) -> pb.CancelResponse:
        touched = self._live.pop(request.request_id, None)
        if touched is None:
            return pb.CancelResponse(cancelled=False)
        await self._cancel_all(request.request_id, touched)
        return pb.CancelResponse(cancelled=True)

    async def Health(self, request, context) -> pb.HealthResponse:
        """SERVING when the worker list, read now, has every role this mode needs. Redis down:
        NOT_SERVING at once, naming why (no wait on Redis while its backoff runs)."""
        try:
            workers = await self._read_workers()
        except UNREACHABLE as e:
            return pb.HealthResponse(status=pb.HealthResponse.NOT_SERVING,
                                     detail=f"worker list unavailable: {e}",
                                     mux_address=self.mux_address)
        ok = self._needed_roles <= {w.role for w in workers}
        return pb.HealthResponse(
            status=pb.HealthResponse.SERVING if ok else pb.HealthResponse.NOT_SERVING,
            detail=f"{len(workers)} live workers: " + ", ".join(sorted(w.worker_id for w in workers)),
            mux_address=self.mux_address)

    # ----------------------------------------------------------------- helpers
    def _link(self, address: str) -> WorkerLink:
        link = self._links.get(address)
        if link is None:
            channel = internal_channel(address)
            mux = MuxChannel(connect_to(pb_grpc.WorkerStub(channel), address), address)
            link = self._links[address] = WorkerLink(channel, mux)
        return link

    def _mux_to(self, address: str) -> MuxChannel:
        return self._link(address).mux

    def _cancel_everywhere(self, rid: str, touched: Touched) -> None:
        asyncio.get_running_loop().create_task(self._cancel_all(rid, touched))

    async def _cancel_all(self, rid: str, touched: Touched) -> None:
        """Cancel on every worker touched: prefill (and mixed) workers first, whose Cancel answers
        once a KV write of the request is over; only then decode workers, which free the
        reservation that write went into."""
        async def one(address: str, timeout_s: float) -> None:
            # over the mux, after the request's own frames (a Reserve still on its way is then
            # always seen before its Cancel)
            try:
                await asyncio.wait_for(self._mux_to(address).unary(
                    "release", pb.CancelRequest(request_id=rid)), timeout_s)
            except (grpc.aio.AioRpcError, asyncio.TimeoutError):
                pass   # a dead worker holds nothing any more (a hung one: its reservation expires)
        await asyncio.gather(*(one(a, CANCEL_WRITER_TIMEOUT_S) for a in touched.sources))
        await asyncio.gather(*(one(a, CANCEL_TIMEOUT_S) for a in touched.kv_targets))

    async def close(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
        for link in self._links.values():
            await link.mux.close()
        await asyncio.gather(*(link.channel.close() for link in self._links.values()))


def _relayable(code: grpc.StatusCode) -> grpc.StatusCode:
    """Worker failures reach the client as UNAVAILABLE; request errors keep their code."""
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
        return code
    return grpc.StatusCode.UNAVAILABLE
