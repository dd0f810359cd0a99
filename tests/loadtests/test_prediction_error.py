"""The router's TTFT prediction is checked against what happened, and the error is exported: a
real disaggregated fleet (`kvfleet up`: gateway, router, prefill and decode workers, a real
redis-server) serves a handful of requests through the openai client and the load generator;
each response's `timing` carries the prediction and its relative error, the gateway's /metrics
counts it by class, and the load-test summary has its p50 and p90."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtests.arrivals import ArrivalProcess
from loadtests.local_fleet import FleetSetup, local_fleet
from loadtests.metrics import summarize
from loadtests.report import render_markdown
from loadtests.runner import RunConfig, run_workload
from loadtests.workload import TenantSpec, parse_workload

CHAT = TenantSpec("acme", "interactive", 1.0, ArrivalProcess("poisson", {"rate_rps": 4}))
REQUESTS = 3


@pytest.fixture(scope="module")
def fleet(redis_url, tiny_model_dir):
    # the simulated engine core: the prediction and its error are the router's and the gateway's,
    # whatever makes the tokens
    with local_fleet([CHAT], FleetSetup(mode="disagg", model=str(tiny_model_dir), engine="sim"),
                     redis_url=redis_url) as f:
        yield f


def abs_error_count(endpoint: str, cls: str) -> float:
    text = httpx.get(f"{endpoint}/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "kvfleet_ttft_prediction_abs_relative_error_count"
               and s.labels.get("traffic_class") == cls)


def test_each_response_says_how_far_off_its_predicted_ttft_was(fleet):
    client = openai.OpenAI(base_url=f"{fleet.endpoint}/v1", api_key=fleet.tenant_keys["acme"],
                           max_retries=0, timeout=60)
    before = abs_error_count(fleet.endpoint, "interactive")
    for i in range(REQUESTS):
        done = client.completions.create(model=client.models.list().data[0].id,
                                         prompt=f"tell me a story number {i}", max_tokens=4)
        timing = done.model_extra["timing"]
        assert timing["predicted_ttft_s"] > 0                 # a cold fleet is not predicted as 0
        error = timing["ttft_prediction_error"]
        actual = timing["ttft_s"]
        assert error == pytest.approx((timing["predicted_ttft_s"] - actual) / actual, rel=1e-3)
    assert abs_error_count(fleet.endpoint, "interactive") == before + REQUESTS


def test_the_load_test_summary_has_the_prediction_error_overall_and_by_class(fleet):
    spec = parse_workload({"name": "few", "duration_s": 3.0, "max_requests": 6,
                           "classes": {"interactive": {"slo": {"ttft_s": 5.0}, "prompt_tokens": 40,
                                                       "output_tokens": 4}},
                           "tenants": {"acme": {"class": "interactive",
                                                "arrival": {"process": "poisson", "rate_rps": 4}}}})
    run = asyncio.run(run_workload(spec, RunConfig(fleet.endpoint, tenant_keys=fleet.tenant_keys)))
    ok = sum(r.ok for r in run.records)
    assert ok >= 1
    summary = summarize(run)
    overall, chat = summary["prediction_error"], summary["classes"]["interactive"]["prediction_error"]
    assert overall == chat and overall["requests"] == ok
    assert 0 <= overall["p50"] <= overall["p90"]
    assert "## TTFT prediction error" in render_markdown(summary)
