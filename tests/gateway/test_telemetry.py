"""The gateway's telemetry, as a client and an operator see it:

  - /metrics (no key) after a few requests: TTFT and duration histograms by class, requests by
    outcome, a quota refusal among the rejections;
  - the per-request `timing` object in streamed and non-streamed responses, through the openai
    client, whose phases fit inside the request's end-to-end time;
  - with tracing on (an in-process gateway, its spans kept by an in-memory exporter), the trace id
    comes back in a header and the gateway's spans continue the client's `traceparent`;
  - the gateway registers itself in Redis with its metrics URL.
"""
from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest
from openai import OpenAI
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.waiting import wait_until
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.state.fleet_state import FleetState
from services.telemetry import tracing
from tests.gateway.gateway_helpers import KEYS, bearer, metric, openai_error, scrape
from tests.harness import InProcessGateway, start_gateway

TIMING = ("queue_s", "prefill_s", "transfer_s", "decode_s", "ttft_s", "e2e_s")
PREDICTION = ("predicted_ttft_s", "ttft_prediction_error")
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN}-01"


def openai_client(gateway, key: str = "acme") -> OpenAI:
    return OpenAI(base_url=f"http://{gateway.http}/v1", api_key=KEYS[key]["key"], max_retries=0)


def assert_consistent(timing: dict) -> None:
    """Every phase measured, none negative, and together inside the end-to-end time."""
    assert set(TIMING) | {"pool", "wait_queue_s"} <= set(timing) <= {
        *TIMING, "pool", "wait_queue_s", *PREDICTION}, timing
    assert timing["pool"] == "primary", timing
    assert 0 <= timing["wait_queue_s"] <= timing["queue_s"], timing     # part of the queue
    assert all(timing[k] >= 0 for k in TIMING), timing
    if "ttft_prediction_error" in timing:               # (predicted - actual) / actual
        assert timing["ttft_prediction_error"] > -1 and timing["predicted_ttft_s"] > 0
    phases = timing["queue_s"] + timing["prefill_s"] + timing["transfer_s"] + timing["decode_s"]
    assert phases <= timing["e2e_s"] and timing["ttft_s"] <= timing["e2e_s"], timing
    assert timing["queue_s"] > 0 and timing["e2e_s"] > 0


# ------------------------------------------------------------------------------ metrics
def test_metrics_show_latencies_by_class_outcomes_and_a_quota_refusal(gateway):
    before = scrape(gateway.http)
    client = openai_client(gateway)
    client.completions.create(model=gateway.model, prompt="one", max_tokens=4)
    for _ in client.completions.create(model=gateway.model, prompt="two", max_tokens=4,
                                       stream=True):
        pass
    with gateway.client("frugal") as c:           # 41 prompt tokens: over its 40 a minute
        refused = c.post("/v1/completions", json={"model": gateway.model, "prompt": [7] * 41})
    openai_error(refused, 429)

    after = scrape(gateway.http)

    def grew(name: str, **labels) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)
    ttft = "gen_ai_server_time_to_first_token_seconds_count"
    duration = "gen_ai_server_request_duration_seconds_count"
    assert grew(ttft, traffic_class="interactive", gen_ai_request_model=gateway.model) == 2
    assert grew(duration, traffic_class="interactive", outcome="finished") == 2
    assert grew("kvfleet_requests_total", tenant="acme", outcome="finished") == 2
    assert grew("kvfleet_generation_tokens_total", tenant="acme") == 8
    assert grew("kvfleet_prompt_tokens_total", tenant="acme") > 0
    assert grew("kvfleet_requests_total", tenant="frugal", outcome="rejected") == 1
    assert grew("kvfleet_rejections_total", reason="quota_too_large",
                traffic_class="interactive") == 1
    assert grew(duration, outcome="rejected") == 1
    # every finished request is judged against its class's targets, and its phases recorded
    assert grew("kvfleet_request_slo_total", traffic_class="interactive") == 2
    assert grew("kvfleet_request_phase_seconds_count", phase="queue") == 2
    assert metric(after, "kvfleet_tenant_active_requests", tenant="acme") == 0


# ------------------------------------------------------------------------------ timing
def test_a_non_streamed_response_carries_its_timing_in_the_body_and_a_header(gateway):
    raw = openai_client(gateway).completions.with_raw_response.create(
        model=gateway.model, prompt="time me", max_tokens=6)
    completion = raw.parse()                     # the openai client still parses the body
    assert completion.usage.completion_tokens >= 1
    timing = completion.model_extra["timing"]
    assert_consistent(timing)
    assert json.loads(raw.headers["x-kvfleet-timing"]).keys() == timing.keys()


def test_a_stream_carries_its_timing_in_the_final_and_the_usage_chunks(gateway):
    chunks = list(openai_client(gateway).chat.completions.create(
        model=gateway.model, messages=[{"role": "user", "content": "time me"}], max_tokens=6,
        stream=True, stream_options={"include_usage": True}))
    final = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    usage = chunks[-1]
    assert usage.usage is not None and not usage.choices
    assert_consistent(final.model_extra["timing"])
    assert usage.model_extra["timing"] == final.model_extra["timing"]
    # only the final chunk has it: the others stay as OpenAI shapes them
    assert all("timing" not in c.model_extra for c in chunks if c is not final and c is not usage)


def test_a_grpc_stream_ends_with_its_timing_in_the_last_chunk_and_the_trailer(gateway):
    with grpc.insecure_channel(gateway.grpc) as channel:
        call = pb_grpc.GatewayStub(channel).Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5, 6, 7]), params=pb.SamplingParams(max_tokens=5)),
            metadata=tuple((k.lower(), v) for k, v in bearer("acme").items()))
        chunks = list(call)
        trailer = dict(call.trailing_metadata())
    last = chunks[-1]
    assert last.finished and last.HasField("timing")
    assert not any(c.HasField("timing") for c in chunks[:-1])
    timing = json.loads(trailer["x-kvfleet-timing"])
    assert_consistent(timing)
    assert last.timing.queue_s == pytest.approx(timing["queue_s"], abs=1e-5)


