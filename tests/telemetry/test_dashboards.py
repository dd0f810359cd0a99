"""The Grafana dashboards: they are what boards.py renders, they load as Grafana JSON, they have
the rows the symptom table asks for, every panel queries Prometheus, and every metric a query
(dashboard or rule) names is one the services export (services/telemetry/metrics.py)."""
from __future__ import annotations

import pytest
import yaml

from services.telemetry import promql
from services.telemetry.grafana import boards

REQUIRED_ROWS = {
    "kvfleet-diagnosis": [
        "Overview: latency, goodput, errors",
        "High TTFT, healthy decode: prefill queue age and prompt backlog",
        "Slow ITL: decode batch size and KV read volume",
        "Low utilization, long queues: scheduler gaps and routing imbalance",
        "Admission failures: reserved blocks and context mix",
        "One tenant degrading others: per-tenant share of sequences and KV",
    ],
    "kvfleet-disaggregation": ["Phases: prefill -> transfer -> decode", "KV transfer",
                               "Prefill and decode pools"],
    "kvfleet-fairness": ["Requests and tokens by tenant", "Sequences and KV by tenant",
                         "Rejections by tenant"],
}


def test_the_json_files_are_what_boards_py_renders():
    for board in boards.BOARDS:
        path = boards.DASHBOARD_DIR / f"{board.uid}.json"
        assert path.read_text() == boards.text(board), \
            f"{path.name} is stale: run `python -m services.telemetry.grafana.boards`"
    assert set(promql.dashboards()) == set(REQUIRED_ROWS)


@pytest.mark.parametrize("uid", sorted(REQUIRED_ROWS))
def test_dashboard_is_grafana_json_with_its_rows_in_order(uid):
    board = promql.dashboards()[uid]
    assert board["uid"] == uid and board["title"] and board["schemaVersion"] >= 39
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == REQUIRED_ROWS[uid]
    assert board["templating"]["list"][0]["name"] == "DS_PROMETHEUS"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in promql.panels(board):
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["description"], panel["title"]
        assert panel["targets"], f"{panel['title']} has no PromQL target"
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"]["type"] == "prometheus"


def test_every_row_has_panels_under_it():
    for uid, board in promql.dashboards().items():
        kinds = [p["type"] for p in board["panels"]]
        for i, kind in enumerate(kinds):
            if kind == "row":
                assert i + 1 < len(kinds) and kinds[i + 1] != "row", \
                    f"{uid}: row {board['panels'][i]['title']!r} is empty"


def test_every_metric_named_in_a_query_is_exported_by_a_service():
    known = promql.exported_names() | promql.recorded_names() | promql.PROMETHEUS_OWN
    unknown = {(q.source, name) for q in promql.all_queries()
               for name in promql.metric_names(q.expr) if name not in known}
    assert not unknown, sorted(unknown)


def test_the_metric_name_check_can_fail():
    assert promql.metric_names('sum by (worker) (rate(kvfleet_no_such_total{role="x"}[1m]))') \
        == {"kvfleet_no_such_total"}
    assert "kvfleet_no_such_total" not in promql.exported_names()
    assert "kvfleet_requests_total" in promql.exported_names()
    assert "kvfleet_requests" not in promql.exported_names()     # a counter needs its _total


def test_every_recorded_series_a_dashboard_uses_is_a_rule():
    for q in promql.dashboard_queries():
        for name in promql.metric_names(q.expr):
            if ":" in name:
                assert name in promql.recorded_names(), (q.source, name)


def test_the_provisioning_names_the_datasource_the_dashboards_default_to():
    provisioning = boards.DASHBOARD_DIR.parent / "provisioning"
    sources = yaml.safe_load((provisioning / "datasources.yaml").read_text())["datasources"]
    assert [s["uid"] for s in sources if s["type"] == "prometheus"] == ["prometheus"]
    providers = yaml.safe_load((provisioning / "dashboards.yaml").read_text())["providers"]
    assert providers and providers[0]["type"] == "file"
    for board in promql.dashboards().values():
        assert board["templating"]["list"][0]["current"]["value"] == "prometheus"


def test_every_metric_the_services_export_is_on_some_dashboard():
    def family(name: str) -> str:
        for suffix in ("_total", "_bucket", "_sum", "_count"):
            name = name.removesuffix(suffix)
        return name
    shown = {family(n) for q in promql.dashboard_queries() for n in promql.metric_names(q.expr)}
    unseen = {family(n) for n in promql.exported_names()} - shown
    assert not unseen, f"exported but on no dashboard: {sorted(unseen)}"
