"""The Grafana dashboards, as code: `python -m services.telemetry.grafana.boards` writes
dashboards/*.json (tests/telemetry/test_dashboards.py checks that the files match this module).

Three boards, each a list of rows; every panel is a time series of PromQL targets:
  kvfleet-diagnosis       overview (latency quantiles by class, goodput, outcomes, rejections),
                          then one row per line of the symptom table (DESIGN section 7)
  kvfleet-disaggregation  prefill -> transfer -> decode: phase times, KV transfer GB/s, failures
  kvfleet-fairness        per tenant: requests, tokens, active requests, sequences, KV, rejections

Conventions the tests rely on: ranges are `[$__rate_interval]`; the only template variables are
the datasource (`DS_PROMETHEUS`), `traffic_class` and `tenant` (regex matchers, "All" = `.*`);
every metric name is one services/telemetry/metrics.py defines. docs/operations.md says what each
panel answers.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

DASHBOARD_DIR = Path(__file__).parent / "dashboards"
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
RI = "[$__rate_interval]"
CLS = 'traffic_class=~"$traffic_class"'
TEN = 'tenant=~"$tenant"'
WIDTH, HEIGHT, PER_LINE = 24, 8, 3


@dataclass(frozen=True)
class Panel:
    title: str
    description: str                       # the question the panel answers
    targets: tuple[tuple[str, str], ...]   # (PromQL, legend)
    unit: str = "short"
    stack: bool = False


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass
class Board:
    uid: str
    title: str
    description: str
    rows: tuple[Row, ...]
    variables: tuple[str, ...] = ("traffic_class",)
    tags: tuple[str, ...] = field(default=("kvfleet",))


def rate(metric: str, matchers: str = "") -> str:
    return f"rate({metric}{{{matchers}}}{RI})" if matchers else f"rate({metric}{RI})"


def sum_rate(by: str, metric: str, matchers: str = "") -> str:
    return f"sum by ({by}) ({rate(metric, matchers)})"


def quantile(q: float, histogram: str, by: str, matchers: str = "") -> str:
    """The q-quantile of a histogram's rate, per `by` (comma-separated labels)."""
    return (f"histogram_quantile({q}, sum by ({by}, le) "
            f"({rate(histogram + '_bucket', matchers)}))")


def mean(histogram: str, by: str, matchers: str = "") -> str:
    """Mean observation of a histogram over the range, per `by`."""
    return (f"sum by ({by}) ({rate(histogram + '_sum', matchers)}) / "
            f"sum by ({by}) ({rate(histogram + '_count', matchers)})")


def quantiles(histogram: str, by: str, matchers: str = "", qs=(0.5, 0.9, 0.99)):
    legend = "{{" + by.split(",")[0].strip() + "}}"
    return tuple((quantile(q, histogram, by, matchers), f"p{round(q * 100)} {legend}") for q in qs)


def share(metric: str, by: str) -> str:
    """Each `by` group's fraction of the fleet-wide sum of a gauge."""
    return f"sum by ({by}) ({metric}) / scalar(sum({metric}))"


# --- diagnosis board -----------------------------------------------------------------------------

TTFT = "gen_ai_server_time_to_first_token_seconds"
TPOT = "gen_ai_server_time_per_output_token_seconds"
ITL = "kvfleet_inter_token_latency_seconds"
DURATION = "gen_ai_server_request_duration_seconds"
PHASE = "kvfleet_request_phase_seconds"

