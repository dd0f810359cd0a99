"""Tracing as a kvfleet process sets it up: off without an OTLP endpoint, on with one, exporting
over real OTLP/gRPC to a receiver on loopback; the context crosses a process boundary in gRPC
metadata, and sampling follows the caller's decision."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from services.telemetry import tracing
from services.telemetry.receiver import OtlpReceiver

# A child process: set up tracing as a service does, open a span under the parent named by argv[1]
# (a traceparent, or "-"), print the metadata it would send on, and export.
CHILD = textwrap.dedent("""
    import json, sys
    from opentelemetry import trace
    from services.telemetry import tracing
    on = tracing.setup("prefill", "prefill-test")
    parent = None if sys.argv[1] == "-" else tracing.from_metadata([("traceparent", sys.argv[1])])
    with tracing.tracer.start_as_current_span("prefill", context=parent) as span:
        span.set_attribute(tracing.TENANT, "acme")
        span.add_event("chunk", {"tokens": 512})
        md = tracing.outgoing()
        tid = tracing.trace_id()
    tracing.shutdown()
    print(json.dumps({"on": on, "metadata": dict(md or ()), "trace_id": tid}))
""")


def sampled_flag(traceparent: str) -> bool:
    """W3C trace flags: bit 0 is "sampled" (bit 1, "random trace id", may be set too)."""
    return bool(int(traceparent.rsplit("-", 1)[1], 16) & 1)


def run_child(env: dict[str, str], parent: str = "-") -> dict:
    full = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", CHILD, parent], env=full, capture_output=True,
                         text=True, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_without_an_endpoint_tracing_is_off_and_nothing_is_propagated():
    got = run_child({})
    assert got == {"on": False, "metadata": {}, "trace_id": None}


def test_a_span_continues_the_callers_trace_and_reaches_the_receiver():
    caller_trace = "0af7651916cd43dd8448eb211c80319c"
    traceparent = f"00-{caller_trace}-b7ad6b7169203331-01"
    with OtlpReceiver() as rx:
        got = run_child(OtlpReceiver.env(rx.endpoint), traceparent)
        spans = rx.wait_for(lambda s: any(x.name == "prefill" for x in s), timeout_s=10)
    span = next(s for s in spans if s.name == "prefill")
    assert got["on"] and got["trace_id"] == caller_trace
    assert span.trace_id == caller_trace and span.parent_span_id == "b7ad6b7169203331"
    assert span.service == "kvfleet-prefill" and span.instance == "prefill-test"
    assert span.attributes[tracing.TENANT] == "acme"
    assert span.events == (("chunk", {"tokens": 512}),)
    # what it sends on names its own span as the parent of the next hop
    assert got["metadata"]["traceparent"] == f"00-{caller_trace}-{span.span_id}-01"


def test_sampling_is_parent_based_a_zero_ratio_still_follows_a_sampled_caller():
    with OtlpReceiver() as rx:
        unsampled = run_child(OtlpReceiver.env(rx.endpoint, ratio=0.0))
        sampled = run_child(OtlpReceiver.env(rx.endpoint, ratio=0.0),
                            "00-1af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
        spans = rx.wait_for(lambda s: len(s) >= 1, timeout_s=10)
    assert not sampled_flag(unsampled["metadata"]["traceparent"])    # decided: not sampled
    assert sampled_flag(sampled["metadata"]["traceparent"])
    assert [s.trace_id for s in spans] == ["1af7651916cd43dd8448eb211c80319c"]


def test_metadata_without_a_traceparent_names_no_parent():
    assert tracing.from_metadata([("x-other", "1")]) is None
    assert tracing.from_metadata(None) is None
