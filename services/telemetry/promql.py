"""Every PromQL expression the repo ships, taken out of the dashboards and the rules so that tests
can check them: by name against services/telemetry/metrics.py (test_dashboards.py) and by evaluation
against a real Prometheus scraping a real fleet (test_prometheus.py).

What counts as an expression:
  - each target of each dashboard panel, with its template variables filled in (`substitute`);
  - each dashboard variable `label_values(metric, label)`, as `group by (label) (metric)`;
  - each recording rule's expr;
  - each operand of each alert (`operands`): alerts.yml keeps its alerts in the shape
    `<value> <cmp> <number> [and|unless [on (...)] <value> <cmp> <number>]...`, and an operand is
    one `<value>` with its comparison taken off, which must return series even when the alert
    is quiet.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

HERE = Path(__file__).parent
DASHBOARD_DIR = HERE / "grafana" / "dashboards"
PROMETHEUS_DIR = HERE / "prometheus"
RULES_FILE = PROMETHEUS_DIR / "alerts.yml"

# What a dashboard's variables stand for when an expression is evaluated outside Grafana.
VARIABLE_VALUES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m",
                   "$traffic_class": ".*", "$tenant": ".*"}
PROMETHEUS_OWN = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


@dataclass(frozen=True)
class Query:
    source: str      # where it comes from: "kvfleet-diagnosis / TTFT by class / A"
    expr: str


def dashboards() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text(encoding="utf-8"))
            for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def rules() -> list[dict]:
    data = yaml.safe_load(RULES_FILE.read_text(encoding="utf-8"))
    return [rule for group in data["groups"] for rule in group["rules"]]


def substitute(expr: str) -> str:
    """`expr` with Grafana's variables replaced by values Prometheus accepts; an unknown
    variable is an error (a dashboard that uses one must say what it stands for here)."""
    for name in sorted(VARIABLE_VALUES, key=len, reverse=True):
        expr = expr.replace(name, VARIABLE_VALUES[name])
    if "$" in expr:
        raise ValueError(f"unknown template variable in {expr!r}")
    return expr


def panels(board: dict) -> list[dict]:
    return [p for p in board["panels"] if p.get("type") != "row"]


def dashboard_queries() -> list[Query]:
    out = []
    for uid, board in dashboards().items():
        for panel in panels(board):
            for target in panel.get("targets", []):
                out.append(Query(f"{uid} / {panel['title']} / {target['refId']}",
                                 substitute(target["expr"])))
        for var in board["templating"]["list"]:
            if var["type"] == "query":
                m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["query"]["query"])
                if not m:
                    raise ValueError(f"{uid}: variable {var['name']}: expected "
                                     f"label_values(metric, label), got {var['query']['query']!r}")
                out.append(Query(f"{uid} / variable {var['name']}",
                                 f"group by ({m[2]}) ({m[1]})"))
    return out


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_JOIN = re.compile(r"\s+(and|unless|or)\s+(?:(?:on|ignoring)\s*\([^)]*\)\s*)?")
_CMP = re.compile(r"^(?P<value>.*\S)\s*(?:>=|<=|==|!=|>|<)\s*(?:bool\s+)?"
                  r"(?P<number>[-+]?[0-9.]+(?:e[-+]?[0-9]+)?)$", re.S)


def _top_level_split(expr: str) -> list[str]:
    """`expr` cut at the set operators that are outside any parentheses/braces/brackets."""
    depth, start, parts, i = 0, 0, [], 0
    while i < len(expr):
        ch = expr[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == '"':                                  # skip the string, escapes and all
            i = _STRING.match(expr, i).end() - 1
        elif depth == 0:
            m = _JOIN.match(expr, i)
            if m:
                parts.append(expr[start:i])
                start = i = m.end()
                continue
        i += 1
    parts.append(expr[start:])
    return [p.strip() for p in parts]


def operands(expr: str) -> list[str]:
    """The values an alert compares: its expr cut at top-level and/unless/or, each part without
    its trailing `<cmp> <number>`. A part with no such comparison is an error (see the shape
    in the module docstring)."""
    out = []
    for part in _top_level_split(" ".join(expr.split())):
        m = _CMP.match(part)
        if not m:
            raise ValueError(f"alert term {part!r} is not `<value> <comparison> <number>`")
        out.append(m["value"].strip())
    return out


def rule_queries() -> list[Query]:
    out = []
    for rule in rules():
        if "record" in rule:
            out.append(Query(f"record {rule['record']}", " ".join(rule["expr"].split())))
        else:
            for i, value in enumerate(operands(rule["expr"])):
                out.append(Query(f"alert {rule['alert']} operand {i}", value))
    return out


def recorded_names() -> set[str]:
    return {rule["record"] for rule in rules() if "record" in rule}


def all_queries() -> list[Query]:
    return dashboard_queries() + rule_queries()


# --- metric names ---------------------------------------------------------------------------------

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
             "unless", "offset", "inf", "nan", "e"}


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects: identifiers that are neither functions, keywords, label
    names (inside {} or a by/on/... clause), strings nor numbers."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)                        # strings
    s = re.sub(r"\{[^}]*\}", "", s)                                       # label matchers
    s = re.sub(r"\[[^\]]*\]", "", s)                                      # ranges
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", s)
    names = set()
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", s):
        if not m[2] and m[1].lower() not in _KEYWORDS:
            names.add(m[1])
    return names


def exported_names() -> set[str]:
    """Every series name the services export, as Prometheus stores them: counters with
    `_total`, histograms with `_bucket`, `_sum`, `_count`, gauges as they are."""
    from prometheus_client import CollectorRegistry

    from services.gateway.door import DoorMetrics      # the front door registers its own
    from services.telemetry.metrics import GatewayMetrics, RouterMetrics, WorkerMetrics

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    door = CollectorRegistry()
    DoorMetrics(door)
    names = set()
    for registry in (GatewayMetrics().registry, RouterMetrics().registry,
                     WorkerMetrics("prefill", "w").registry, door):
        for family in registry.collect():
            names.update(family.name + s for s in suffixes[family.type])
    return names