OVERVIEW = Row("Overview: latency, goodput, errors", (
    Panel("TTFT by class", "Time to first token seen by clients (GenAI histogram), p50/p90/p99.",
          quantiles(TTFT, "traffic_class", CLS), "s"),
    Panel("Inter-token latency by class", "Gap between two token chunks sent to a client.",
          quantiles(ITL, "traffic_class", CLS), "s"),
    Panel("Time per output token by class", "Per request: (end - first token) / (tokens - 1).",
          quantiles(TPOT, "traffic_class", CLS, (0.5, 0.99)), "s"),
    Panel("Request duration by class", "Received -> last token or error.",
          quantiles(DURATION, "traffic_class", CLS, (0.5, 0.99)), "s"),
    Panel("Goodput (requests meeting their SLO)",
          "Finished requests per second whose TTFT and ITL stayed inside their class targets, "
          "and the fraction of finished requests that did.",
          ((sum_rate("traffic_class", "kvfleet_request_slo_total", CLS + ', met="true"'),
            "met/s {{traffic_class}}"),
           ("kvfleet:slo_miss:ratio_rate5m", "missed fraction (5m) {{traffic_class}}")), "short"),
    Panel("Requests by outcome", "finished, cancelled, error (a fleet failure after admission), "
          "rejected (refused before any token).",
          ((f"sum by (outcome) ({rate('kvfleet_requests_total', CLS)})", "{{outcome}}"),), "reqps",
          stack=True),
    Panel("Rejections by reason and stage", "Refused before any token: the gateway's reason "
          "(quota_*, a router or worker reason) and the overload stage (always S0 today).",
          ((f"sum by (reason, stage) ({rate('kvfleet_rejections_total', CLS)})",
            "{{reason}} {{stage}}"),), "reqps", stack=True),
    Panel("Router decisions", "Admit decisions of the routers by decision and reason.",
          ((f"sum by (decision, reason) ({rate('kvfleet_admissions_total', CLS)})",
            "{{decision}} {{reason}}"),), "reqps", stack=True),
    Panel("Admission probes", "Requests admitted as a probe of a cold worker: their best case "
          "missed the target only by the worker's unmeasured prior, on an idle worker, one at a "
          "time (docs/architecture.md, the router's decision).",
          ((f"sum by (traffic_class) ({rate('kvfleet_admission_probes_total', CLS)}) or "
            f"sum by (traffic_class) ({rate('kvfleet_admissions_total', CLS)}) * 0",
            "{{traffic_class}}"),), "reqps", stack=True),
    Panel("Gateway front door: refused", "Requests the gateways' front doors refused before "
          "reading the body, by reason: a tenant past its fair share (429) or every seat held "
          "(503) (docs/operations.md, the gateway's front door).",
          (("sum by (reason) (rate(kvfleet_gateway_shed_total[$__rate_interval])) or "
            "sum(kvfleet_gateway_in_progress) * 0", "{{reason}}"),), "reqps", stack=True),
    Panel("Gateway front door: in progress", "Generation requests the gateways hold now, by "
          "tenant (each process bounded by --max-in-progress).",
          (("sum by (tenant) (kvfleet_gateway_in_progress)", "{{tenant}}"),), "short",
          stack=True),
    Panel("Where request time goes", "Mean seconds per finished request in each phase: queue "
          "(quota, admission, engine queue), prefill, transfer (KV), decode.",
          ((mean(PHASE, "phase", CLS), "{{phase}}"),), "s", stack=True),
    Panel("TTFT prediction error", "Actual minus the router's predicted TTFT (positive: slower "
          "than predicted), p10/p50/p90.",
          quantiles("kvfleet_ttft_prediction_error_seconds", "traffic_class", CLS, (0.1, 0.5, 0.9)),
          "s"),
    Panel("Predicted vs actual TTFT", "p90 of the routers' TTFT prediction for admitted "
          "requests next to the p90 clients saw.",
          ((quantile(0.9, "kvfleet_predicted_ttft_seconds", "traffic_class", CLS),
            "predicted {{traffic_class}}"),
           (quantile(0.9, TTFT, "traffic_class", CLS), "actual {{traffic_class}}")), "s"),
    Panel("Live workers by role (router view)", "Workers with a live heartbeat in Redis, as the "
          "least-informed router sees them.",
          (("min by (role) (kvfleet_router_live_workers)", "{{role}}"),), "short"),
    Panel("Overload stage", "Highest overload stage of any router (0 = S0 normal; stages are not "
          "implemented yet, so this stays 0).",
          (("max(kvfleet_overload_stage)", "stage"),), "short"),
))

