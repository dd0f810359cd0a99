"""Traces: one per request across the fleet (DESIGN section 7), OpenTelemetry SDK with OTLP export.

Off unless an OTLP endpoint is set by the standard variables (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`; `OTEL_SDK_DISABLED=true` turns it off again). Off, every
span below is the API's non-recording span: no allocation of attributes, nothing exported.

Sampling is parent-based: a request that arrives with a W3C `traceparent` keeps its caller's
decision; a new trace is sampled at `OTEL_TRACES_SAMPLER_ARG` (a ratio, default 1.0). A process
may set `OTEL_TRACES_SAMPLER` itself; the SDK then reads both variables as it documents.

Context crosses processes in gRPC metadata (the W3C `traceparent` / `tracestate` keys):
`outgoing()` is the metadata for a call made inside the current span, `incoming(context)` the
parent context a servicer starts its span under. Calls that carry one request's context: Admit,
Reserve, Prefill, Generate. The decode worker's span continues the context of the Reserve call
(its reservation), since its tokens travel on a long-lived DecodeStream shared by many requests.
"""
from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Iterable, Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from services.protocol import env

log = logging.getLogger(__name__)

PROPAGATOR = TraceContextTextMapPropagator()
TRACE_HEADER = "x-kvfleet-trace-id"     # the response header naming the request's trace id

# The tracer every kvfleet module uses (a proxy: it records once setup() installed a provider).
tracer = trace.get_tracer("kvfleet")

# ---------------------------------------------------------------------------- attribute names
# OpenTelemetry GenAI semantic conventions (gen_ai.*), then kvfleet's own.
OPERATION = "gen_ai.operation.name"             # chat | text_completion
PROVIDER = "gen_ai.provider.name"               # always "kvfleet"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_ID = "gen_ai.response.id"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
TOP_P = "gen_ai.request.top_p"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
TENANT = "kvfleet.tenant"
TRAFFIC_CLASS = "kvfleet.class"
REPLICA = "kvfleet.replica"                     # the worker / router / gateway id
QUALITY_VERSION = "kvfleet.quality_version"
REQUEST_ID = "kvfleet.request_id"
STAGE = "kvfleet.overload_stage"                # S0_NORMAL ... S4_REJECT
PREDICTED_TTFT = "kvfleet.predicted_ttft_s"
PREDICTION_ERROR = "kvfleet.ttft_prediction_error"   # (predicted - actual) / actual TTFT
QUEUE_WAIT = "kvfleet.queue_wait_s"
DECISION = "kvfleet.admission.decision"         # admitted | rejected
REASON = "kvfleet.reason"                       # a CallStatus reason name
KV_BYTES = "kvfleet.kv_transfer.bytes"
KV_BACKEND = "kvfleet.kv_transfer.backend"
KV_CHECKSUM = "kvfleet.kv_transfer.checksum"    # ok | mismatch | off

PROVIDER_NAME = "kvfleet"

_provider = None


def enabled_by_env(environ: Mapping[str, str] | None = None) -> bool:
    if env.OTEL_SDK_DISABLED.get(environ, "").strip().lower() == "true":
        return False
    return bool(env.OTEL_ENDPOINT.get(environ) or env.OTEL_TRACES_ENDPOINT.get(environ))


def setup(service: str, replica: str) -> bool:
    """Install the OTLP-exporting tracer provider for this process if the environment asks for
    one; True when traces are on. Idempotent. `service` names the process kind (gateway, router,
    prefill, decode, mixed), `replica` the instance (its id)."""
    global _provider
    if _provider is not None:
        return True
    if not enabled_by_env():
        return False
    # The SDK loads only when tracing is on: a process without an endpoint never imports it.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # noqa: PLC0415
    from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased  # noqa: PLC0415

    sampler = None            # the SDK's own choice from OTEL_TRACES_SAMPLER, when set
    if not env.OTEL_SAMPLER.get():
        ratio = float(env.OTEL_SAMPLER_ARG.get(default="1.0"))
        sampler = ParentBased(TraceIdRatioBased(ratio))
    resource = Resource.create({"service.name": f"kvfleet-{service}",
                                "service.namespace": "kvfleet",
                                "service.instance.id": replica})
    provider = TracerProvider(resource=resource, sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider = provider
    atexit.register(shutdown)
    log.info("tracing on: OTLP to %s", env.OTEL_TRACES_ENDPOINT.get() or env.OTEL_ENDPOINT.get())
    return True


def shutdown() -> None:
    """Export what is buffered and stop (a process that ends with os._exit calls this first)."""
    global _provider
    provider, _provider = _provider, None
    if provider is not None:
        try:
            provider.shutdown()
        except Exception:  # noqa: BLE001 - a collector that went away must not fail the exit
            log.warning("tracing: the last spans could not be exported", exc_info=True)


def on() -> bool:
    return _provider is not None


# ---------------------------------------------------------------------------- propagation
def outgoing(ctx: otel_context.Context | None = None) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata carrying the current (or `ctx`'s) span context; None when there is none to
    carry (tracing off, or no sampled span), so a call site can pass `metadata=outgoing()`."""
    if _provider is None:
        return None
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=ctx)
    return tuple(carrier.items()) or None


def from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context | None:
    """The parent context a W3C `traceparent` in this metadata (or HTTP headers) names; None
    when tracing is off or there is none."""
    if _provider is None or not metadata:
        return None
    carrier = {k.lower(): v for k, v in metadata if isinstance(v, str)}
    if "traceparent" not in carrier:
        return None
    return PROPAGATOR.extract(carrier)


def incoming(servicer_context) -> otel_context.Context | None:
    """The parent context of a gRPC call, from its invocation metadata."""
    if _provider is None:
        return None
    return from_metadata(servicer_context.invocation_metadata())


def trace_id(span: trace.Span | None = None) -> str | None:
    """The 32-hex-digit trace id of `span` (default: the current one); None when not recording."""
    span = span if span is not None else trace.get_current_span()
    sc = span.get_span_context()
    return format(sc.trace_id, "032x") if sc.is_valid else None


def traceparent(span: trace.Span) -> str | None:
    """The W3C traceparent of `span` (for a context carried inside a message, e.g. a HandOff)."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")
