"""What the gateway measures of each request: its span, its per-request timing, its metrics.

One `RequestTelemetry` per generation request, made when the request is received (before the
API key is read), lives until the request ends, however it ends:

  received --auth, validate, quota (child spans)--> identified (tenant, class known)
           --Router.Admit answered (FleetRun.admitted_at)--> admitted: the gateway's queue time
           --chunks arrive (`arrived`: the workers' RequestTiming is summed)
           --chunks are sent to the client (`sent`: TTFT, inter-token gaps, tokens)
           --> `end(outcome)`: one observation per request in every histogram, the span ended.

Per-request timing (the response's `timing` object; RequestTiming in services/telemetry):
queue_s = the gateway's own queue (received -> Admit answered: auth, validation, quota,
admission) + the engine queue the prefill (or mixed) worker reports; prefill_s, transfer_s and
decode_s as the workers report them; ttft_s = received -> first token sent; e2e_s = received ->
now (the final chunk). The phases are disjoint intervals inside [received, final chunk], so
queue + prefill + transfer + decode <= e2e and ttft <= e2e.
Once planned, `timing` has wait_queue_s: the part of queue_s the request spent in the router's wait
queue (Plan.queue_wait_s; 0 when it was admitted at its first try). Once admitted with a prediction, `timing` also has predicted_ttft_s (the gateway's own time until
the plan came, known then, plus the router's predicted_ttft_s) and, from the first token on,
ttft_prediction_error = (predicted - actual) / actual TTFT (negative: slower than predicted), which
the metrics (kvfleet_ttft_prediction_{relative,abs_relative}_error, by class) and the request
span (kvfleet.ttft_prediction_error) carry too.

Outcomes (kvfleet_requests_total): finished (its last chunk, stop or length, was sent);
cancelled (the client cancelled or went away); error (a failure after a token was sent, or
shutdown); rejected (refused before any token: bad input, quota, the router's refusal, a worker
that failed first). A rejection is counted by reason: the CallStatus reason name for the fleet's
refusals (its `stage` the OverloadStage name; always S0_NORMAL until overload stages exist),
quota_streams|quota_requests|quota_tokens|quota_too_large|quota_unavailable for the quotas
(stage "none"), else the error's code (invalid_request, invalid_api_key, ...; stage "none").

Cost: with tracing off no span is made (`span` is None); metric children are looked up once per
request (`_Children`), so a token costs two float subtractions and one histogram observation.
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterable, Iterator

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.engine.config import TrafficClass
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.telemetry import tracing
from services.telemetry.labels import TenantLabels
from services.telemetry.metrics import GatewayMetrics

TIMING_HEADER = "x-kvfleet-timing"   # the timing object as compact JSON (non-streamed, gRPC trailer)
NO_STAGE = "none"                    # the stage label of a refusal decided outside the router
UNKNOWN_CLASS = "none"               # the class label of a request refused before its key was read
OUTCOMES = ("finished", "cancelled", "error", "rejected")
TIMING_FIELDS = ("queue_s", "prefill_s", "transfer_s", "decode_s", "ttft_s", "e2e_s")


class GatewayTelemetry:
    """The gateway's metrics registry and bounded tenant labels (one per GatewayCore)."""

    def __init__(self, model: str, replica: str, quality_version: str = "",
                 tenants: Iterable[str] = (), metrics: GatewayMetrics | None = None) -> None:
        self.metrics = metrics or GatewayMetrics()
        self.tenants = TenantLabels(known=tenants)
        self.model = model
        self.replica = replica
        self.quality_version = quality_version

    @property
    def registry(self):
        return self.metrics.registry

    def start(self, operation: str, carrier: Iterable[tuple[str, str]] | None) -> RequestTelemetry:
        """A request was received; `carrier` holds its HTTP headers or gRPC metadata (a W3C
        `traceparent` in it is continued); `operation` is chat | text_completion."""
        return RequestTelemetry(self, operation, carrier)