HIGH_TTFT = Row("High TTFT, healthy decode: prefill queue age and prompt backlog", (
    Panel("Oldest queued request", "Age of the oldest request waiting in each prefill (or mixed) "
          "engine: grows when prefill cannot keep up.",
          (('max by (worker) (kvfleet_queue_age_seconds{role=~"prefill|mixed"})', "{{worker}}"),),
          "s"),
    Panel("Prompt backlog", "Prompt tokens queued but not yet computed, per prefill worker.",
          (('sum by (worker) (kvfleet_queued_prefill_tokens{role=~"prefill|mixed"})',
            "{{worker}}"),), "short"),
    Panel("Waiting and running sequences", "Engine queue depth vs running batch per worker.",
          (("sum by (worker) (kvfleet_num_requests_waiting)", "waiting {{worker}}"),
           ("sum by (worker) (kvfleet_num_requests_running)", "running {{worker}}")), "short"),
    Panel("Engine queue wait", "Per-request wait in the engine queue, p50/p90 by role.",
          quantiles("kvfleet_request_queue_seconds", "role", qs=(0.5, 0.9)), "s"),
    Panel("Prefill throughput", "Prompt tokens computed per second, per worker.",
          ((sum_rate("worker", "kvfleet_tokens_total", 'phase="prefill"'),
            "{{worker}}"),), "short"),
    Panel("Queue vs prefill vs decode time", "p90 of each phase: high queue + prefill with a "
          "normal decode points at the prefill pool.",
          ((quantile(0.9, PHASE, "phase", CLS), "p90 {{phase}}"),), "s"),
    Panel("TTFT prediction error", "The router's predicted TTFT against the measured one, "
          "(predicted - actual) / actual: p50 of the signed error and p90 of its size, by class. "
          "Far off: admission decides on a wrong picture of the queue.",
          ((quantile(0.5, "kvfleet_ttft_prediction_relative_error", "traffic_class", CLS),
            "p50 {{traffic_class}}"),
           (quantile(0.9, "kvfleet_ttft_prediction_abs_relative_error", "traffic_class", CLS),
            "p90 |error| {{traffic_class}}")), "percentunit"),
))

SLOW_ITL = Row("Slow ITL: decode batch size and KV read volume", (
    Panel("ITL p90 by class", "The symptom, next to its causes below.",
          ((quantile(0.9, ITL, "traffic_class", CLS), "{{traffic_class}}"),), "s"),
    Panel("Decode batch size", "Decode tokens per engine step (sequences in the batch), p50/p90.",
          quantiles("kvfleet_iteration_tokens", "worker", 'phase="decode"', (0.5, 0.9)), "short"),
    Panel("Mean decode tokens per step", "Mean decode batch per worker.",
          ((mean("kvfleet_iteration_tokens", "worker", 'phase="decode"'), "{{worker}}"),),
          "short"),
    Panel("KV read volume", "Bytes attention reads per second in decode steps (context x "
          "bytes/token): long contexts make decode memory-bound.",
          ((f"sum by (worker) ({rate('kvfleet_kv_read_bytes_total')})", "{{worker}}"),), "Bps"),
    Panel("Prefill tokens in decode-serving steps", "Prompt tokens computed in the same steps as "
          "decode on mixed/decode workers: they stretch ITL.",
          (('sum by (worker) (rate(kvfleet_iteration_tokens_sum{phase="prefill", '
            f'role=~"decode|mixed"}}{RI}))', "{{worker}}"),), "short"),
    Panel("Decode busy fraction", "Seconds of decode work per second, per worker (1 = saturated).",
          ((sum_rate("worker", "kvfleet_busy_seconds_total", 'phase="decode"'),
            "{{worker}}"),), "percentunit"),
    Panel("Preemptions", "Sequences preempted per second (KV pressure in decode).",
          ((f"sum by (worker) ({rate('kvfleet_preemptions_total')})", "{{worker}}"),), "short"),
    Panel("Held out of the decode batch", "Sequences decode protection keeps waiting because the "
          "predicted step would pass their ITL target (decode: KV landed; mixed: queued).",
          (("sum by (worker) (kvfleet_num_requests_waiting_for_decode_slot)", "{{worker}}"),),
          "short"),
))

LOW_UTIL = Row("Low utilization, long queues: scheduler gaps and routing imbalance", (
    Panel("Scheduler gaps", "Idle time between engine steps while work waited, p50/p90.",
          quantiles("kvfleet_scheduler_gap_seconds", "worker", qs=(0.5, 0.9)), "s"),
    Panel("Idle-while-waiting fraction", "Seconds per second an engine sat idle with work queued.",
          ((f"sum by (worker) ({rate('kvfleet_scheduler_gap_seconds_sum')})", "{{worker}}"),),
          "percentunit"),
    Panel("Busy fraction by worker", "Engine step time per second (all phases).",
          ((f"sum by (role, worker) ({rate('kvfleet_busy_seconds_total')})",
            "{{role}} {{worker}}"),), "percentunit"),
    Panel("Placements by worker", "Requests the routers placed on each worker per second.",
          ((f"sum by (role, worker) ({rate('kvfleet_placements_total')})",
            "{{role}} {{worker}}"),), "reqps"),
    Panel("Routing imbalance", "Busiest worker's placement rate over the role's mean (1 = even).",
          ((f"max by (role) (sum by (role, worker) ({rate('kvfleet_placements_total')})) / "
            f"avg by (role) (sum by (role, worker) ({rate('kvfleet_placements_total')}))",
            "{{role}}"),), "short"),
    Panel("Admission time", "Time a router takes to decide one Admit, p50/p99.",
          quantiles("kvfleet_admission_seconds", "traffic_class", CLS, (0.5, 0.99)), "s"),
))

