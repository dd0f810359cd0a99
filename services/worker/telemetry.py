"""A worker's telemetry: its Prometheus metrics (telemetry/metrics.py, WorkerMetrics) fed from what
the worker already sees, and its spans (telemetry/tracing.py).

Where each metric comes from:
  gauges      `refresh(EngineStats)`: the stats the heartbeat takes every heartbeat_s (the Stats
              RPC too; without Redis, the heartbeat refreshes on the same period), so a gauge is at
              most heartbeat_s old; tenant series are bounded by TenantLabels ("other" for the tail)
  steps       `on_step(StepStats)`: EngineClient(on_step=...) calls it once per engine step
  requests    `ended(outcome)` once per request ended here; `queued(queue_s)` at its first token;
              `abandoned(how)` once per decode reservation undone because its caller had gone
  KV          `kv_moved` / `kv_failed`: the prefill side counts bytes sent, the decode side bytes
              landed (direction sent | received)

Spans (DESIGN 7; one trace per request): `prefill` (call receipt -> first token sent, under the
Prefill call's context), `kv_transfer` (write start -> over), `decode` (KV landed -> last token,
under the Reserve call's context), `generate` (a mixed worker: call receipt -> last token). A
prefill (or generate) span gets one `chunk` event per engine prefill chunk of its request, with
the chunk's prompt tokens (StepStats.prefill_chunks), until its first token.

Off (no OTLP endpoint), a span is the API's no-op span and no attribute is built; the metric
children used per step or per request are looked up once, here.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode

from services.kv_transfer.base import FAILURE_REASON_NAMES
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.telemetry import tracing
from services.telemetry.labels import TenantLabels
from services.telemetry.metrics import WorkerMetrics
from services.worker.rates import fresh_pairs

if TYPE_CHECKING:
    from services.engine.engine import EngineStats
    from services.worker.rates import WorkerRates
    from services.worker.engine_core import StepStats

KV_STATES = ("total", "used", "reserved", "free", "cached", "held")
STEP_PHASES = ("prefill", "decode")
# How a request ended on this worker (kvfleet_worker_requests{outcome}):
#   finished    its last token was produced here
#   handed_off  prefill: its first token sent and its KV written into the decode reservation
#   cancelled   the caller went away or cancelled it
#   rejected    refused for load (the engine's admission, or a reservation it cannot back)
#   invalid     a bad request (the engine's validation)
#   error       the engine core failed, or its KV did not move
OUTCOMES = ("finished", "handed_off", "cancelled", "rejected", "invalid", "error")
# Decode reservations whose caller had gone (kvfleet_reservations_abandoned{how}), each undone:
#   expired     the engine core reached the Reserve past its deadline and refused it unrun
#   late        the core reserved after the caller gave up: cancelled in the core
#   unanswered  reserved, but the Reserve call ended before its answer went out: ended here
ABANDONED = ("expired", "late", "unanswered")

CHUNK_TOKENS = "kvfleet.chunk.tokens"          # a `chunk` event: the prompt tokens it computed
TRANSFER_S = "kvfleet.transfer_s"              # decode span: HandOff sent -> KV landed (wall)


def outcome_of(reason: int) -> str:
    """The outcome label of a request that ended with this CallStatus reason."""
    if reason == pb.OVERLOADED:
        return "rejected"
    if reason == pb.INVALID_REQUEST:
        return "invalid"
    return "error"


class WorkerTelemetry:
    def __init__(self, role: str, worker_id: str, registry=None,
                 tenant_labels: TenantLabels | None = None) -> None:
        m = self.metrics = WorkerMetrics(role, worker_id, registry)
        self.role, self.worker_id = role, worker_id
        self.metrics_url = ""                 # set once /metrics is served
        self.tenant_labels = tenant_labels or TenantLabels()
        child = m.labels
        self._running, self._waiting = child(m.running), child(m.waiting)
        self._waiting_for_slot = child(m.waiting_for_decode_slot)
        self._queued_tokens, self._queue_age = child(m.queued_prefill_tokens), child(m.queue_age)
        self._kv_blocks = {s: child(m.kv_blocks, s) for s in KV_STATES}
        self._kv_usage = child(m.kv_usage)
        self._rates = {p: child(m.rates, p) for p in STEP_PHASES}
        self._writes = child(m.kv_writes_in_flight)
        self._iteration = {p: child(m.iteration_tokens, p) for p in STEP_PHASES}
        self._busy = {p: child(m.busy, p) for p in STEP_PHASES}
        self._tokens = {p: child(m.tokens, p) for p in STEP_PHASES}
        self._gap, self._kv_read = child(m.step_gap), child(m.kv_read_bytes)
        self._prefix_queries, self._prefix_hits = child(m.prefix_queries), child(m.prefix_hits)
        self._preemptions, self._queue_time = child(m.preemptions), child(m.queue_time)
        self._outcomes = {o: child(m.requests, o) for o in OUTCOMES}
        self._abandoned = {how: child(m.reservations_abandoned, how) for how in ABANDONED}
        self._tenants_shown: set[str] = set()   # tenant labels with a series (zeroed, not removed)
        self._prefilling: dict[str, Span] = {}  # recording prefill spans awaiting their first token
        # what the heartbeat publishes for the router's TTFT prediction (worker/rates.py); set
        # once the engine has started and its model and KV layout are known
        self.rates: WorkerRates | None = None
        self._blocks_per_seq = 0.0              # KV blocks a running sequence holds, at the last beat

    # ------------------------------------------------------------------ gauges
    def refresh(self, s: EngineStats, *, writes_in_flight: int = 0, held_blocks: int = 0) -> None:
        self._running.set(s.num_running)
        self._waiting.set(s.num_queued)
        self._waiting_for_slot.set(s.num_waiting_for_decode_slot)
        self._queued_tokens.set(s.queued_prefill_tokens)
        self._queue_age.set(s.oldest_queued_s)
        for state, n in zip(KV_STATES, (s.kv_blocks_total, s.kv_blocks_used, s.kv_blocks_reserved,
                                        s.kv_blocks_free, s.kv_blocks_cached, held_blocks)):
            self._kv_blocks[state].set(n)
        busy = s.kv_blocks_used + s.kv_blocks_reserved
        self._kv_usage.set(busy / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        self._rates["prefill"].set(s.prefill_tokens_per_s)
        self._rates["decode"].set(s.decode_tokens_per_s)
        self._writes.set(writes_in_flight)
        self._refresh_tenants(s.tenants)
        self._blocks_per_seq = (s.kv_blocks_used + s.kv_blocks_reserved) / max(1, s.num_running)

    def _refresh_tenants(self, tenants: Iterable[tuple[str, int, int]]) -> None:
        """Per-tenant gauges, summed under each tenant's bounded label; a label seen before and
        absent now reads 0 (its series stays: the label set is bounded)."""
        seqs: dict[str, int] = {}
        blocks: dict[str, int] = {}
        for tenant, n, b in tenants:
            label = self.tenant_labels.label(tenant)
            seqs[label] = seqs.get(label, 0) + n
            blocks[label] = blocks.get(label, 0) + b
        self._tenants_shown |= seqs.keys()
        m = self.metrics
        for label in self._tenants_shown:
            m.labels(m.tenant_sequences, label).set(seqs.get(label, 0))
            m.labels(m.tenant_kv_blocks, label).set(blocks.get(label, 0))

    # ------------------------------------------------------------------- steps
    def _shallow_pairs(self, step: StepStats) -> int | None:
        """The step's pairs had its prefill chunks started at position 0 (rates.fresh_pairs); its
        decodes' contexts from the KV they read. None when that is unknown."""
        kv_bytes = self.rates.kv_bytes_per_token
        if step.decode_tokens and not kv_bytes:
            return None
        context = step.kv_read_bytes // kv_bytes if kv_bytes else 0
        return fresh_pairs((n for _, n in step.prefill_chunks), context)

    def on_step(self, step: StepStats) -> None:
        """One engine step (on the asyncio loop): batch composition, busy time split by phase in
        proportion to the step's tokens, the scheduler's idle gap, prefix cache, preemptions."""
        p, d = step.prefill_tokens, step.decode_tokens
        if self.rates is not None:
            self.rates.on_step(p, d, step.attention_pairs, step.duration_s, step.gap_s,
                               self._shallow_pairs(step), prefill_by_class=step.prefill_by_class,
                               prompts_by_class=step.prompts_by_class)
        if p:
            self._iteration["prefill"].observe(p)
            self._tokens["prefill"].inc(p)
            if self._prefilling:
                self._chunk_events(step)
        if d:
            self._iteration["decode"].observe(d)
            self._tokens["decode"].inc(d)
        if p + d and step.duration_s > 0:
            self._busy["prefill"].inc(step.duration_s * p / (p + d))
            self._busy["decode"].inc(step.duration_s * d / (p + d))
        if step.gap_s > 0:
            self._gap.observe(step.gap_s)
        if step.kv_read_bytes:
            self._kv_read.inc(step.kv_read_bytes)
        if step.prefix_queries:
            self._prefix_queries.inc(step.prefix_queries)
        if step.prefix_hits:
            self._prefix_hits.inc(step.prefix_hits)
        if step.preemptions:
            self._preemptions.inc(step.preemptions)

    def _chunk_events(self, step: StepStats) -> None:
        for rid, tokens in step.prefill_chunks:
            span = self._prefilling.get(rid)
            if span is not None:
                span.add_event("chunk", {CHUNK_TOKENS: tokens})

    # ---------------------------------------------------------------- requests
    def ended(self, outcome: str) -> None:
        self._outcomes[outcome].inc()
        if outcome == "finished" and self.rates is not None:
            # the blocks it freed: a running sequence's mean share at the last beat (an estimate)
            self.rates.finished(round(self._blocks_per_seq))

    def abandoned(self, how: str) -> None:
        """A decode reservation made or asked for by a caller that had gone was undone."""
        self._abandoned[how].inc()

    def queued(self, queue_s: float | None) -> None:
        if queue_s is not None:
            self._queue_time.observe(queue_s)

    # ---------------------------------------------------------------------- KV
    def kv_moved(self, backend: str, direction: str, nbytes: int, seconds: float | None) -> None:
        m = self.metrics
        m.labels(m.kv_transfer_bytes, backend, direction).inc(nbytes)
        if direction == "sent" and self.rates is not None:
            self.rates.kv_written(nbytes, seconds)
        if seconds is not None:
            m.labels(m.kv_transfer_seconds, backend).observe(max(0.0, seconds))

    def expect_kv(self, backend: str) -> None:
        """This worker moves KV over `backend`: its KV series exist from the start, at zero (a
        counter born at its first increment hides that increment from rate())."""
        m = self.metrics
        direction = "sent" if self.role == "prefill" else "received"
        m.labels(m.kv_transfer_bytes, backend, direction)
        for reason in FAILURE_REASON_NAMES:
            m.labels(m.kv_transfer_failures, backend, reason)

    def kv_failed(self, backend: str, reason: str) -> None:
        m = self.metrics
        m.labels(m.kv_transfer_failures, backend, reason).inc()

    # ------------------------------------------------------------------- spans
    def start_span(self, name: str, parent: Context | None, request, model: str,
                   kind: SpanKind = SpanKind.INTERNAL) -> Span:
        """A request's span with the contract's attributes (tenant, class, replica, request id,
        model, GenAI request attributes); the no-op span when tracing is off. `request` is any of
        WorkRequest, PrefillRequest, ReserveRequest."""
        if not tracing.on():
            return INVALID_SPAN
        return self.span(name, parent, self.request_attributes(request, model), kind)

    @staticmethod
    def span(name: str, parent: Context | None, attributes: dict | None,
             kind: SpanKind = SpanKind.INTERNAL) -> Span:
        """A span with attributes built earlier (None: tracing was off then: the no-op span)."""
        if attributes is None or not tracing.on():
            return INVALID_SPAN
        return tracing.tracer.start_span(name, context=parent, kind=kind, attributes=attributes)

    def request_attributes(self, request, model: str) -> dict:
        p = request.params
        attrs = {tracing.REQUEST_ID: request.request_id, tracing.REPLICA: self.worker_id,
                 tracing.REQUEST_MODEL: model, tracing.PROVIDER: tracing.PROVIDER_NAME,
                 tracing.INPUT_TOKENS: len(request.prompt_token_ids),
                 tracing.MAX_TOKENS: p.max_tokens, tracing.TEMPERATURE: p.temperature,
                 tracing.TOP_P: p.top_p or 1.0, "kvfleet.role": self.role}
        if request.tenant:
            attrs[tracing.TENANT] = request.tenant
        if request.traffic_class:
            attrs[tracing.TRAFFIC_CLASS] = request.traffic_class
        return attrs

    def prefilling(self, rid: str, span: Span) -> None:
        """`span` gets a `chunk` event per prompt-computing step until `prefilled(rid)`."""
        if span.is_recording():
            self._prefilling[rid] = span

    def prefilled(self, rid: str) -> None:
        self._prefilling.pop(rid, None)


def child_context(span: Span) -> Context:
    return trace.set_span_in_context(span)


def end_span(span: Span, *, output_tokens: int | None = None, finish_reason: str | None = None,
             error: str | None = None) -> None:
    """End a request's span with what is known of its ending (a no-op span ignores all of it)."""
    if span.is_recording():
        if output_tokens is not None:
            span.set_attribute(tracing.OUTPUT_TOKENS, output_tokens)
        if finish_reason:
            span.set_attribute(tracing.FINISH_REASONS, [finish_reason])
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def first_token_timing(chunk: pb.TokenChunk, out) -> None:
    """The first chunk's engine times (TokenOutput.queue_s / prefill_s, on the output with
    the request's first token)."""
    if out.queue_s is not None:
        chunk.timing.queue_s = out.queue_s
    if out.prefill_s is not None:
        chunk.timing.prefill_s = out.prefill_s
