"""The alert rules as promtool sees them: they parse, their unit tests (a firing and a quiet case
per alert, services/telemetry/prometheus/alerts_test.yml) pass, and every alert tells an operator
how bad it is, what happened and where the runbook is."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from services.telemetry import promql

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (`make` installs Debian's prometheus)")
OPERATIONS = Path(__file__).parents[2] / "docs" / "operations.md"


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=promql.PROMETHEUS_DIR, capture_output=True,
                          text=True, timeout=120)


@needs_promtool
def test_promtool_accepts_the_rules_and_the_config():
    rules = promtool("check", "rules", "alerts.yml")
    assert rules.returncode == 0, rules.stdout + rules.stderr
    config = promtool("check", "config", "--syntax-only", "prometheus.yml")
    assert config.returncode == 0, config.stdout + config.stderr


@needs_promtool
def test_every_alert_fires_and_stays_quiet_as_its_unit_tests_say():
    out = promtool("test", "rules", "alerts_test.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def alerts() -> list[dict]:
    return [rule for rule in promql.rules() if "alert" in rule]


def test_each_alert_has_a_firing_and_a_quiet_case():
    tests = yaml.safe_load((promql.PROMETHEUS_DIR / "alerts_test.yml").read_text())["tests"]
    cases = [case for t in tests for case in t.get("alert_rule_test", [])]
    for alert in alerts():
        mine = [case for case in cases if case["alertname"] == alert["alert"]]
        assert any(case["exp_alerts"] for case in mine), f"{alert['alert']}: no firing case"
        assert any(not case["exp_alerts"] for case in mine), f"{alert['alert']}: no quiet case"


def test_each_alert_has_a_severity_a_summary_a_description_and_a_runbook_section():
    headings = {re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
                for line in OPERATIONS.read_text().splitlines() if line.startswith("#")}
    for alert in alerts():
        name = alert["alert"]
        assert alert["labels"]["severity"] in {"page", "ticket", "warning"}, name
        assert alert["annotations"]["summary"] and alert["annotations"]["description"], name
        runbook = alert["annotations"]["runbook_url"]
        assert runbook == f"docs/operations.md#{name.lower()}", (name, runbook)
        assert name.lower() in headings, f"docs/operations.md has no section '### {name}'"


def test_alerts_are_comparisons_whose_values_can_be_evaluated_alone():
    """The shape test_prometheus.py relies on: each alert is `<value> <cmp> <number>` terms."""
    for alert in alerts():
        values = promql.operands(alert["expr"])
        assert values and all(values), alert["alert"]
    assert promql.operands("a > 0 and on (role) b == 0") == ["a", "b"]
    assert promql.operands('min by (role) (x{r="a>b"}) < 1 unless max(y) == 0') == \
        ['min by (role) (x{r="a>b"})', "max(y)"]
    assert promql.operands('x{r="a and b"} > 0') == ['x{r="a and b"}']
    with pytest.raises(ValueError, match="not `<value> <comparison> <number>`"):
        promql.operands("rate(x[5m]) > rate(y[5m])")
