"""One trace per request across the fleet, as an operator's Jaeger would receive it.

A real fleet (`kvfleet up`: gateway, router, prefill worker, decode worker, Redis) exports over
OTLP/gRPC to a receiver on loopback that speaks the official TraceService. A client sends a
disaggregated request with its own W3C `traceparent`; the fleet's spans must all land in that
trace, from every process, linked parent to child, and the phases must account for the time the
client measured."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from services.telemetry import tracing
from services.telemetry.receiver import OtlpReceiver, Span
from tests.harness import up_fleet

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
# Long enough that the hops between phases are a small part of it, as they are for a real
# request; the phases themselves must still account for all the rest.
TOKENS = 480
# Time no phase covers: the hand-offs between the phases (the client's request and read, the
# router call, the prefill call, the decode stream's start, the response's end): 40-150 ms in
# all on this machine. Its tiny-model decode is fast (about 3 ms a token): the 160 tokens this
# story once asked for took under 0.5 s on a quiet box, and those hops alone passed 5% of it.
HOPS_S = 0.15

# The phases of a disaggregated request, in the order they happen, each the span of one process.
PHASES = ("gateway.auth", "gateway.validate", "gateway.quota", "router.admit", "prefill",
          "kv_transfer", "decode")
SERVICE_OF = {"gateway.request": "kvfleet-gateway", "gateway.auth": "kvfleet-gateway",
              "gateway.validate": "kvfleet-gateway", "gateway.quota": "kvfleet-gateway",
              "router.admit": "kvfleet-router", "router.reserve": "kvfleet-router",
              "prefill": "kvfleet-prefill", "kv_transfer": "kvfleet-prefill",
              "decode": "kvfleet-decode"}


@pytest.fixture
def traced_fleet(tiny_model_dir):
    with OtlpReceiver() as rx:
        with up_fleet(tiny_model_dir, mode="disagg", env=OtlpReceiver.env(rx.endpoint)) as up:
            yield rx, up.url, up.lines


def stream(client: httpx.Client, body: dict, headers: dict) -> tuple[float, httpx.Headers, list[dict]]:
    """One streamed completion on an open client: (client-measured seconds from send to [DONE],
    headers, events)."""
    events = []
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                break
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
        e2e = time.perf_counter() - t0
        return e2e, r.headers, events


def one_trace(spans: list[Span]) -> bool:
    names = {s.name for s in spans if s.trace_id == CLIENT_TRACE}
    return set(SERVICE_OF) <= names


def test_a_disaggregated_request_is_one_trace_with_every_phase_from_every_process(traced_fleet):
    rx, url, lines = traced_fleet
    with httpx.Client(base_url=url, timeout=60) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Tell me about paged attention", "max_tokens": TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        for _ in range(3):          # warm: the client's, the gateway's (Redis, gRPC) connections
            stream(client, body, {})
        e2e, headers, events = stream(client, body,
                                      {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})

    # the response names its trace, and its final chunk says where the time went
    assert headers[tracing.TRACE_HEADER] == CLIENT_TRACE
    timing = next(e["timing"] for e in reversed(events) if "timing" in e)
    assert 0 < timing["ttft_s"] <= timing["e2e_s"] <= e2e

    spans = [s for s in rx.wait_for(one_trace, timeout_s=20) if s.trace_id == CLIENT_TRACE]
    by_name = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)

    # every process took part, each span from the process that owns its phase
    for name, service in SERVICE_OF.items():
        assert {s.service for s in by_name[name]} == {service}, (name, by_name[name])
    assert {s.service for s in spans} >= {"kvfleet-gateway", "kvfleet-router",
                                          "kvfleet-prefill", "kvfleet-decode"}

    # linked parent to child: one root under the client's span; every other parent is in the trace
    ids = {s.span_id for s in spans}
    roots = [s for s in spans if s.parent_span_id not in ids]
    assert [(r.name, r.parent_span_id) for r in roots] == [("gateway.request", CLIENT_SPAN)]
    root = roots[0]
    parent = {s.span_id: s for s in spans}
    for s in spans:
        chain, seen = s, 0
        while chain is not root:           # every span reaches the root
            chain = parent[chain.parent_span_id]
            seen += 1
            assert seen < 20
    # the prefill runs under the gateway's request, the decode under the router's reservation
    assert parent[by_name["router.admit"][0].parent_span_id].service == "kvfleet-gateway"
    assert parent[by_name["decode"][0].parent_span_id].name == "router.reserve"
    assert parent[by_name["kv_transfer"][0].parent_span_id].service == "kvfleet-prefill"

    # the attributes an operator filters on
    for s in spans:
        assert s.attributes.get(tracing.REQUEST_ID), s
    decode = by_name["decode"][0]
    assert decode.attributes[tracing.OUTPUT_TOKENS] >= TOKENS - 1   # the first came from prefill
    assert decode.attributes[tracing.FINISH_REASONS] == ("length",)
    assert decode.attributes[tracing.TENANT] and decode.attributes[tracing.TRAFFIC_CLASS]
    assert by_name["kv_transfer"][0].attributes[tracing.KV_BYTES] > 0
    assert by_name["kv_transfer"][0].attributes[tracing.KV_BACKEND] == "tcp"
    assert any(name == "chunk" for name, _ in by_name["prefill"][0].events)
    assert root.attributes[tracing.REQUEST_MODEL] == model
    assert root.attributes[tracing.OUTPUT_TOKENS] == TOKENS

    # the phases add up to what the client measured, within 5% and the untraced hops between
    # them (HOPS_S)
    phases = sum(by_name[name][0].duration_s for name in PHASES)
    assert abs(phases - e2e) <= 0.05 * e2e + HOPS_S, \
        {name: round(by_name[name][0].duration_s, 4) for name in PHASES} | {"e2e": e2e}
