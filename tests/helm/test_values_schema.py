"""values.schema.json refuses bad values before anything renders: Helm checks it on every
install, upgrade and template, and names the key it refuses."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helm.chart import VALUE_SETS, helm, render_values, values_of

pytest.importorskip("helm_python")
MODES = ("disagg", "colocated", "hybrid")
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def refusal(values: dict) -> str:
    with pytest.raises(helm().HelmValuesError) as refused:
        helm().Chart.load(helm_chart()).validate_schema(values)
    return str(refused.value)


def helm_chart():
    from tests.helm.chart import CHART
    return CHART


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_shipped_value_set_is_accepted(value_set):
    helm().Chart.load(helm_chart()).validate_schema(values_of(value_set))


@SETTINGS
@given(pool=st.sampled_from(["prefill", "decode", "mixed"]), replicas=st.integers(max_value=-1))
def test_negative_replicas_are_refused_naming_the_pool(pool, replicas):
    assert f"/pools/{pool}/replicas" in refusal({"pools": {pool: {"replicas": replicas}}})


@SETTINGS
@given(mode=st.text(min_size=1, max_size=12).filter(lambda m: m not in MODES))
def test_an_unknown_mode_is_refused(mode):
    assert "/mode" in refusal({"mode": mode})


@pytest.mark.parametrize("values, key", [
    ({"router": {"replicas": 0}}, "/router/replicas"),
    ({"pools": {"decode": {"tensorParallel": 0}}}, "/pools/decode/tensorParallel"),
    ({"engine": {"device": "tpu"}}, "/engine/device"),
    ({"redis": {"bundled": False, "externalUrl": "http://redis:6379"}}, "/redis/externalUrl"),
    ({"ports": {"worker": 70000}}, "/ports/worker"),
    ({"apiKeys": {"keys": [{"key": "k", "tenant": "t"}]}}, "/apiKeys/keys/0"),
    ({"pools": {"decode": {"replicas": 1, "gpus": 8}}}, "/pools/decode"),
    ({"replicas": 3}, "replicas"),
    ({"ports": {"metrics": 0}}, "/ports/metrics"),
    ({"podMonitor": {"interval": "soon"}}, "/podMonitor/interval"),
    ({"grafana": {"dashboards": {"label": "not a label"}}}, "/grafana/dashboards/label"),
    ({"networkPolicy": {"metricsFrom": [{}]}}, "/networkPolicy/metricsFrom/0"),
])
def test_bad_values_are_refused_naming_the_key(values, key):
    assert key in refusal(values)


def test_a_refused_value_stops_the_render_too():
    with pytest.raises(helm().HelmValuesError, match="/mode"):
        render_values({**values_of("default"), "mode": "both"})


def test_a_gateway_without_api_keys_is_refused_unless_made_insecure_on_purpose():
    with pytest.raises(helm().HelmError, match="API keys"):
        render_values({})
    render_values({"gateway": {"insecure": True}})


def test_an_external_redis_needs_its_url():
    with pytest.raises(helm().HelmError, match="redis.externalUrl"):
        render_values({"gateway": {"insecure": True}, "redis": {"bundled": False}})


@pytest.mark.parametrize("rebalancer, key", [
    ({"mode": "sometimes"}, "/rebalancer/mode"),
    ({"schedule": "every ten minutes"}, "/rebalancer/schedule"),
    ({"windowS": 0}, "/rebalancer/windowS"),
    ({"args": ["rm -rf"]}, "/rebalancer/args/0"),
    ({"serviceAccount": "x"}, "/rebalancer"),
])
def test_bad_rebalancer_values_are_refused_naming_the_key(rebalancer, key):
    base = {"enabled": True, "mode": "apply", "schedule": "*/10 * * * *", "windowS": 60}
    assert key in refusal({"rebalancer": {**base, **rebalancer}})
