"""The Router gRPC service: admit, place, reserve, answer with the plan (DESIGN.md section 3, step 2).

The router decides and steps aside: it is on no token path and keeps nothing of a request once it
answered. Admit(WorkRequest) -> Plan, in order (docs/architecture.md, "The router's decision"):
  1. the live workers, from Redis (a cache of at most WORKERS_MAX_AGE_S; all state that matters
     is there, so several routers decide alike);
  2. the class (TTFT target, degradable) and tenant (critical, min_kv_blocks), and what the
     fleet's stage does to them (services/router/admission.py; the stage is the record in Redis
     that every router's stage keeper maintains: services/router/keeper.py);
  3. the predicted TTFT of the best placement (services/router/predict.py) against the class's
     target: admit, wait in the Redis wait queue (tenant-fair within a class:
     services/router/fair_order.py; woken by `{ns}capacity` notifications, or by a timer), or
     refuse when even the best case misses (unless that best case is priced by an idle worker's
     prior: then one probe at a time goes there, so that it measures: admission.py);
  4. disaggregated: Reserve on the best decode replica that accepts (its reservations are
     authoritative; one that does not answer within `reserve_s` is skipped; the ranking counts what
     routers placed since each worker's beat: services/router/placements.py), the prefill
     replicas ranked (the gateway falls back to the second if the first fails before its first
     token); co-located: the best `mixed` worker. Unprotected requests leave the headroom kept
     for critical tenants;
  5. the plan: prefill worker(s), decode worker, the reservation's KV target and its deadline, the
     stage and any output cap.
A refusal is RESOURCE_EXHAUSTED (OVERLOADED: the best case misses the target, the wait ran out, or
the stage refuses) or UNAVAILABLE (no healthy replica of a role, Redis down), with a CallStatus
naming why (the term, predicted vs target seconds), the stage, and when to retry (from the
fleet's measured drain rate: services/router/waiting.py).

Telemetry (DESIGN section 7): one `router.admit` SERVER span per Admit (continuing the caller's
trace from the call's metadata) with one `router.reserve` CLIENT span per Reserve call under it
(its metadata carries the context on, so the decode worker's span continues it); RouterMetrics
count every decision (admitted / rejected, reason, stage, class), its time, the predicted TTFT,
live workers by role and placements by worker; the stage gauge follows the fleet's record.

Predicted TTFT (Plan.predicted_ttft_s, its terms in Plan.predicted_*_s): services/router/predict.py,
from what the chosen workers measured of themselves (a cold worker publishes its prior: never 0),
counting only the prompt tokens the prefill worker does not hold (the prefix index). The fallback
pool (services/router/pools.py): from S3 on a degradable request is placed on it when it has
every role this mode needs; one request never mixes pools.

A Reserve whose answer came too late (the worker was slow, not dead) leaves no reservation: the
call carries its deadline, and the decode worker undoes whatever its engine reserved for a caller
that had gone (services/decode/reservations.py, kvfleet_reservations_abandoned_total).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

import grpc
from opentelemetry import trace
from redis.exceptions import RedisError
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.protocol import shared_call, status
from services.protocol.aio import internal_channel
from services.protocol.fleet_token import FleetAuth
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.protocol.timeouts import Timeouts
from services.protocol.typed_stub import TypedStub
from services.router import admission
from services.router.admission import AdmissionConfig
from services.router.keeper import DecisionCounts, RecentPredictions, StageKeeper
from services.router.placement import (Placed, can_ever_hold, kv_blocks_needed, rank_decode,
                                       rank_mixed, rank_prefill, room_after)
from services.router.path_choice import choose
from services.router.paths import DEFAULT_THRESHOLD_TOKENS, PATH_ROLES, Paths
from services.router.placements import PlacedPrompt, PlacedPrompts, PlacementLedger
from services.router.pools import choose_pool, in_pool, served_by
from services.router.prefix_index import PrefixIndex
from services.router.predict import Prediction, decode_wait_s, kv_bytes_of, predict
from services.router.stages import Signals, StageMachine, stage_name
from services.router.waiting import DrainRate, Wakeups, retry_after_s
from services.state.fleet_state import ROLES, FleetState
from services.state.outage import UNREACHABLE, Outage
from services.state.stage_record import StageStore
from services.state.wait_queue import WaitQueue
from services.telemetry import tracing
from services.telemetry.labels import TenantLabels
from services.telemetry.metrics import RouterMetrics

log = logging.getLogger(__name__)

PREFILL_CHOICES = 2      # the plan's prefill worker and one fallback
WORKERS_TTL_S = 0.1      # a worker list this old is re-read from Redis in the background
WORKERS_MAX_AGE_S = 1.0  # one older than this (an idle router) is re-read before placing
WORKERS_STALE_OK_S = 5.0  # while Redis is down, a list this young is still served

# When a request refused as unavailable may try again. No healthy worker of a role: `kvfleet up`
# restarts a dead one within a few seconds, and a new worker is placed on as soon as its first
# heartbeat lands. (Load refusals price their own: services/router/waiting.py.)
UNHEALTHY_RETRY_S = 2.0

CLOSE_S = 2.0                   # close() waits this long for the background tasks to end
CLASS_LABELS = 16               # distinct traffic-class label values kept (the rest: "other")
WORKER_ATTR = "kvfleet.worker_id"           # router.reserve: the decode worker asked
ACCEPTED_ATTR = "kvfleet.reserve.accepted"
KV_BLOCKS_ATTR = "kvfleet.kv_blocks_needed"  # router.admit: the reservation's KV pages (n-aware)
PROBE_ATTR = "kvfleet.admission.probe"       # router.admit: admitted as a probe (admission.py)


class StageRefusal(status.CallFailed):
    """A refusal the stage itself made (S4, or a held batch request whose wait ran out): not
    counted in the error-rate signal, so that a stage does not hold itself up."""


@dataclass(frozen=True, slots=True)
class Miss:
    """One try that admitted nothing: why, and what the waiter does next."""
    term: str                        # the term that broke the target, or what held it
    prediction: Prediction
    blocks: int                      # the KV blocks it needs (prices the Retry-After)
    final: bool = False              # even the best case breaks the target: refuse now
    by_stage: bool = False           # the stage held or refused it
    from_stats: bool = False         # judged on stats: retry once a beat has refreshed them
    detail: str = ""                 # what the workers said, for the refusal's message
    protected: bool = False          # it waits ahead of every borrower (fair_order.py)


def unhealthy(message: str, retry_after_s: float = UNHEALTHY_RETRY_S) -> status.CallFailed:
    return status.CallFailed(status.failed(pb.UNAVAILABLE, message, retry_after_s=retry_after_s))


class RouterServicer(pb_grpc.RouterServicer):
    def __init__(self, state: FleetState, mode: str = "disagg", router_id: str = "router",
                 timeouts: Timeouts | None = None, auth: FleetAuth | None = None,
                 metrics: RouterMetrics | None = None,
                 prefix_index: PrefixIndex | None = None,
                 policy: AdmissionConfig | None = None,
                 hybrid_threshold_tokens: int = DEFAULT_THRESHOLD_TOKENS) -> None:
        self.state = state
        self.prefix_index = prefix_index  # None: placement by load alone (no prefix affinity)
        self.metrics = metrics or RouterMetrics()
        self.metrics.stage.set(pb.S0_NORMAL)
        # a worker record the fleet did not sign (or pointing elsewhere) is ignored and counted
        state.seal.on_rejected = lambda kind, reason: self.metrics.records_rejected.labels(
            kind, reason).inc()
        self._classes = TenantLabels(CLASS_LABELS)
        self.auth = auth              # what calls to workers present (None: this process's token)
        self.mode = mode
        self.paths = Paths(mode, hybrid_threshold_tokens)   # which path serves each request
        self.router_id = router_id
        self.timeouts = timeouts or Timeouts()
        self.policy = policy or AdmissionConfig()
        self._weights = {t.name: t.weight for t in self.policy.tenants}   # the fair order's
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._reserve_calls: dict[str, shared_call.SharedCall] = {}
        self._workers: tuple[float, list[pb.WorkerStats]] = (float("-inf"), [])
        self._refreshing: asyncio.Task | None = None
        self.redis = Outage("router worker list", log)
        self.placements = PlacementLedger(state, self.redis)
        self.queue = WaitQueue(state.redis, state.ns)
        self.wakeups = Wakeups(self.queue, DrainRate())
        self.recent = RecentPredictions(self.policy.ttft_window_s)
        self.counts = DecisionCounts(state.redis, state.ns)
        self.keeper = StageKeeper(StageStore(state.redis, state.ns),
                                  StageMachine(self.policy.stages), router_id, self.fleet_signals,
                                  on_stage=self.metrics.stage.set)
        self._background: list[asyncio.Task] = []
        self.placed_prompts = PlacedPrompts()   # on each prefill worker since its beat
        self.probes = admission.Probes(self.policy.probe_hold_s)   # one in flight per worker

    def start(self, keeper: bool = True) -> None:
        """The capacity subscription and (unless `keeper` is False) the stage keeper, once."""
        if self._background:
            return
        loop = asyncio.get_running_loop()
        self._background.append(loop.create_task(self.wakeups.listen()))
        if keeper:
            self._background.append(loop.create_task(self.keeper.run(self.policy.keeper_every_s)))

    async def fleet_signals(self) -> Signals:
        """The stage signals now (services/router/keeper.py says what each is)."""
        workers = await self._read_workers()
        pools = [w for w in workers if w.role in ("decode", "mixed")]
        total = sum(w.kv_blocks_total for w in pools)
        taken = sum(w.kv_blocks_total - w.kv_blocks_free + w.kv_blocks_reserved
                    + w.kv_blocks_held for w in pools)
        now_unix = time.time()
        ages = [(await self.queue.depth(c.name, now_unix)).oldest_age_s / c.ttft_target_s
                for c in self.policy.classes]
        return Signals(kv_reserved=min(1.0, taken / total) if total else 0.0,
                       ttft_pressure=self.recent.quantile(), queue_age=max(ages, default=0.0),
                       error_rate=await self.counts.flush_and_read())

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
        if age > WORKERS_MAX_AGE_S or not self.paths.serving({w.role for w in workers}):
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
        self.start()
        await self.keeper.first_read()
        started = time.perf_counter()
        cls = self._classes.label(request.traffic_class)
        with tracing.tracer.start_as_current_span(
                "router.admit", context=tracing.incoming(context), kind=SpanKind.SERVER,
                record_exception=False, set_status_on_exception=False) as span:
            if span.is_recording():
                span.set_attributes(self._attributes(request))
            made: list[pb.Plan] = []      # the plan once made: its decode reservation is held
            if context is not None:
                context.add_done_callback(lambda ctx: ctx.cancelled() and self._give_up(made))
            try:
                plan = await self._admit(request, context, made)
            except asyncio.CancelledError:
                self._give_up(made)
                raise
            except status.CallFailed as e:
                if e.status.reason == pb.UNAVAILABLE:
                    self._workers = (float("-inf"), [])   # a worker failed: the next request re-reads
                e.status.stage = self.keeper.stage
                # a refusal for load is a decision, not an error: counted as one it would drive
                # the error-rate signal (and so the stage) up under any sustained overload
                self.counts.count(error=e.status.reason != pb.OVERLOADED
                                  and not isinstance(e, StageRefusal))
                self._decided(span, cls, started, pb.Reason.Name(e.status.reason))
                span.set_status(Status(StatusCode.ERROR, e.status.message))
                await status.abort(context, e.status)
            plan.stage = self.keeper.stage
            self.counts.count(error=False)
            self._decided(span, cls, started, "OK", plan)
            return plan

    async def AdmitStream(self, asks, context):
        """Admit for each of a gateway's requests on one long-lived call (shared_call.py): each
        ask runs Admit with its own deadline, trace context and cancellation."""
        async for answer in shared_call.answer_asks(
                asks, lambda ask, ctx: self.Admit(ask.request, ctx), shared_call.ADMIT):
            yield answer

    def _attributes(self, request: pb.WorkRequest) -> dict:
        return {tracing.REQUEST_ID: request.request_id, tracing.TENANT: request.tenant,
                tracing.TRAFFIC_CLASS: request.traffic_class, tracing.REPLICA: self.router_id,
                tracing.PROVIDER: tracing.PROVIDER_NAME,
                tracing.INPUT_TOKENS: len(request.prompt_token_ids),
                tracing.MAX_TOKENS: request.params.max_tokens,
                tracing.STAGE: stage_name(self.keeper.stage)}

    def _give_up(self, made: list[pb.Plan]) -> None:
        """The plan will not reach its caller (the Admit was cancelled while it charged the
        tenant's turn or left the queue, or its call ended before the answer went out): its decode
        reservation ends now (a late cancel on the Reserve call: the worker undoes it), not at its
        deadline, so the tenant's KV share and the worker's held blocks come back at once."""
        while made:
            plan = made.pop()
            if plan.mode == pb.Plan.DISAGGREGATED and plan.decode.address:
                log.info("%s: the Admit's caller went after its reservation; ending it",
                         plan.request_id)
                self._reserve_call(plan.decode.address).cancel(plan.request_id)

    async def _admit(self, request: pb.WorkRequest, context, made: list[pb.Plan]) -> pb.Plan:
        """Try; a miss whose best case still makes the target waits in the queue (woken by
        capacity, or by its own timer) and tries again until its wait ends."""
        cls = self.policy.traffic_class(request.traffic_class)
        remaining = context.time_remaining() if context is not None else None
        bound_s = self.timeouts.queue_s
        if remaining is not None:     # leave the call admit_s to place it after the wait
            bound_s = max(0.0, min(bound_s, remaining - self.timeouts.admit_s))
        began, until, queued_at = time.monotonic(), None, None
        tenant = self.policy.tenant(request.tenant).name
        try:
            while True:
                outcome = await self._try(request, cls, made, first=until is None,
                                          waited_s=time.monotonic() - began)
                if isinstance(outcome, pb.Plan):
                    if queued_at is not None:     # how long it waited in the queue
                        outcome.queue_wait_s = time.monotonic() - queued_at
                    return outcome
                now = time.monotonic()
                if until is None:
                    until = admission.wait_until(now, cls.ttft_target_s, outcome.prediction,
                                                 bound_s)
                    if outcome.by_stage:             # held by the stage: to its wait's end
                        until = now + bound_s
                if outcome.final or now >= until:
                    raise self._refusal(outcome, cls, waited_s=now - began)
                if queued_at is None:
                    try:
                        await self.queue.enqueue(request.request_id, cls.name,
                                                 time.time() + (until - now), time.time(),
                                                 tenant=tenant, protected=outcome.protected)
                    except (RedisError, OSError):     # no queue to wait in: refused now
                        raise self._refusal(outcome, cls, waited_s=0.0) from None
                    queued_at = time.monotonic()
                await self._wait(request.request_id, cls.name, tenant, until, outcome.from_stats)
        finally:
            span = trace.get_current_span()
            if span.is_recording():
                span.set_attribute(tracing.QUEUE_WAIT, time.monotonic() - began)
            if queued_at is not None:
                await asyncio.shield(self._leave(request.request_id, cls.name))

    async def _leave(self, request_id: str, cls: str) -> None:
        try:
            await self.queue.leave(request_id, cls)
        except (RedisError, OSError) as e:   # its deadline prunes it
            log.warning("could not take %s off the wait queue: %s", request_id, e)

    async def _wait(self, request_id: str, cls: str, tenant: str, until: float,
                    from_stats: bool) -> None:
        """Until a capacity notification finds this waiter among the first `wake_width` of its
        class, its retry timer fires (one beat after a miss judged on stats, else the slow
        safety net), or its wait ends."""
        timer = self.timeouts.heartbeat_s if from_stats else self.policy.retry_s
        end = min(until, time.monotonic() + timer)
        while (left := end - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(self.wakeups.next().wait(), left)
            except asyncio.TimeoutError:
                return
            try:
                place = await self.queue.position(request_id, cls, time.time(), tenant,
                                                  self._weights)
            except (RedisError, OSError):
                return                          # the order is unknown: try
            if place is None or place < self.policy.wake_width:
                return

    def _refusal(self, miss: Miss, cls, waited_s: float) -> status.CallFailed:
        stage = stage_name(self.keeper.stage)
        if miss.by_stage:
            message = f"{miss.term} (stage {stage})"
        elif miss.term == admission.KV_TRANSFER:
            message = admission.explain_transfer(
                miss.prediction,
                admission.kv_write_limit_s(self.timeouts, cls.ttft_target_s, miss.prediction),
                stage)
        else:
            message = admission.explain(miss.term, miss.prediction.total_s, cls.ttft_target_s,
                                        stage)
            if miss.detail:
                message = f"{miss.detail}; {message}"
        if waited_s > 0.01:
            message += f"; waited {waited_s:.2f} s in the queue"
        workers = self._workers[1]
        prefill = [w for w in workers if w.role in ("prefill", "mixed")]
        retry = retry_after_s(miss.blocks, self.wakeups.drain.blocks_per_s(),
                              sum(w.queued_prefill_tokens for w in prefill),
                              sum(w.prefill_tokens_per_s for w in prefill))
        st = status.failed(pb.OVERLOADED, message, retry_after_s=retry)
        return StageRefusal(st) if miss.by_stage else status.CallFailed(st)

    def _decided(self, span, cls: str, started: float, reason: str, plan: pb.Plan | None = None):
        """Count one decision and describe it on its span: admitted (with its plan) or rejected."""
        decision = "admitted" if plan is not None else "rejected"
        m = self.metrics
        m.admissions.labels(decision, reason, stage_name(self.keeper.stage), cls).inc()
        m.admit_seconds.labels(cls).observe(time.perf_counter() - started)
        if plan is not None:
            m.predicted_ttft.labels(cls).observe(plan.predicted_ttft_s)
            if plan.mode == pb.Plan.COLOCATED:
                m.placements.labels("mixed", plan.prefill[0].worker_id).inc()
            else:
                m.placements.labels("prefill", plan.prefill[0].worker_id).inc()
                m.placements.labels("decode", plan.decode.worker_id).inc()
        if span.is_recording():
            span.set_attributes({tracing.DECISION: decision, tracing.REASON: reason,
                                 tracing.STAGE: stage_name(self.keeper.stage)})
            if plan is not None:
                span.set_attribute(tracing.PREDICTED_TTFT, plan.predicted_ttft_s)

    async def _try(self, request: pb.WorkRequest, cls, made: list[pb.Plan], first: bool,
                   waited_s: float = 0.0) -> pb.Plan | Miss:
        """One decision on the live workers: a plan, or why not. `waited_s`: what the request
        already spent in the queue, which its TTFT target no longer has. A plan is put in `made`
        the moment its reservation is held (Admit ends it if the plan goes nowhere)."""
        workers = await self.live_workers()
        span = trace.get_current_span()
        if workers and span.is_recording():     # one model per fleet: any worker names it
            span.set_attribute(tracing.REQUEST_MODEL, workers[0].model)
        prompt = len(request.prompt_token_ids)
        path = self.paths.path(prompt, {w.role for w in workers})   # colocated | disagg
        pool = choose_pool(workers, self.keeper.stage, request.degradable, PATH_ROLES[path])
        workers = in_pool(workers, pool)          # one pool per request: KV layouts differ
        path = choose(self.paths, workers, prompt, request.params, traffic_class=cls.name,
                      prior=self.policy.prior, tenant=self.policy.tenant(request.tenant).name,
                      weights=self._weights)      # hybrid: by length and predicted TTFT
        role = "mixed" if path == "colocated" else "decode"
        decode = [w for w in workers if w.role == role]
        # one round trip: the placements since the beats, and whether any of the class waits
        placed, waiting = await self.placements.read_with_waiting(
            decode, self.queue.members_key(cls.name))
        if path == "colocated":
            cached = self._cached(request, decode)
            ranked = rank_mixed([w for w in decode if can_ever_hold(w, prompt, request.params)]
                                or decode[:1], kv_blocks_needed(decode[0], prompt, request.params)
                                if decode else 0, placed, self.placements.turn, cached)
        else:
            ranked = self._decode_candidates(request, decode, placed, self.placements.turn, role)
        if not ranked:
            raise unhealthy(f"no healthy {role} worker")
        if path == "colocated":
            prefill = ranked
        else:
            cached = self._cached(request, [w for w in workers if w.role == "prefill"])
            prefill = rank_prefill(workers, prompt, self.placements.turn, cached)
            if not prefill:
                raise unhealthy("no healthy prefill worker")
        blocks = kv_blocks_needed(ranked[0], prompt, request.params)
        tenant = self.policy.tenant(request.tenant)
        held = admission.tenant_kv(workers, self.placements.tenant_blocks(decode))
        protected = admission.protected(tenant, held, blocks)
        rule = admission.stage_rule(self.policy, self.keeper.stage, cls, protected,
                                    request.params.max_tokens, fallback_pool=pool != "primary")
        hit = cached.get(prefill[0].worker_id, 0)
        mine = PlacedPrompt(cls.name, tenant.name, prompt - hit, hit)
        seen = self.placed_prompts.onto(prefill[0], self.policy.classes)
        p = predict(seen, prompt,
                    traffic_class=cls.name, cached_tokens=hit,
                    kv_bytes=0 if path == "colocated" else kv_bytes_of(prefill[0], prompt),
                    decode_wait_s=decode_wait_s(ranked[0], blocks), prior=self.policy.prior,
                    tenant=tenant.name, weights=self._weights, classes=self.policy.classes)
        # counted before any await: a burst's concurrent admissions see it ahead of them
        self.placed_prompts.add(prefill[0], mine)
        kept = probing = False
        try:
            if first and admission.best_case_s(p) <= cls.ttft_target_s:
                # load, not a hopeless prompt: a request whose own prefill breaks its target says
                # nothing about the fleet
                self.recent.add(p.total_s / cls.ttft_target_s)
            if rule.refuse:
                raise StageRefusal(status.failed(
                    pb.OVERLOADED, f"{rule.note} (stage {stage_name(self.keeper.stage)})",
                    retry_after_s=retry_after_s(blocks, self.wakeups.drain.blocks_per_s(), 0, 0)))
            if rule.hold:
                return Miss(rule.note, p, blocks, by_stage=True, protected=protected)
            probing = admission.probe(self.policy, self.probes, seen, p, cls.ttft_target_s)
            if admission.best_case_s(p) > cls.ttft_target_s and not probing:
                return Miss("prefill", p, blocks, final=True)
            if p.transfer_s > admission.kv_write_limit_s(self.timeouts, cls.ttft_target_s, p):
                return Miss(admission.KV_TRANSFER, p, blocks, final=True)
            budget_s = cls.ttft_target_s - waited_s
            if admission.best_case_s(p) > budget_s and not probing:   # it has waited too long
                return Miss("queue", p, blocks, final=True)
            if p.total_s > budget_s and not probing:
                return Miss(p.dominant(), p, blocks, from_stats=True, protected=protected)
            contended = not first      # it waited: charge its tenant a turn of the fair order
            if first and not protected and not probing:
                deadline = time.time() + min(budget_s - admission.best_case_s(p),
                                             self.timeouts.queue_s)
                ahead, contended = await self._ahead(cls.name, tenant.name, deadline, waiting)
                if ahead:
                    return Miss("queue", p, blocks, from_stats=True, detail=(
                        f"{ahead} earlier {cls.name} requests are ahead of it in the fair order"))
            if rule.output_cap:
                request = _capped(request, rule.output_cap)
            if not protected:
                best = ranked[0]
                ranked = [w for w in ranked if admission.fits_outside_headroom(
                    self.policy, w, *room_after(w, placed.get(w.worker_id, Placed())), blocks)]
                if not ranked:
                    free, _ = room_after(best, placed.get(best.worker_id, Placed()))
                    return Miss("decode KV headroom", p, blocks, from_stats=True, detail=(
                        f"decode KV headroom is kept for critical tenants ({best.worker_id}: "
                        f"{free} blocks available, {blocks} needed)"))
            # the final order, from the placement counts as they are now: other admissions on this
            # loop may have placed since `read` above (no await between this and the count in add)
            now = self.placements.now(ranked)
            if path == "colocated":
                ranked = rank_mixed(ranked, blocks, now, self.placements.turn, cached)
            else:
                ranked = rank_decode(ranked, role, now, self.placements.turn)
            if path == "colocated":
                plan = await self._colocated(request, ranked, p)
            else:
                plan = await self._disaggregated(request, prefill, ranked, p, made)
                if isinstance(plan, str):
                    return Miss("decode slot", p, blocks, detail=plan, protected=protected)
            plan = served_by(plan, workers, pool)
            plan.output_cap = rule.output_cap
            if contended and not protected:
                await self._charge(cls.name, tenant)
            if rule.note and span.is_recording():
                span.set_attribute("kvfleet.stage_rule", rule.note)
            if probing:
                self.metrics.probes.labels(cls.name).inc()
                if span.is_recording():
                    span.set_attribute(PROBE_ATTR, True)
            kept = True
            return plan
        finally:
            if not kept:
                self.placed_prompts.take_back(prefill[0], mine)
                if probing:
                    self.probes.give_back(prefill[0].worker_id)

    async def _ahead(self, cls: str, tenant: str, deadline_unix_s: float,
                     waiting: int) -> tuple[int, bool]:
        """How many waiters of `cls` the fair order puts ahead of a newcomer of `tenant` (it
        queues behind them, unless it is protected), and whether any waits at all (`waiting`:
        the class's members as read with the placements). Redis down: none."""
        if not waiting:
            return 0, False             # the common case: no further round trip
        try:
            return await self.queue.ahead(cls, tenant, deadline_unix_s, self._weights), True
        except (RedisError, OSError):
            return 0, False

    async def _charge(self, cls: str, tenant) -> None:
        """Charge `tenant` the turn it took in the fair order. Redis down: not charged (the
        order then forgets one turn; nothing waits on it)."""
        try:
            await self.queue.admitted(cls, tenant.name, tenant.weight)
        except (RedisError, OSError) as e:
            log.warning("could not charge tenant %s its turn in class %s: %s", tenant.name, cls, e)

    async def _colocated(self, request: pb.WorkRequest, candidates, p: Prediction) -> pb.Plan:
        prompt = len(request.prompt_token_ids)
        self.placements.add(candidates[0], kv_blocks_needed(candidates[0], prompt, request.params),
                            self.policy.tenant(request.tenant).name)      # written behind
        return p.fill(pb.Plan(request_id=request.request_id, mode=pb.Plan.COLOCATED,
                              prefill=[_ref(w) for w in candidates[:PREFILL_CHOICES]],
                              router_id=self.router_id))

    async def _disaggregated(self, request: pb.WorkRequest, prefill, decode,
                             p: Prediction, made: list[pb.Plan]) -> pb.Plan | str:
        """The plan (also put in `made`: its reservation is held), or why no decode replica could
        reserve KV for it now."""
        reserved = await self._reserve(request, decode)
        if isinstance(reserved, str):
            return reserved
        chosen, reservation = reserved
        made.append(p.fill(pb.Plan(request_id=request.request_id, mode=pb.Plan.DISAGGREGATED,
                                   prefill=[_ref(w) for w in prefill[:PREFILL_CHOICES]],
                                   decode=_ref(chosen), target=reservation.target,
                                   deadline_unix_s=reservation.expires_at_unix_s,
                                   router_id=self.router_id)))
        return made[-1]

    def _cached(self, request: pb.WorkRequest, workers) -> dict[str, int]:
        """Leading prompt tokens each worker holds in its prefix cache ({}: no index)."""
        if self.prefix_index is None:
            return {}
        return self.prefix_index.cached_tokens(request.prompt_token_ids, request.tenant,
                                               [w.worker_id for w in workers])

    async def _reserve(self, request: pb.WorkRequest, candidates):
        """Reserve on the first of `candidates` that accepts; when every one refused for load (the
        request may wait), what they said; UNAVAILABLE when none answered."""
        reasons, silent = [], []
        ask = pb.ReserveRequest(request_id=request.request_id, tenant=request.tenant,
                                traffic_class=request.traffic_class,
                                prompt_token_ids=request.prompt_token_ids, params=request.params)
        tenant = self.policy.tenant(request.tenant).name
        for w in candidates:
            blocks = kv_blocks_needed(w, len(request.prompt_token_ids), request.params)
            self.placements.add(w, blocks, tenant)   # counted before the Reserve (written behind)
            try:
                resp = await self._reserve_on(w, ask)
            except status.CallFailed as e:
                self.placements.take_back(w, blocks, tenant)
                st = e.status
                if st.reason == pb.INVALID_REQUEST:
                    raise
                # a hung or dead worker: try the next one. A Reserve that lands later anyway is
                # undone by the decode worker (past its deadline, nothing is reserved).
                code = e.untyped_code.name if e.untyped_code else pb.Reason.Name(st.reason)
                silent.append(f"{w.worker_id}: {code}: {st.message}")
                self._workers = (float("-inf"), [])        # re-read the list next time
                continue
            if resp.accepted:
                return w, resp
            self.placements.take_back(w, blocks, tenant)
            reasons.append(f"{w.worker_id}: {resp.reason}")
        if not reasons:
            raise unhealthy("no decode replica can reserve KV for this request: "
                            + ("; ".join(silent) if silent else "none is healthy"))
        return f"no decode replica can reserve KV for this request ({'; '.join(reasons)})"

    @staticmethod
    def _decode_candidates(request: pb.WorkRequest, workers, placed: dict[str, Placed] | None = None,
                           turn: int = 0, role: str = "decode") -> list[pb.WorkerStats]:
        """Decode replicas to ask, best first (counting `placed` since their beats, ties from `turn`),
        leaving out those whose whole pool is smaller than the request's KV pages (kv_blocks_needed: n
        samples count the prompt once); if none is large enough the best is still asked, so that its
        engine refuses with the limits."""
        ranked = rank_decode(workers, role, placed, turn)
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
            resp = await shared_call.reserve(self._reserve_call(w.grpc_address), ask,
                                             self.timeouts.reserve_s, tracing.outgoing())
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
        ok = self.paths.serving({w.role for w in workers})
        return pb.HealthResponse(
            status=pb.HealthResponse.SERVING if ok else pb.HealthResponse.NOT_SERVING,
            detail=f"{self.router_id}: {len(workers)} live workers: "
                   + ", ".join(sorted(w.worker_id for w in workers)))

    # ----------------------------------------------------------------- helpers
    def _stub(self, address: str) -> TypedStub:
        """A Worker stub whose calls raise status.CallFailed."""
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = internal_channel(address, self.auth)
        return TypedStub(pb_grpc.WorkerStub(channel))

    def _reserve_call(self, address: str) -> shared_call.SharedCall:
        """This router's one ReserveStream call to a decode worker (a new one once it broke)."""
        call = self._reserve_calls.get(address)
        if call is None:
            call = self._reserve_calls[address] = shared_call.reserve_call(
                self._stub(address), address)
        return call

    async def close(self) -> None:
        # the late cancels of reservations whose plans went nowhere (`_give_up`) go out first
        await asyncio.gather(*(call.finish(CLOSE_S) for call in self._reserve_calls.values()))
        if self._refreshing is not None:
            self._refreshing.cancel()
        for task in self._background:
            task.cancel()
        if self._background:        # bounded: a Redis read that swallows a cancel must not hang it
            await asyncio.wait(self._background, timeout=CLOSE_S)
        await self.placements.flush(CLOSE_S)
        await asyncio.gather(*(c.close() for c in self._channels.values()))


def _capped(request: pb.WorkRequest, cap: int) -> pb.WorkRequest:
    """A copy of `request` whose max_tokens is at most `cap` (the stage's output cap)."""
    out = pb.WorkRequest()
    out.CopyFrom(request)
    out.params.max_tokens = min(out.params.max_tokens or cap, cap)
    return out


def _ref(w: pb.WorkerStats) -> pb.WorkerRef:
    return pb.WorkerRef(worker_id=w.worker_id, address=w.grpc_address)
