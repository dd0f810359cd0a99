"""Prometheus metrics: every name the fleet exports, one class per kind of process.

Each instance owns its own `CollectorRegistry` (several gateways or workers may live in one test
process); the process serves that registry at `/metrics` (exposition.py). Names follow DESIGN
section 7: the three request histograms are the OpenTelemetry GenAI ones (`gen_ai.server.*`,
unit seconds, the conventions' bucket boundaries) as Prometheus spells them; the others are
`kvfleet_*` names shaped after vLLM's (`vllm:num_requests_running` -> `kvfleet_num_requests_running`;
docs/operations.md has the mapping). Tenant labels are bounded (labels.TenantLabels).

Dashboards and alert rules (services/telemetry/grafana, services/telemetry/prometheus) query
these names; tests/telemetry/test_prometheus.py evaluates every such query against a real
Prometheus scraping a real fleet, so a renamed metric fails there.
"""
from __future__ import annotations


from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from services.protocol import env

# OpenTelemetry GenAI semantic conventions: explicit bucket boundaries (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92)
# kvfleet's own
PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                 10.0, 30.0, 60.0)
ERROR_BUCKETS = (-10.0, -5.0, -2.5, -1.0, -0.5, -0.25, -0.1, -0.05, -0.01, 0.0, 0.01, 0.05, 0.1,
                 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TOKENS_PER_STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
GAP_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
BYTES_BUCKETS = tuple(float(4 ** k) * 1024 for k in range(1, 12))     # 4 KiB .. 4 GiB
REL_ERROR_BUCKETS = (-0.9, -0.75, -0.5, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)
ABS_REL_ERROR_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)

PHASES = ("queue", "prefill", "transfer", "decode")

# `KVFLEET_METRICS=off` turns recording off in a process (every metric below becomes a no-op and
# /metrics is empty): the "metrics off" side of `kvfleet bench telemetry`, and a way to rule the
# metrics out when chasing a latency. On by default.
ENV_SWITCH = env.METRICS.name


def recording() -> bool:
    return env.METRICS.get(default="on").strip().lower() not in ("off", "0", "false")


class _Noop:
    """Stands in for a metric (and any child of it) while recording is off."""

    def labels(self, *args, **kwargs) -> _Noop:
        return self

    def __getattr__(self, name):           # inc, dec, set, observe, time ...
        return _noop


def _noop(*args, **kwargs) -> None:
    return None


NOOP = _Noop()