ADMISSION = Row("Admission failures: reserved blocks and context mix", (
    Panel("KV blocks by state", "Per worker: used, reserved (promised to in-flight transfers), "
          "free, total...",
          (("sum by (worker, state) (kvfleet_kv_blocks)", "{{worker}} {{state}}"),), "short"),
    Panel("KV cache usage", "Fraction of KV blocks used or reserved, per worker.",
          (("max by (worker) (kvfleet_kv_cache_usage_perc)", "{{worker}}"),), "percentunit"),
    Panel("Router refusals", "Admit decisions by reason: OVERLOADED means no decode replica "
          "could reserve the blocks.",
          ((f"sum by (decision, reason, stage) ({rate('kvfleet_admissions_total', CLS)})",
            "{{decision}} {{reason}} {{stage}}"),), "reqps", stack=True),
    Panel("Prompt tokens by class", "Context mix: prompt tokens admitted per second by class.",
          ((f"sum by (traffic_class) ({rate('kvfleet_prompt_tokens_total', CLS)})",
            "{{traffic_class}}"),), "short", stack=True),
    Panel("Prefill tokens per step", "Prompt tokens per engine step, p50/p90 (long prompts, big "
          "chunks).",
          quantiles("kvfleet_iteration_tokens", "role", 'phase="prefill"', (0.5, 0.9)), "short"),
    Panel("Prefix cache hit rate", "Prompt tokens found in the prefix cache / looked up.",
          ((f"sum by (worker) ({rate('kvfleet_prefix_cache_hits_total')}) / "
            f"sum by (worker) ({rate('kvfleet_prefix_cache_queries_total')})", "{{worker}}"),),
          "percentunit"),
))

NOISY_TENANT = Row("One tenant degrading others: per-tenant share of sequences and KV", (
    Panel("Share of live sequences by tenant", "Each tenant's fraction of the sequences on all "
          "workers.", ((share("kvfleet_tenant_sequences", "tenant"), "{{tenant}}"),),
          "percentunit", stack=True),
    Panel("Share of KV blocks by tenant", "Each tenant's fraction of the KV blocks held or "
          "reserved on all workers.",
          ((share("kvfleet_tenant_kv_blocks", "tenant"), "{{tenant}}"),),
          "percentunit", stack=True),
    Panel("Active requests by tenant", "Requests streaming now, per tenant.",
          (("sum by (tenant) (kvfleet_tenant_active_requests)", "{{tenant}}"),), "short",
          stack=True),
    Panel("Generated tokens by tenant", "Tokens per second sent to each tenant.",
          ((f"sum by (tenant) ({rate('kvfleet_generation_tokens_total')})", "{{tenant}}"),),
          "short", stack=True),
    Panel("TTFT p90 by class", "The victims: a class whose TTFT rises with one tenant's share.",
          ((quantile(0.9, TTFT, "traffic_class", CLS), "{{traffic_class}}"),), "s"),
))

DIAGNOSIS = Board("kvfleet-diagnosis", "kvfleet: diagnosis",
                  "Symptom -> cause, one row per line of the symptom table (docs/operations.md).",
                  (OVERVIEW, HIGH_TTFT, SLOW_ITL, LOW_UTIL, ADMISSION, NOISY_TENANT))

# --- disaggregation board ------------------------------------------------------------------------