class _Children:
    """The metric children of one (tenant, class): looked up once, not per token."""

    def __init__(self, m: GatewayMetrics, model: str, tenant: str, cls: str) -> None:
        self.ttft = m.ttft.labels(model, cls)
        self.tpot = m.tpot.labels(model, cls)
        self.itl = m.itl.labels(cls)
        self.active = m.active.labels(tenant, cls)
        self.ttft_error = m.ttft_error.labels(cls)
        self.ttft_rel_error = m.ttft_rel_error.labels(cls)
        self.ttft_abs_rel_error = m.ttft_abs_rel_error.labels(cls)


class RequestTelemetry:
    def __init__(self, tel: GatewayTelemetry, operation: str,
                 carrier: Iterable[tuple[str, str]] | None) -> None:
        self.tel = tel
        self.received = time.monotonic()
        self.span: trace.Span | None = None
        self.context = None                       # the span's context, for outgoing calls
        # what every gateway span of this request carries (more once the key is read: `named`)
        self._common: dict[str, str] = {}
        if tracing.on():
            self._common = {tracing.REQUEST_MODEL: tel.model, tracing.REPLICA: tel.replica,
                            tracing.QUALITY_VERSION: tel.quality_version}
            self.span = tracing.tracer.start_span(
                "gateway.request", context=tracing.from_metadata(carrier), kind=SpanKind.SERVER)
            self.context = trace.set_span_in_context(self.span)
        # the request span's attributes, set once when it ends (as the phase spans are made
        # then): the SDK's attribute checks stay off the way to the first token
        self._attrs: dict = {tracing.OPERATION: operation, tracing.PROVIDER: tracing.PROVIDER_NAME}
        self.tenant = ""                          # the bounded label, once the key is known
        self.cls: TrafficClass | None = None
        self._children: _Children | None = None
        self.admitted_at: float | None = None
        self.predicted_ttft_s = 0.0
        self.stage = NO_STAGE
        self.pool = ""                 # the pool that serves it, once the router planned it
        self.wait_queue_s: float | None = None   # in the router's wait queue (the plan says)
        self.quality_version = ""      # ... and the quality version of its worker
        self.first_at: float | None = None        # first token sent
        self.last_at: float | None = None         # last token sent
        self.gaps: list[float] = []               # between consecutive chunks sent
        self.tokens = 0                           # tokens sent to the client
        self.phases = [0.0, 0.0, 0.0, 0.0]        # the workers' queue, prefill, transfer, decode
        self.finish_reason = ""
        self.active = False                       # counted in kvfleet_tenant_active_requests
        self.ended = False
        # (name, start ns, end ns, error or None) of each gateway phase, made spans at the end
        self._phase_spans: list[tuple[str, int, int, str | None]] = []

    @property
    def trace_id(self) -> str | None:
        return tracing.trace_id(self.span) if self.span is not None else None

    # ----------------------------------------------------------------- spans
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A child span (gateway.auth, gateway.validate, gateway.quota) around a block; a
        GatewayError leaving it marks it failed. It carries the request's common attributes as
        known at the request's end. Nothing when tracing is off.

        Only the block's wall-clock bounds are taken here: the span itself is made when the
        request ends (`_end_span`, with those start and end times), so the SDK's cost of three
        spans is not on the way to the first token (docs/benchmarks.md, the cost of tracing)."""
        if self.span is None:
            yield
            return
        start, failed = time.time_ns(), None
        try:
            yield
        except Exception as e:
            failed = str(e)
            raise
        finally:
            self._phase_spans.append((name, start, time.time_ns(), failed))

    def named(self, request_id: str, tenant: str, traffic_class: str) -> None:
        """The key is read: the request's id, tenant and class, on every span from here on
        (and on the span of the block that learned them, if called inside `phase`)."""
        if self.span is not None:
            self._common.update({tracing.REQUEST_ID: request_id, tracing.TENANT: tenant,
                                 tracing.TRAFFIC_CLASS: traffic_class})
            self._attrs.update(self._common)

    # ----------------------------------------------------------------- steps
    def identify(self, request_id: str, response_id: str, tenant: str, cls: TrafficClass,
                 params: pb.SamplingParams, prompt_tokens: int) -> None:
        """The key is read and the request validated: its tenant, class and parameters."""
        self.tenant = self.tel.tenants.label(tenant)
        self.cls = cls
        self._children = _Children(self.tel.metrics, self.tel.model, self.tenant, cls.name)
        if self.span is not None:
            self._attrs.update({
                tracing.TENANT: tenant, tracing.TRAFFIC_CLASS: cls.name,
                tracing.REQUEST_ID: request_id, tracing.RESPONSE_ID: response_id,
                tracing.RESPONSE_MODEL: self.tel.model, tracing.MAX_TOKENS: params.max_tokens,
                tracing.TEMPERATURE: params.temperature,
                tracing.TOP_P: params.top_p or 1.0, tracing.INPUT_TOKENS: prompt_tokens})

    def opened(self) -> None:
        """Quota admitted: the request is active until it ends."""
        self._children.active.inc()
        self.active = True

    def admitted(self, plan: pb.Plan | None, at: float | None) -> None:
        """The router answered (its plan, or None when it refused)."""
        if self.admitted_at is not None or at is None:
            return
        self.admitted_at = at
        if plan is not None and plan.predicted_ttft_s > 0:
            # the router predicts from its Admit on; the time spent here before the plan came
            # (auth, validation, quota, admission) is known by now
            self.predicted_ttft_s = (at - self.received) + plan.predicted_ttft_s
        if plan is not None:
            self.pool = plan.pool or "primary"
            self.wait_queue_s = plan.queue_wait_s
            self.quality_version = plan.quality_version
            if self.span is not None and plan.quality_version:
                self._attrs[tracing.QUALITY_VERSION] = plan.quality_version
            self.stage = pb.OverloadStage.Name(plan.stage)
            if self.span is not None:
                self._attrs.update({tracing.STAGE: self.stage,
                                          tracing.PREDICTED_TTFT: plan.predicted_ttft_s,
                                          tracing.QUEUE_WAIT: at - self.received})

    def arrived(self, chunk: pb.TokenChunk) -> None:
        """A chunk came from a worker: its phase times are summed (RequestTiming contract)."""
        if chunk.HasField("timing"):
            t, p = chunk.timing, self.phases
            p[0] += t.queue_s
            p[1] += t.prefill_s
            p[2] += t.transfer_s
            p[3] += t.decode_s
        if chunk.finished:
            self.finish_reason = chunk.finish_reason

    def sent(self, tokens: int) -> None:
        """A chunk of `tokens` tokens was handed to the client's connection."""
        if not tokens:
            return
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
            ttft = now - self.received
            self._children.ttft.observe(ttft)
            if self.predicted_ttft_s > 0:
                self._children.ttft_error.observe(ttft - self.predicted_ttft_s)
                error = self.prediction_error()
                self._children.ttft_rel_error.observe(error)
                self._children.ttft_abs_rel_error.observe(abs(error))
                if self.span is not None:
                    self._attrs[tracing.PREDICTION_ERROR] = error
        else:
            gap = now - self.last_at
            self.gaps.append(gap)
            self._children.itl.observe(gap)
        self.last_at = now
        self.tokens += tokens

    # ----------------------------------------------------------------- timing
    def timing(self, now: float | None = None) -> dict[str, float | str]:
        """The response's `timing` object (module docstring), with the pool that served."""
        now = time.monotonic() if now is None else now
        own_queue = (self.admitted_at if self.admitted_at is not None else now) - self.received
        q, p, t, d = self.phases
        out = {"queue_s": own_queue + q, "prefill_s": p, "transfer_s": t, "decode_s": d,
               "ttft_s": (self.first_at if self.first_at is not None else now) - self.received,
               "e2e_s": now - self.received, "pool": self.pool}
        if self.wait_queue_s is not None:
            out["wait_queue_s"] = self.wait_queue_s
        if self.predicted_ttft_s > 0:
            out["predicted_ttft_s"] = self.predicted_ttft_s
            if self.first_at is not None:
                out["ttft_prediction_error"] = self.prediction_error()
        return out

    def prediction_error(self) -> float:
        """(predicted - actual) / actual TTFT, once the first token was sent."""
        actual = max(self.first_at - self.received, 1e-9)
        return (self.predicted_ttft_s - actual) / actual

    @staticmethod
    def timing_pb(t: dict[str, float | str]) -> pb.RequestTiming:
        return pb.RequestTiming(queue_s=t["queue_s"], prefill_s=t["prefill_s"],
                                transfer_s=t["transfer_s"], decode_s=t["decode_s"], pool=t["pool"])

    @staticmethod
    def timing_json(t: dict[str, float | str]) -> str:
        return json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in t.items()},
                          separators=(",", ":"))

    # ----------------------------------------------------------------- end
    def rejected(self, error) -> None:
        """Refused before any token (a GatewayError): counted, and the request ends."""
        self.end("rejected", 0, error)

    def end(self, outcome: str, prompt_tokens: int, error=None) -> None:
        """Once per request: every per-request metric, then the span ends."""
        if self.ended:
            return
        self.ended = True
        now = time.monotonic()
        m, cls = self.tel.metrics, self.cls.name if self.cls is not None else UNKNOWN_CLASS
        tenant = self.tenant or self.tel.tenants.label("")
        m.requests.labels(cls, tenant, outcome).inc()
        m.duration.labels(self.tel.model, cls, outcome).observe(now - self.received)
        if outcome == "rejected" and error is not None:
            m.rejections.labels(error.reason or error.code or "error",
                                error.stage or self.stage, cls).inc()
        if self.active:
            self._children.active.dec()
        if self._children is not None:
            if outcome != "rejected":
                m.prompt_tokens.labels(tenant, cls).inc(prompt_tokens)
            m.generation_tokens.labels(tenant, cls).inc(self.tokens)
        if outcome == "finished":
            self._finished(m, cls)
        if self.span is not None:
            self._end_span(outcome, prompt_tokens, error)

    def _finished(self, m: GatewayMetrics, cls: str) -> None:
        if self.tokens > 1:
            self._children.tpot.observe((self.last_at - self.first_at) / (self.tokens - 1))
        timing = self.timing(self.last_at)
        for name, value in zip(("queue", "prefill", "transfer", "decode"),
                               (timing["queue_s"], *self.phases[1:])):
            m.phase.labels(name, cls).observe(value)
        m.slo.labels(cls, "true" if self._slo_met(timing["ttft_s"]) else "false").inc()

    def _slo_met(self, ttft_s: float) -> bool:
        """TTFT within the class's target and the p99 of the request's gaps within its ITL one."""
        return ttft_s <= self.cls.ttft_target_s and p99(self.gaps) <= self.cls.itl_target_s

    def _end_span(self, outcome: str, prompt_tokens: int, error) -> None:
        span = self.span
        for name, start, end, failed in self._phase_spans:
            child = tracing.tracer.start_span(name, context=self.context, start_time=start,
                                              attributes=self._common)
            if failed is not None:
                child.set_status(Status(StatusCode.ERROR, failed))
            child.end(end_time=end)
        attrs = {**self._attrs, **self._common, tracing.OUTPUT_TOKENS: self.tokens,
                 "kvfleet.outcome": outcome}
        if prompt_tokens:
            attrs[tracing.INPUT_TOKENS] = prompt_tokens
        if self.finish_reason:
            attrs[tracing.FINISH_REASONS] = (self.finish_reason,)
        if error is not None and error.reason:
            attrs[tracing.REASON] = error.reason
        span.set_attributes(attrs)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error.message))
        elif outcome == "error":
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.end()


def p99(values: list[float]) -> float:
    """The nearest-rank 99th percentile (0 for none)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]
