"""The metric definitions every service shares: GenAI names and buckets, bounded tenant labels,
and the switch that turns recording off."""
from __future__ import annotations

from hypothesis import given, strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.telemetry import metrics
from services.telemetry.labels import OTHER, TenantLabels


def families(registry) -> dict:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}


def test_the_request_histograms_carry_the_genai_names_and_bucket_boundaries():
    g = metrics.GatewayMetrics()
    g.ttft.labels("m", "interactive").observe(0.03)
    g.tpot.labels("m", "interactive").observe(0.02)
    g.duration.labels("m", "interactive", "finished").observe(1.0)
    got = families(g.registry)
    ttft = got["gen_ai_server_time_to_first_token_seconds"]
    bounds = [float(s.labels["le"]) for s in ttft.samples if s.name.endswith("_bucket")]
    assert bounds[:-1] == list(metrics.TTFT_BUCKETS) and bounds[-1] == float("inf")
    assert "gen_ai_server_time_per_output_token_seconds" in got
    assert "gen_ai_server_request_duration_seconds" in got


def test_each_instance_has_its_own_registry_so_two_services_share_a_process():
    a, b = metrics.WorkerMetrics("prefill", "p1"), metrics.WorkerMetrics("decode", "d1")
    a.labels(a.tokens, "prefill").inc(5)
    text = generate_latest(b.registry).decode()
    assert 'worker="p1"' not in text


def test_with_recording_off_every_metric_is_a_noop_and_metrics_is_empty(monkeypatch):
    monkeypatch.setenv(metrics.ENV_SWITCH, "off")
    w = metrics.WorkerMetrics("decode", "d1")
    w.labels(w.kv_blocks, "used").set(3)
    w.labels(w.iteration_tokens, "decode").observe(8)
    assert generate_latest(w.registry) == b""


@given(st.lists(st.text(min_size=1, max_size=5), max_size=60), st.integers(0, 10))
def test_tenant_labels_never_exceed_their_limit_and_a_name_once_given_is_kept(tenants, limit):
    labels = TenantLabels(limit)
    first = {}
    for t in tenants:
        v = labels.label(t)
        assert v in (t, OTHER)
        first.setdefault(t, v)
        assert first[t] == v                    # stable: a series never moves
    assert len(labels.named) <= limit
    assert len({labels.label(t) for t in tenants} - {OTHER}) <= limit


def test_configured_tenants_are_named_before_the_ones_seen_first():
    labels = TenantLabels(2, known=["gold", "silver"])
    assert labels.label("walk-in") == OTHER
    assert labels.label("gold") == "gold"