DISAGG = Board("kvfleet-disaggregation", "kvfleet: disaggregation",
               "Prefill -> KV transfer -> decode: where a disaggregated request's time goes.", (
    Row("Phases: prefill -> transfer -> decode", (
        Panel("Mean time per phase", "Mean seconds per finished request in each phase.",
              ((mean(PHASE, "phase", CLS), "{{phase}}"),), "s", stack=True),
        Panel("Phase p90", "p90 seconds per phase.",
              ((quantile(0.9, PHASE, "phase", CLS), "{{phase}}"),), "s"),
        Panel("TTFT vs transfer", "Client TTFT p90 next to the KV transfer p90 (transfer is "
              "on the TTFT path of a disaggregated request).",
              ((quantile(0.9, TTFT, "traffic_class", CLS), "TTFT {{traffic_class}}"),
               (quantile(0.9, PHASE, "phase", 'phase="transfer"'), "transfer")), "s"),
    )),
    Row("KV transfer", (
        Panel("Transfer GB/s", "KV bytes shipped (prefill: sent) and landed (decode: received) "
              "per second, in GB/s.",
              ((f"sum by (role, direction, backend) ({rate('kvfleet_kv_transfer_bytes_total')}) "
                "/ 1e9", "{{role}} {{direction}} {{backend}}"),), "short"),
        Panel("Transfer duration", "One request's KV write, started -> over, p50/p99 by backend.",
              quantiles("kvfleet_kv_transfer_seconds", "backend", qs=(0.5, 0.99)), "s"),
        Panel("Mean bytes per transfer", "KV bytes per request's write.",
              ((f"sum by (worker) ({rate('kvfleet_kv_transfer_bytes_total')}) / "
                f"sum by (worker) ({rate('kvfleet_kv_transfer_seconds_count')})", "{{worker}}"),),
              "bytes"),
        Panel("Writes in flight", "KV writes started and not over, per prefill worker.",
              (("sum by (worker) (kvfleet_kv_writes_in_flight)", "{{worker}}"),), "short"),
        Panel("Transfer failures", "Failed KV writes per second by backend and reason (0 where "
              "a worker shipped KV and none failed).",
              ((f"sum by (backend, reason) ({rate('kvfleet_kv_transfer_failures_total')}) or "
                f"sum by (backend) ({rate('kvfleet_kv_transfer_bytes_total')}) * 0",
                "{{backend}} {{reason}}"),), "short"),
        Panel("Abandoned reservations", "Decode reservations undone per second because the "
              "Reserve's caller (the router, after reserve_s) had gone, by how: expired (the "
              "engine reached it past its deadline), late (reserved, then cancelled), "
              "unanswered. A steady rate: decode engines answer slower than reserve_s.",
              ((f"sum by (how) ({rate('kvfleet_reservations_abandoned_total')})",
                "{{how}}"),), "short"),
        Panel("Rejected registry records", "Worker and service records in Redis the routers "
              "ignored per second, by kind and reason (unsigned, bad signature, an address "
              "outside the allowed networks). Anything above 0: someone other than the fleet "
              "writes to its Redis.",
              ((f"sum by (kind, reason) ({rate('kvfleet_redis_records_rejected_total')}) or "
                f"sum({rate('kvfleet_admissions_total')}) * 0",
                "{{kind}} {{reason}}"),), "short"),
    )),
    Row("Prefill and decode pools", (
        Panel("Busy fraction by role", "Mean engine busy seconds per second over a role's workers.",
              ((f"sum by (role) ({rate('kvfleet_busy_seconds_total')}) / "
                "count by (role) (kvfleet_kv_cache_usage_perc)", "{{role}}"),), "percentunit"),
        Panel("Tokens per second by role and phase", "Tokens computed per second.",
              ((f"sum by (role, phase) ({rate('kvfleet_tokens_total')})", "{{role}} {{phase}}"),),
              "short"),
        Panel("Measured engine rates", "Each worker's EMA of tokens per second (what the router "
              "predicts TTFT from).",
              (("sum by (worker, phase) (kvfleet_engine_tokens_per_second)",
                "{{worker}} {{phase}}"),), "short"),
        Panel("Worker request outcomes", "How requests ended on each role's workers: "
              "handed_off (prefill: first token sent, KV written), finished, cancelled, "
              "rejected, invalid, error.",
              ((f"sum by (role, outcome) ({rate('kvfleet_worker_requests_total')})",
                "{{role}} {{outcome}}"),), "reqps", stack=True),
        Panel("Live workers by role", "Workers with a live heartbeat, as the routers see them.",
              (("min by (role) (kvfleet_router_live_workers)", "{{role}}"),), "short"),
    )),
), variables=("traffic_class",))

# --- fairness board ------------------------------------------------------------------------------