class _Metrics:
    """Every metric assigned to an instance is kept only while recording is on; else NOOP (and
    nothing is registered)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        object.__setattr__(self, "recording", recording())
        self.registry = registry or CollectorRegistry()

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, MetricWrapperBase) and not self.recording:
            self.registry.unregister(value)
            value = NOOP
        object.__setattr__(self, name, value)


class GatewayMetrics(_Metrics):
    """What the gateway sees of each request: the client-facing latencies, outcomes, usage."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        r = self.registry
        self.ttft = Histogram(
            "gen_ai_server_time_to_first_token_seconds",
            "Time to first token (gen_ai.server.time_to_first_token): request received -> first "
            "token sent", ["gen_ai_request_model", "traffic_class"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(
            "gen_ai_server_time_per_output_token_seconds",
            "Time per output token after the first (gen_ai.server.time_per_output_token), one "
            "observation per request: (end - first token) / (output tokens - 1)",
            ["gen_ai_request_model", "traffic_class"], buckets=TPOT_BUCKETS, registry=r)
        self.itl = Histogram(
            "kvfleet_inter_token_latency_seconds",
            "Gap between two consecutive token chunks sent to a client (vllm:inter_token_latency_seconds)",
            ["traffic_class"], buckets=TPOT_BUCKETS, registry=r)
        self.duration = Histogram(
            "gen_ai_server_request_duration_seconds",
            "Request duration (gen_ai.server.request.duration): received -> last token or error",
            ["gen_ai_request_model", "traffic_class", "outcome"], buckets=DURATION_BUCKETS,
            registry=r)
        self.phase = Histogram(
            "kvfleet_request_phase_seconds",
            "Where a finished request's time went: queue (quota, admission, engine queue), "
            "prefill, transfer (KV), decode (vllm:request_{queue,prefill,decode}_time_seconds)",
            ["phase", "traffic_class"], buckets=PHASE_BUCKETS, registry=r)
        self.requests = Counter(
            "kvfleet_requests",
            "Requests by how they ended: finished, cancelled (client gone or Cancel), error "
            "(a fleet failure after admission), rejected (refused before any token)",
            ["traffic_class", "tenant", "outcome"], registry=r)
        self.slo = Counter(
            "kvfleet_request_slo",
            "Finished requests, by whether TTFT and ITL stayed inside their class targets "
            "(met=true|false); goodput = rate of met=true", ["traffic_class", "met"], registry=r)
        self.rejections = Counter(
            "kvfleet_rejections",
            "Requests refused before any token, by reason (a CallStatus reason or quota_*), "
            "overload stage and class", ["reason", "stage", "traffic_class"], registry=r)
        self.prompt_tokens = Counter(
            "kvfleet_prompt_tokens", "Prompt tokens of admitted requests (vllm:prompt_tokens_total)",
            ["tenant", "traffic_class"], registry=r)
        self.generation_tokens = Counter(
            "kvfleet_generation_tokens",
            "Tokens generated and sent, charged on every ending (vllm:generation_tokens_total)",
            ["tenant", "traffic_class"], registry=r)
        self.active = Gauge(
            "kvfleet_tenant_active_requests", "Requests streaming now, by tenant",
            ["tenant", "traffic_class"], registry=r)
        self.ttft_error = Histogram(
            "kvfleet_ttft_prediction_error_seconds",
            "Actual minus the router's predicted TTFT (positive: slower than predicted)",
            ["traffic_class"], buckets=ERROR_BUCKETS, registry=r)
        self.ttft_rel_error = Histogram(
            "kvfleet_ttft_prediction_relative_error",
            "(predicted - actual) / actual TTFT (negative: slower than predicted)",
            ["traffic_class"], buckets=REL_ERROR_BUCKETS, registry=r)
        self.ttft_abs_rel_error = Histogram(
            "kvfleet_ttft_prediction_abs_relative_error",
            "|predicted - actual| / actual TTFT", ["traffic_class"],
            buckets=ABS_REL_ERROR_BUCKETS, registry=r)


class RouterMetrics(_Metrics):
    """The router's decisions."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        r = self.registry
        self.admissions = Counter(
            "kvfleet_admissions",
            "Admit decisions: decision=admitted|rejected, reason (a CallStatus reason name, "
            "OK when admitted), stage", ["decision", "reason", "stage", "traffic_class"], registry=r)
        self.admit_seconds = Histogram(
            "kvfleet_admission_seconds", "Time to decide one Admit (worker list, Reserve, plan)",
            ["traffic_class"], buckets=PHASE_BUCKETS, registry=r)
        self.probes = Counter(
            "kvfleet_admission_probes", "Requests admitted as a probe: their best case broke the "
            "target only as priced by an idle worker's prior (services/router/admission.py)",
            ["traffic_class"], registry=r)
        self.predicted_ttft = Histogram(
            "kvfleet_predicted_ttft_seconds", "The router's TTFT prediction for admitted requests",
            ["traffic_class"], buckets=TTFT_BUCKETS, registry=r)
        self.stage = Gauge(
            "kvfleet_overload_stage", "The router's overload stage (0 = S0 normal .. 4 = S4 reject)",
            registry=r)
        self.workers = Gauge(
            "kvfleet_router_live_workers", "Live workers in the router's view of Redis, by role",
            ["role"], registry=r)
        self.placements = Counter(
            "kvfleet_placements", "Requests placed, by role and worker (routing balance)",
            ["role", "worker"], registry=r)
        self.records_rejected = Counter(
            "kvfleet_redis_records_rejected", "Registry records in Redis this router ignored: "
            "kind=worker|service, reason=unsigned|bad_signature|address (written around the "
            "fleet?)", ["kind", "reason"], registry=r)


class WorkerMetrics(_Metrics):
    """One worker (prefill, decode or mixed): its engine's load and steps, and its KV transfers.
    Every series carries the worker's role and id (`const labels`)."""

    def __init__(self, role: str, worker_id: str, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        r = self.registry
        self.role, self.worker_id = role, worker_id
        kw = dict(registry=r)

        def gauge(name, doc, labels=()):
            return Gauge(name, doc, ["role", "worker", *labels], **kw)

        def counter(name, doc, labels=()):
            return Counter(name, doc, ["role", "worker", *labels], **kw)

        def histogram(name, doc, buckets, labels=()):
            return Histogram(name, doc, ["role", "worker", *labels], buckets=buckets, **kw)

        # load (gauges, refreshed from the engine's stats)
        self.running = gauge("kvfleet_num_requests_running",
                             "Sequences in the engine's running batch (vllm:num_requests_running)")
        self.waiting = gauge("kvfleet_num_requests_waiting",
                             "Sequences queued in the engine (vllm:num_requests_waiting)")
        self.waiting_for_decode_slot = gauge(
            "kvfleet_num_requests_waiting_for_decode_slot",
            "Sequences decode protection holds out of the decode batch (ITL); decode role: "
            "their KV reservations kept")
        self.queued_prefill_tokens = gauge(
            "kvfleet_queued_prefill_tokens", "Prompt tokens not yet computed (the prompt backlog)")
        self.queue_age = gauge("kvfleet_queue_age_seconds",
                               "Age of the oldest request waiting in the engine's queue (0: none)")
        self.kv_blocks = gauge("kvfleet_kv_blocks",
                               "KV cache blocks by state: total, used, reserved, free, cached, held",
                               ["state"])
        self.kv_usage = gauge("kvfleet_kv_cache_usage_perc",
                              "Fraction of KV blocks used or reserved (vllm:kv_cache_usage_perc)")
        self.tenant_sequences = gauge("kvfleet_tenant_sequences",
                                      "Live sequences on this worker by tenant", ["tenant"])
        self.tenant_kv_blocks = gauge("kvfleet_tenant_kv_blocks",
                                      "KV blocks held or reserved on this worker by tenant",
                                      ["tenant"])
        self.rates = gauge("kvfleet_engine_tokens_per_second",
                           "Measured engine throughput (EMA) by phase", ["phase"])
        # steps
        self.iteration_tokens = histogram(
            "kvfleet_iteration_tokens", "Tokens per engine step by phase: batch composition "
            "(vllm:iteration_tokens_total)", TOKENS_PER_STEP_BUCKETS, ["phase"])
        self.busy = counter("kvfleet_busy_seconds",
                            "Engine step time by phase (a step's time split by its tokens); what "
                            "`kvfleet rebalance` reads", ["phase"])
        self.tokens = counter("kvfleet_tokens", "Tokens computed by phase", ["phase"])
        self.step_gap = histogram("kvfleet_scheduler_gap_seconds",
                                  "Idle time between two engine steps while work was waiting",
                                  GAP_BUCKETS)
        self.kv_read_bytes = counter("kvfleet_kv_read_bytes",
                                     "KV bytes attention read in decode steps (context x bytes/token)")
        self.prefix_queries = counter("kvfleet_prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache "
                                      "(vllm:prefix_cache_queries)")
        self.prefix_hits = counter("kvfleet_prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache (vllm:prefix_cache_hits)")
        self.queue_time = histogram("kvfleet_request_queue_seconds",
                                    "Engine queue wait of each request (vllm:request_queue_time_seconds)",
                                    PHASE_BUCKETS)
        self.preemptions = counter("kvfleet_preemptions", "Sequences preempted (vllm:num_preemptions)")
        self.requests = counter("kvfleet_worker_requests",
                                "Requests this worker ended, by outcome", ["outcome"])
        self.reservations_abandoned = counter(
            "kvfleet_reservations_abandoned",
            "Decode reservations whose caller had gone, undone here, by how: expired (the engine "
            "refused the Reserve past its deadline), late (reserved after the caller gave up: "
            "cancelled), unanswered (the Reserve call ended before its answer went out: ended)",
            ["how"])
        # KV transfer
        self.kv_transfer_bytes = counter("kvfleet_kv_transfer_bytes",
                                         "KV bytes shipped (prefill: sent) or landed (decode: received)",
                                         ["backend", "direction"])
        self.kv_transfer_seconds = histogram("kvfleet_kv_transfer_seconds",
                                             "One request's KV write, started -> over", PHASE_BUCKETS,
                                             ["backend"])
        self.kv_transfer_failures = counter("kvfleet_kv_transfer_failures",
                                            "KV writes that failed, by why", ["backend", "reason"])
        self.kv_writes_in_flight = gauge("kvfleet_kv_writes_in_flight",
                                         "KV writes not yet over (prefill role)")

    def labels(self, metric, *values):
        """`metric`'s child for this worker (and `values` of its own labels)."""
        return metric.labels(self.role, self.worker_id, *values)
