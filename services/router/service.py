"""The Router gRPC service: admit, place, reserve, answer with the plan (DESIGN.md section 3, step 2).

The router decides and steps aside: it is on no token path and keeps nothing of a request once it
answered. Admit(WorkRequest) -> Plan, in order:
  1. the live workers, from Redis (a cache of at most WORKERS_MAX_AGE_S; all state that matters
     is there, so several routers decide alike);
  2. disaggregated: Reserve on the best decode replica that accepts (its reservations are
     authoritative; one that does not answer within `reserve_s` is skipped; the ranking counts what
     routers placed since each worker's beat: services/router/placements.py), then rank the
     prefill replicas (the gateway falls back to the second if the first fails before its first
     token); co-located: the best `mixed` worker;
  3. the plan: prefill worker(s), decode worker, the reservation's KV target and its deadline.
A refusal is RESOURCE_EXHAUSTED (OVERLOADED: every replica busy) or UNAVAILABLE (no healthy
replica of a role, Redis down), with a CallStatus naming why and when to retry.

Telemetry (DESIGN section 7): one `router.admit` SERVER span per Admit (continuing the caller's
trace from the call's metadata) with one `router.reserve` CLIENT span per Reserve call under it
(its metadata carries the context on, so the decode worker's span continues it); RouterMetrics
count every decision (admitted / rejected, reason, stage, class), its time, the predicted TTFT,
live workers by role and placements by worker. Overload stages are not implemented yet: every
decision is taken in S0_NORMAL and says so (Plan.stage, CallStatus.stage, the stage gauge is 0).

Predicted TTFT (Plan.predicted_ttft_s, its terms in Plan.predicted_*_s): services/router/predict.py,
from what the chosen workers measured of themselves (a cold worker publishes its prior: never 0).
Prefix hits are not known to the router yet (cached_tokens = 0).

A Reserve whose answer came too late (the worker was slow, not dead) leaves no reservation: the
call carries its deadline, and the decode worker undoes whatever its engine reserved for a caller
that had gone (services/decode/reservations.py, kvfleet_reservations_abandoned_total).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.protocol import status
from services.protocol.aio import internal_channel
from services.protocol.fleet_token import FleetAuth
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.protocol.timeouts import Timeouts
from services.router.placement import (Placed, can_ever_hold, kv_blocks_needed, rank_decode,
                                       rank_mixed, rank_prefill)
from services.router.placements import PlacementLedger
from services.router.pools import StageView, choose_pool, in_pool, served_by
from services.router.prefix_index import PrefixIndex
from services.router.predict import decode_wait_s, kv_bytes_of, predict
from services.state.fleet_state import ROLES, FleetState
from services.state.outage import UNREACHABLE, Outage
from services.state.stage_record import StageStore
from services.telemetry import tracing
from services.telemetry.labels import TenantLabels
from services.telemetry.metrics import RouterMetrics

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

STAGE = pb.S0_NORMAL            # overload stages come in a later issue: always S0 for now
STAGE_NAME = pb.OverloadStage.Name(STAGE)
CLASS_LABELS = 16               # distinct traffic-class label values kept (the rest: "other")
WORKER_ATTR = "kvfleet.worker_id"           # router.reserve: the decode worker asked
ACCEPTED_ATTR = "kvfleet.reserve.accepted"
KV_BLOCKS_ATTR = "kvfleet.kv_blocks_needed"  # router.admit: the reservation's KV pages (n-aware)


def overloaded(message: str) -> status.CallFailed:
    return status.CallFailed(status.failed(pb.OVERLOADED, message, retry_after_s=RESERVE_RETRY_S))


def unhealthy(message: str, retry_after_s: float = UNHEALTHY_RETRY_S) -> status.CallFailed:
    return status.CallFailed(status.failed(pb.UNAVAILABLE, message, retry_after_s=retry_after_s))


class RouterServicer(pb_grpc.RouterServicer):
    def __init__(self, state: FleetState, mode: str = "disagg", router_id: str = "router",
                 timeouts: Timeouts | None = None, auth: FleetAuth | None = None,
                 metrics: RouterMetrics | None = None,
                 prefix_index: PrefixIndex | None = None) -> None:
        self.state = state
        self.prefix_index = prefix_index  # None: placement by load alone (no prefix affinity)
        self.metrics = metrics or RouterMetrics()
        self.metrics.stage.set(STAGE)
        # a worker record the fleet did not sign (or pointing elsewhere) is ignored and counted
        state.seal.on_rejected = lambda kind, reason: self.metrics.records_rejected.labels(
            kind, reason).inc()
        self._classes = TenantLabels(CLASS_LABELS)
        self.auth = auth              # what calls to workers present (None: this process's token)
        self.mode = mode
        self.router_id = router_id
        self.timeouts = timeouts or Timeouts()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._workers: tuple[float, list[pb.WorkerStats]] = (float("-inf"), [])
        self._refreshing: asyncio.Task | None = None
        self.redis = Outage("router worker list", log)
        self.placements = PlacementLedger(state, self.redis)
        self._needed_roles = {"mixed"} if mode == "colocated" else {"prefill", "decode"}
        self.stage_view = StageView(StageStore(state.redis, state.ns), self.redis)   # the fallback pool's cue

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
        for role in ROLES:
            self.metrics.workers.labels(role).set(sum(w.role == role for w in workers))
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

    async def watch_workers(self, every_s: float) -> None:
        """Re-read the worker list every `every_s` while no request does, so that the live-workers
        gauge (and the no-ready-workers alert on it) follows the fleet on an idle router too.
        Runs until cancelled; a failed read waits for the next period (Outage logs it once)."""
        while True:
            await asyncio.sleep(every_s)
            if time.monotonic() - self._workers[0] >= every_s and self._refreshing is None:
                await self._refresh_workers()

    async def Admit(self, request: pb.WorkRequest, context) -> pb.Plan:
        started = time.perf_counter()
        cls = self._classes.label(request.traffic_class)
        with tracing.tracer.start_as_current_span(
                "router.admit", context=tracing.incoming(context), kind=SpanKind.SERVER,
                record_exception=False, set_status_on_exception=False) as span:
            if span.is_recording():
                span.set_attributes(self._attributes(request))
            try:
                plan = await self._admit(request)
            except status.CallFailed as e:
                if e.status.reason == pb.UNAVAILABLE:
                    self._workers = (float("-inf"), [])   # a worker failed: the next request re-reads
                e.status.stage = STAGE
                self._decided(span, cls, started, pb.Reason.Name(e.status.reason))
                span.set_status(Status(StatusCode.ERROR, e.status.message))
                await status.abort(context, e.status)
            plan.stage = STAGE
            self._decided(span, cls, started, "OK", plan)
            return plan

    def _attributes(self, request: pb.WorkRequest) -> dict:
        return {tracing.REQUEST_ID: request.request_id, tracing.TENANT: request.tenant,
                tracing.TRAFFIC_CLASS: request.traffic_class, tracing.REPLICA: self.router_id,
                tracing.PROVIDER: tracing.PROVIDER_NAME,
                tracing.INPUT_TOKENS: len(request.prompt_token_ids),
                tracing.MAX_TOKENS: request.params.max_tokens,
                tracing.QUEUE_WAIT: 0.0,                  # the router has no queue yet
                tracing.STAGE: STAGE_NAME}

    async def _admit(self, request: pb.WorkRequest) -> pb.Plan:
        workers = await self.live_workers()
        span = trace.get_current_span()
        if workers and span.is_recording():     # one model per fleet: any worker names it
            span.set_attribute(tracing.REQUEST_MODEL, workers[0].model)
        pool = choose_pool(workers, await self.stage_view.current(), request.degradable,
                           self._needed_roles)
        workers = in_pool(workers, pool)      # one pool per request: KV layouts differ
        if self.mode == "colocated":
            return served_by(await self._colocated(request, workers), workers, pool)
        return served_by(await self._disaggregated(request, workers), workers, pool)

    def _decided(self, span, cls: str, started: float, reason: str, plan: pb.Plan | None = None):
        """Count one decision and describe it on its span: admitted (with its plan) or rejected."""
        decision = "admitted" if plan is not None else "rejected"
        m = self.metrics
        m.admissions.labels(decision, reason, STAGE_NAME, cls).inc()
        m.admit_seconds.labels(cls).observe(time.perf_counter() - started)
        if plan is not None:
            m.predicted_ttft.labels(cls).observe(plan.predicted_ttft_s)
            if plan.mode == pb.Plan.COLOCATED:
                m.placements.labels("mixed", plan.prefill[0].worker_id).inc()
            else:
                m.placements.labels("prefill", plan.prefill[0].worker_id).inc()
                m.placements.labels("decode", plan.decode.worker_id).inc()
        if span.is_recording():
            span.set_attributes({tracing.DECISION: decision, tracing.REASON: reason})
            if plan is not None:
                span.set_attribute(tracing.PREDICTED_TTFT, plan.predicted_ttft_s)

    async def _colocated(self, request: pb.WorkRequest, workers) -> pb.Plan:
        mixed = [w for w in workers if w.role == "mixed"]
        placed = await self.placements.read(mixed)
        prompt = len(request.prompt_token_ids)
        needed = kv_blocks_needed(mixed[0], prompt, request.params) if mixed else 0
        cached = self._cached(request, mixed)
        candidates = rank_mixed(mixed, needed, placed, self.placements.turn, cached)
        if not candidates:
            raise unhealthy("no healthy mixed worker")
        blocks = kv_blocks_needed(candidates[0], prompt, request.params)
        await self.placements.add(candidates[0], blocks)
        prediction = predict(candidates[0], prompt, traffic_class=request.traffic_class,
                             cached_tokens=cached.get(candidates[0].worker_id, 0),
                             decode_wait_s=decode_wait_s(candidates[0], blocks))
        return prediction.fill(pb.Plan(request_id=request.request_id, mode=pb.Plan.COLOCATED,
                                       prefill=[_ref(w) for w in candidates[:PREFILL_CHOICES]],
                                       router_id=self.router_id))

    async def _disaggregated(self, request: pb.WorkRequest, workers) -> pb.Plan:
        prompt = len(request.prompt_token_ids)
        cached = self._cached(request, [w for w in workers if w.role == "prefill"])
        prefill = rank_prefill(workers, prompt, self.placements.turn, cached)
        if not prefill:
            raise unhealthy("no healthy prefill worker")
        decode, reservation = await self._reserve(request, workers)
        prediction = predict(prefill[0], prompt, traffic_class=request.traffic_class,
                             cached_tokens=cached.get(prefill[0].worker_id, 0),
                             kv_bytes=kv_bytes_of(prefill[0], prompt), decode_wait_s=decode_wait_s(
                                 decode, kv_blocks_needed(decode, prompt, request.params)))
        return prediction.fill(pb.Plan(
            request_id=request.request_id, mode=pb.Plan.DISAGGREGATED,
            prefill=[_ref(w) for w in prefill[:PREFILL_CHOICES]], decode=_ref(decode),
            target=reservation.target, deadline_unix_s=reservation.expires_at_unix_s,
            router_id=self.router_id))

    def _cached(self, request: pb.WorkRequest, workers) -> dict[str, int]:
        """Leading prompt tokens each worker holds in its prefix cache ({}: no index)."""
        if self.prefix_index is None:
            return {}
        return self.prefix_index.cached_tokens(request.prompt_token_ids, request.tenant,
                                               [w.worker_id for w in workers])

    async def _reserve(self, request: pb.WorkRequest, workers):
        reasons, silent = [], []
        ask = pb.ReserveRequest(request_id=request.request_id, tenant=request.tenant,
                                traffic_class=request.traffic_class,
                                prompt_token_ids=request.prompt_token_ids, params=request.params)
        decode = [w for w in workers if w.role == "decode"]
        placed = await self.placements.read(decode)
        for w in self._decode_candidates(request, decode, placed, self.placements.turn):
            blocks = kv_blocks_needed(w, len(request.prompt_token_ids), request.params)
            await self.placements.add(w, blocks)   # counted before the Reserve: a burst sees it
            try:
                resp = await self._reserve_on(w, ask)
            except grpc.aio.AioRpcError as e:
                await self.placements.take_back(w, blocks)
                st = status.of(e)
                if st.reason == pb.INVALID_REQUEST:
                    raise status.CallFailed(st) from None
                # a hung or dead worker: try the next one. A Reserve that lands later anyway is
                # undone by the decode worker (past its deadline, nothing is reserved).
                silent.append(f"{w.worker_id}: {e.code().name}: {st.message}")
                self._workers = (float("-inf"), [])        # re-read the list next time
                continue
            if resp.accepted:
                return w, resp
            await self.placements.take_back(w, blocks)
            reasons.append(f"{w.worker_id}: {resp.reason}")
        if not reasons:
            raise unhealthy("no decode replica can reserve KV for this request: "
                            + ("; ".join(silent) if silent else "none is healthy"))
        raise overloaded(f"no decode replica can reserve KV for this request "
                         f"({'; '.join(reasons)})")

    @staticmethod
    def _decode_candidates(request: pb.WorkRequest, workers, placed: dict[str, Placed] | None = None,
                           turn: int = 0) -> list[pb.WorkerStats]:
        """Decode replicas to ask, best first (counting `placed` since their beats, ties from `turn`),
        leaving out those whose whole pool is smaller than the request's KV pages (kv_blocks_needed: n
        samples count the prompt once); if none is large enough the best is still asked, so that its
        engine refuses with the limits."""
        ranked = rank_decode(workers, "decode", placed, turn)
        prompt = len(request.prompt_token_ids)
        span = trace.get_current_span()
        if ranked and span.is_recording():
            span.set_attribute(KV_BLOCKS_ATTR, kv_blocks_needed(ranked[0], prompt, request.params))
        return [w for w in ranked if can_ever_hold(w, prompt, request.params)] or ranked[:1]

    async def _reserve_on(self, w: pb.WorkerStats, ask: pb.ReserveRequest) -> pb.ReserveResponse:
        """One Reserve call, in a CLIENT span whose context its metadata carries on."""
        with tracing.tracer.start_as_current_span(
                "router.reserve", kind=SpanKind.CLIENT, record_exception=False) as span:
            if span.is_recording():
                span.set_attributes({"rpc.system": "grpc", "rpc.method": "Reserve",
                                     "server.address": w.grpc_address, WORKER_ATTR: w.worker_id,
                                     tracing.REQUEST_ID: ask.request_id,
                                     tracing.REPLICA: self.router_id})
            resp = await self._stub(w.grpc_address).Reserve(
                ask, timeout=self.timeouts.reserve_s, metadata=tracing.outgoing())
            if span.is_recording():
                span.set_attribute(ACCEPTED_ATTR, resp.accepted)
            return resp

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