# ------------------------------------------------------------------------------ registry
def test_the_gateway_registers_itself_with_its_metrics_url(gateway, fleet):
    async def gateways():
        async with FleetState(fleet.redis_url) as state:
            return await state.live_services("gateway")

    def records():
        return [r for r in asyncio.run(gateways()) if r.address == gateway.http]
    assert wait_until(lambda: len(records()) == 1, 5)
    (record,) = records()
    assert record.pid > 0 and record.service_id.startswith("gw-")
    assert record.metrics_url == f"http://{gateway.http}/metrics"
    assert httpx.get(record.metrics_url).status_code == 200


def test_a_gateway_that_stops_takes_its_record_out_of_redis(fleet, tiny_model_dir, configs):
    async def addresses():
        async with FleetState(fleet.redis_url) as state:
            return {r.address for r in await state.live_services("gateway")}
    second = start_gateway(fleet, str(tiny_model_dir), "gateway-2", "--config", configs[0],
                           "--api-keys", configs[1])
    assert wait_until(lambda: second.http in asyncio.run(addresses()), 5)   # its first beat
    fleet.launcher.stop("gateway-2")             # SIGTERM: a clean shutdown
    assert second.http not in asyncio.run(addresses())


# ------------------------------------------------------------------------------ traces


@pytest.fixture
def traced_gateway(in_memory_spans, fleet, tiny_model_dir, configs):
    with InProcessGateway(fleet, str(tiny_model_dir), *configs) as gw:
        yield gw, in_memory_spans


def spans_of(exporter: InMemorySpanExporter, trace_id: str) -> dict:
    return {s.name: s for s in exporter.get_finished_spans()
            if format(s.context.trace_id, "032x") == trace_id}


def test_a_traced_request_continues_the_clients_trace_and_names_it_in_the_response(traced_gateway):
    gw, exporter = traced_gateway
    with httpx.Client(base_url=f"http://{gw.http}", headers=bearer("acme"), timeout=30) as c:
        r = c.post("/v1/completions", headers={"traceparent": TRACEPARENT},
                   json={"model": gw.model, "prompt": "trace me", "max_tokens": 3,
                         "stream": True})
        assert r.status_code == 200
    assert r.headers["x-kvfleet-trace-id"] == TRACE_ID

    assert wait_until(lambda: "gateway.request" in spans_of(exporter, TRACE_ID), 5)
    spans = spans_of(exporter, TRACE_ID)
    request = spans["gateway.request"]
    assert format(request.parent.span_id, "016x") == PARENT_SPAN
    assert request.kind == trace.SpanKind.SERVER
    attrs = request.attributes
    for child in ("gateway.auth", "gateway.validate", "gateway.quota"):
        assert spans[child].parent.span_id == request.context.span_id
        # every span names the request, its tenant and class, and the gateway that served it
        assert spans[child].attributes[tracing.REQUEST_ID] == attrs[tracing.REQUEST_ID]
        assert spans[child].attributes[tracing.TENANT] == "acme"
        assert spans[child].attributes[tracing.REPLICA] == attrs[tracing.REPLICA]
    assert attrs[tracing.OPERATION] == "text_completion"
    assert attrs[tracing.TENANT] == "acme" and attrs[tracing.TRAFFIC_CLASS] == "interactive"
    assert attrs[tracing.OUTPUT_TOKENS] == 3 and attrs[tracing.MAX_TOKENS] == 3
    assert tuple(attrs[tracing.FINISH_REASONS]) == ("length",)
    assert attrs[tracing.RESPONSE_ID].startswith("cmpl-")
    # how far the router's TTFT prediction was off, as the response's timing says it
    assert attrs[tracing.PREDICTED_TTFT] > 0 and attrs[tracing.PREDICTION_ERROR] > -1


def test_a_refused_request_has_an_error_span_and_still_names_its_trace(traced_gateway):
    gw, exporter = traced_gateway
    with httpx.Client(base_url=f"http://{gw.http}", headers=bearer("frugal"), timeout=30) as c:
        refused = c.post("/v1/completions", json={"model": gw.model, "prompt": [7] * 41})
    openai_error(refused, 429)
    trace_id = refused.headers["x-kvfleet-trace-id"]
    assert wait_until(lambda: "gateway.request" in spans_of(exporter, trace_id), 5)
    spans = spans_of(exporter, trace_id)
    assert spans["gateway.quota"].status.status_code == trace.StatusCode.ERROR
    assert spans["gateway.request"].status.status_code == trace.StatusCode.ERROR
    assert spans["gateway.request"].attributes[tracing.REASON] == "quota_too_large"


def test_a_grpc_request_continues_the_trace_in_its_metadata(traced_gateway):
    gw, exporter = traced_gateway
    with grpc.insecure_channel(gw.grpc) as channel:
        call = pb_grpc.GatewayStub(channel).Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5, 6, 7]), params=pb.SamplingParams(max_tokens=2)),
            metadata=(("authorization", bearer("acme")["Authorization"]),
                      ("traceparent", TRACEPARENT)))
        assert sum(len(c.token_ids) for c in call) == 2
        assert dict(call.initial_metadata())["x-kvfleet-trace-id"] == TRACE_ID
    assert wait_until(lambda: "gateway.request" in spans_of(exporter, TRACE_ID), 5)
    assert format(spans_of(exporter, TRACE_ID)["gateway.request"].parent.span_id,
                  "016x") == PARENT_SPAN
