"""The Router gRPC service: admit, place, reserve, answer with the plan (DESIGN.md section 3, step 2).

The router decides and steps aside: it is on no token path and keeps nothing of a request once it
answered. Admit(WorkRequest) -> Plan, in order:
  1. the live workers, from Redis (a cache of at most WORKERS_MAX_AGE_S; all state that matters
     is there, so several routers decide alike);
  2. disaggregated: Reserve on the best decode replica that accepts (its reservations are
     authoritative; one that does not answer within `reserve_s` is skipped), then rank the
     prefill replicas (the gateway falls back to the second if the first fails before its first
     token); co-located: the best `mixed` worker;
  3. the plan: prefill worker(s), decode worker, the reservation's KV target and its deadline.
A refusal is RESOURCE_EXHAUSTED (OVERLOADED: every replica busy) or UNAVAILABLE (no healthy
replica of a role, Redis down), with a CallStatus naming why and when to retry.

A Reserve whose answer came too late (the worker was slow, not dead) leaves a reservation no one
will use: the decode worker frees it at its deadline (services/decode/reservations.py).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time

import grpc

from services.protocol import status
from services.protocol.aio import internal_channel
from services.protocol.fleet_token import FleetAuth
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.protocol.timeouts import Timeouts
from services.router.placement import rank_decode, rank_prefill
from services.state.fleet_state import FleetState
from services.state.outage import UNREACHABLE, Outage

log = logging.getLogger(__name__)

PREFILL_CHOICES = 2      # the plan's prefill worker and one fallback
WORKERS_TTL_S = 0.1      # a worker list this old is re-read from Redis in the background
WORKERS_MAX_AGE_S = 1.0  # one older than this (an idle router) is re-read before placing
WORKERS_STALE_OK_S = 5.0  # while Redis is down, a list this young is still served

# When a refused request may try again. A decode replica's blocks free as its sequences end, which
# the router cannot foresee: a reservation refused for load says retry in RESERVE_RETRY_S. No
# healthy worker of a role: `kvfleet up` restarts a dead one within a few seconds, and a new
# worker is placed on as soon as its first heartbeat lands.
RESERVE_RETRY_S = 1.0
UNHEALTHY_RETRY_S = 2.0


def overloaded(message: str) -> status.CallFailed:
    return status.CallFailed(status.failed(pb.OVERLOADED, message, retry_after_s=RESERVE_RETRY_S))


def unhealthy(message: str, retry_after_s: float = UNHEALTHY_RETRY_S) -> status.CallFailed:
    return status.CallFailed(status.failed(pb.UNAVAILABLE, message, retry_after_s=retry_after_s))


class RouterServicer(pb_grpc.RouterServicer):
    def __init__(self, state: FleetState, mode: str = "disagg", router_id: str = "router",
                 timeouts: Timeouts | None = None, auth: FleetAuth | None = None) -> None:
        self.state = state
        self.auth = auth              # what calls to workers present (None: this process's token)
        self.mode = mode
        self.router_id = router_id
        self.timeouts = timeouts or Timeouts()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._workers: tuple[float, list[pb.WorkerStats]] = (float("-inf"), [])
        self._refreshing: asyncio.Task | None = None
        self.redis = Outage("router worker list", log)
        self._needed_roles = {"mixed"} if mode == "colocated" else {"prefill", "decode"}

    async def live_workers(self) -> list[pb.WorkerStats]:
        """Live workers from Redis, at most one read per WORKERS_TTL_S and none on a request's
        path while the list is younger than WORKERS_MAX_AGE_S: a stale list is served while a
        background read replaces it. A worker that died since is caught by its failing RPC
        (retry / UNAVAILABLE), and the list is then re-read by the next request; a list that lacks a
        role this mode needs is re-read at once.

        Redis down: the last list read is served while it is younger than WORKERS_STALE_OK_S;
        past that the request fails at once with UNAVAILABLE and a retry hint, never waiting on Redis (`self.redis` refuses until its backoff is over)."""
        at, workers = self._workers
        age = time.monotonic() - at
        if age > WORKERS_MAX_AGE_S or not self._needed_roles <= {w.role for w in workers}:
            try:
                return await self._read_workers()
            except UNREACHABLE as e:
                if age <= WORKERS_STALE_OK_S:
                    return workers
                retry_s = max(1, math.ceil(self.redis.retry_in()))
                raise unhealthy(f"worker list unavailable (Redis: {e}); retry after {retry_s} s",
                                retry_s) from None
        if age > WORKERS_TTL_S and self._refreshing is None:
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh_workers())
        return workers

    async def _read_workers(self) -> list[pb.WorkerStats]:
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

    async def Admit(self, request: pb.WorkRequest, context) -> pb.Plan:
        try:
            workers = await self.live_workers()
            if self.mode == "colocated":
                return self._colocated(request, workers)
            return await self._disaggregated(request, workers)
        except status.CallFailed as e:
            if e.status.reason == pb.UNAVAILABLE:
                self._workers = (float("-inf"), [])   # a worker failed: the next request re-reads
            await status.abort(context, e.status)

    def _colocated(self, request: pb.WorkRequest, workers) -> pb.Plan:
        candidates = rank_decode(workers, role="mixed")
        if not candidates:
            raise unhealthy("no healthy mixed worker")
        return pb.Plan(request_id=request.request_id, mode=pb.Plan.COLOCATED,
                       prefill=[_ref(w) for w in candidates[:PREFILL_CHOICES]],
                       router_id=self.router_id)

    async def _disaggregated(self, request: pb.WorkRequest, workers) -> pb.Plan:
        prefill = rank_prefill(workers, len(request.prompt_token_ids))
        if not prefill:
            raise unhealthy("no healthy prefill worker")
        decode, reservation = await self._reserve(request, workers)
        return pb.Plan(request_id=request.request_id, mode=pb.Plan.DISAGGREGATED,
                       prefill=[_ref(w) for w in prefill[:PREFILL_CHOICES]], decode=_ref(decode),
                       target=reservation.target, deadline_unix_s=reservation.expires_at_unix_s,
                       router_id=self.router_id)

    async def _reserve(self, request: pb.WorkRequest, workers):
        reasons, silent = [], []
        ask = pb.ReserveRequest(request_id=request.request_id, tenant=request.tenant,
                                traffic_class=request.traffic_class,
                                prompt_token_ids=request.prompt_token_ids, params=request.params)
        for w in rank_decode(workers):
            try:
                resp = await self._stub(w.grpc_address).Reserve(ask, timeout=self.timeouts.reserve_s)
            except grpc.aio.AioRpcError as e:
                st = status.of(e)
                if st.reason == pb.INVALID_REQUEST:
                    raise status.CallFailed(st) from None
                # a hung or dead worker: try the next one. A Reserve that lands later anyway is
                # freed by the decode worker at the reservation's deadline.
                silent.append(f"{w.worker_id}: {e.code().name}: {st.message}")
                self._workers = (float("-inf"), [])        # re-read the list next time
                continue
            if resp.accepted:
                return w, resp
            reasons.append(f"{w.worker_id}: {resp.reason}")
        if not reasons:
            raise unhealthy("no decode replica can reserve KV for this request: "
                            + ("; ".join(silent) if silent else "none is healthy"))
        raise overloaded(f"no decode replica can reserve KV for this request "
                         f"({'; '.join(reasons)})")

    async def Health(self, request, context) -> pb.HealthResponse:
        """SERVING when the worker list, read now, has every role this mode needs. Redis down:
        NOT_SERVING at once, naming why (no wait on Redis while its backoff runs)."""
        try:
            workers = await self._read_workers()
        except UNREACHABLE as e:
            return pb.HealthResponse(status=pb.HealthResponse.NOT_SERVING,
                                     detail=f"worker list unavailable: {e}")
        ok = self._needed_roles <= {w.role for w in workers}
        return pb.HealthResponse(
            status=pb.HealthResponse.SERVING if ok else pb.HealthResponse.NOT_SERVING,
            detail=f"{self.router_id}: {len(workers)} live workers: "
                   + ", ".join(sorted(w.worker_id for w in workers)))

    # ----------------------------------------------------------------- helpers
    def _stub(self, address: str) -> pb_grpc.WorkerStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = internal_channel(address, self.auth)
        return pb_grpc.WorkerStub(channel)

    async def close(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
        await asyncio.gather(*(c.close() for c in self._channels.values()))


def _ref(w: pb.WorkerStats) -> pb.WorkerRef:
    return pb.WorkerRef(worker_id=w.worker_id, address=w.grpc_address)