FAIRNESS = Board("kvfleet-fairness", "kvfleet: fairness",
                 "Per tenant: what each asks for, gets, holds and is refused.", (
    Row("Requests and tokens by tenant", (
        Panel("Requests by tenant and outcome", "Requests ended per second.",
              ((f"sum by (tenant, outcome) ({rate('kvfleet_requests_total', TEN)})",
                "{{tenant}} {{outcome}}"),), "reqps", stack=True),
        Panel("Prompt tokens by tenant", "Prompt tokens admitted per second.",
              ((f"sum by (tenant) ({rate('kvfleet_prompt_tokens_total', TEN)})", "{{tenant}}"),),
              "short", stack=True),
        Panel("Generated tokens by tenant", "Tokens generated and sent per second.",
              ((f"sum by (tenant) ({rate('kvfleet_generation_tokens_total', TEN)})",
                "{{tenant}}"),), "short", stack=True),
        Panel("Active requests by tenant", "Requests streaming now.",
              ((f"sum by (tenant) (kvfleet_tenant_active_requests{{{TEN}}})", "{{tenant}}"),),
              "short", stack=True),
    )),
    Row("Sequences and KV by tenant", (
        Panel("Live sequences by tenant", "Sequences on the workers, per tenant.",
              ((f"sum by (tenant) (kvfleet_tenant_sequences{{{TEN}}})", "{{tenant}}"),),
              "short", stack=True),
        Panel("KV blocks by tenant", "KV blocks held or reserved, per tenant.",
              ((f"sum by (tenant) (kvfleet_tenant_kv_blocks{{{TEN}}})", "{{tenant}}"),),
              "short", stack=True),
        Panel("Share of sequences", "Fraction of all live sequences.",
              ((share("kvfleet_tenant_sequences", "tenant"), "{{tenant}}"),), "percentunit"),
        Panel("Share of KV", "Fraction of all KV blocks held or reserved.",
              ((share("kvfleet_tenant_kv_blocks", "tenant"), "{{tenant}}"),), "percentunit"),
    )),
    Row("Rejections by tenant", (
        Panel("Rejected requests by tenant", "Requests refused before any token, per tenant.",
              ((sum_rate("tenant", "kvfleet_requests_total", TEN + ', outcome="rejected"'),
                "{{tenant}}"),), "reqps", stack=True),
        Panel("Rejections by reason", "Why: quota_* (the tenant's own limits) or the fleet's.",
              ((f"sum by (reason) ({rate('kvfleet_rejections_total')})", "{{reason}}"),),
              "reqps", stack=True),
    )),
), variables=("tenant",))

BOARDS = (DIAGNOSIS, DISAGG, FAIRNESS)

# --- Grafana JSON --------------------------------------------------------------------------------

VARIABLE_SOURCES = {  # variable -> (metric, label) its values come from
    "traffic_class": ("kvfleet_requests_total", "traffic_class"),
    "tenant": ("kvfleet_requests_total", "tenant"),
}


def _variable(name: str) -> dict:
    metric, label = VARIABLE_SOURCES[name]
    query = f"label_values({metric}, {label})"
    return {"name": name, "label": name, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": name}, "definition": query, "refresh": 2,
            "includeAll": True, "allValue": ".*", "multi": True,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1}


def _panel(panel: Panel, pid: int, x: int, y: int) -> dict:
    w = WIDTH // PER_LINE
    return {
        "id": pid, "type": "timeseries", "title": panel.title, "description": panel.description,
        "datasource": DS, "gridPos": {"h": HEIGHT, "w": w, "x": x * w, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit, "custom": {
            "stacking": {"mode": "normal" if panel.stack else "none", "group": "A"},
            "fillOpacity": 20 if panel.stack else 0}}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DS, "expr": expr,
                     "legendFormat": legend, "range": True}
                    for i, (expr, legend) in enumerate(panel.targets)],
    }


def render(board: Board) -> dict:
    panels, y, pid = [], 0, 1
    for row in board.rows:
        panels.append({"id": pid, "type": "row", "title": row.title, "collapsed": False,
                       "gridPos": {"h": 1, "w": WIDTH, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, panel in enumerate(row.panels):
            panels.append(_panel(panel, pid, i % PER_LINE, y + (i // PER_LINE) * HEIGHT))
            pid += 1
        y += -(-len(row.panels) // PER_LINE) * HEIGHT
    datasource = {"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource",
                  "query": "prometheus", "current": {"text": "Prometheus", "value": "prometheus"}}
    return {
        "uid": board.uid, "title": board.title, "description": board.description,
        "tags": list(board.tags), "timezone": "browser", "schemaVersion": 39, "version": 1,
        "editable": True, "graphTooltip": 1, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [datasource, *map(_variable, board.variables)]},
        "annotations": {"list": []}, "links": [], "panels": panels,
    }


def text(board: Board) -> str:
    return json.dumps(render(board), indent=2) + "\n"


def main() -> None:
    for board in BOARDS:
        path = DASHBOARD_DIR / f"{board.uid}.json"
        path.write_text(text(board), encoding="utf-8")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
