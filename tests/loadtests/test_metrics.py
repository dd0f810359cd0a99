"""Metrics of a load-test run, checked against numbers worked out by hand.

Each story builds a small `RunResult` with chosen timings and compares `summarize` with the
values computed in the comments (numpy's "linear" percentile: rank h = (n - 1) * q / 100).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from loadtests.metrics import jain_index, max_min_fair, percentile, summarize
from loadtests.records import ClassSLO, RequestRecord, RunResult

approx = lambda v: pytest.approx(v, rel=1e-12, abs=1e-12)  # noqa: E731

INTERACTIVE = ClassSLO("interactive", ttft_s=0.5, itl_s=0.1)
BATCH = ClassSLO("batch", ttft_s=5.0, itl_s=None)


def ok(index: int, ttft: float, gaps: list[float], e2e: float, *, cls: str = "interactive",
       tenant: str = "a", send: float = 0.0, tokens: int | None = None,
       max_tokens: int = 16) -> RequestRecord:
    """A completed request: one token event at TTFT, then one per gap."""
    return RequestRecord(index=index, traffic_class=cls, tenant=tenant, scheduled_s=send,
                         send_s=send, max_tokens=max_tokens, ttft_s=ttft, itl_s=gaps, e2e_s=e2e,
                         output_tokens=len(gaps) + 1 if tokens is None else tokens, status=200,
                         finish_reason="length")


def failed(index: int, status: int, error: str, *, cls: str = "interactive", tenant: str = "a",
           retry_after: float | None = None, max_tokens: int = 16, **kw) -> RequestRecord:
    return RequestRecord(index=index, traffic_class=cls, tenant=tenant, scheduled_s=0.0,
                         send_s=0.0, status=status, error=error, retry_after_s=retry_after,
                         max_tokens=max_tokens, **kw)


def run_of(records: list[RequestRecord], *, classes=(INTERACTIVE, BATCH), weights=None,
           duration: float = 10.0) -> RunResult:
    return RunResult(meta={"workload": "t", "duration_s": duration},
                     classes={c.name: c for c in classes},
                     tenant_weights=weights or {}, records=records)


def mixed_run() -> RunResult:
    """Nine interactive requests (TTFT <= 0.5 s, p99 gap <= 0.1 s) and two batch ones (TTFT
    <= 5 s, no ITL target), over a 10 s run."""
    return run_of([
        ok(0, 0.2, [0.05, 0.05, 0.05], 1.0),   # met
        ok(1, 0.5, [0.1, 0.1], 2.0),           # exactly at both thresholds: met
        ok(2, 0.6, [0.05], 3.0),               # TTFT miss, ITL met
        ok(3, 0.3, [0.05, 0.3], 4.0),          # own p99 gap 0.05 + 0.99 * 0.25 = 0.2975: ITL miss
        ok(4, 0.4, [], 5.0),                   # one token, no gaps: ITL met trivially -> met
        failed(5, 429, "rate_limited", retry_after=2.0),
        failed(6, 503, "overloaded", retry_after=4.0),
        failed(7, 0, "timeout"),
        # a stream that broke after 5 tokens: not ok, its gap is not in the ITL pool,
        # but its tokens were received
        failed(8, 200, "stream_error", ttft_s=0.1, itl_s=[0.9], output_tokens=5),
        ok(9, 3.0, [1.0, 2.0], 6.0, cls="batch"),   # no ITL target: met
        ok(10, 6.0, [], 7.0, cls="batch"),          # TTFT miss
    ])


def test_percentile_interpolates_linearly_between_closest_ranks_like_numpy():
    """[1, 2, 3, 4]: p50 sits halfway between 2 and 3; p95 is at rank 2.85, i.e. 3 + 0.85."""
    assert percentile([4, 1, 3, 2], 50) == approx(2.5)
    assert percentile([4, 1, 3, 2], 95) == approx(3.85)
    assert percentile([4, 1, 3, 2], 0) == 1.0 and percentile([4, 1, 3, 2], 100) == 4.0
    assert percentile([7.5], 99) == 7.5
    assert percentile([], 50) is None
    values = list(np.random.default_rng(0).exponential(size=101))
    for q in (1, 50, 95, 99, 99.9):
        assert percentile(values, q) == approx(float(np.percentile(values, q)))


def test_counts_split_every_request_into_ok_rejected_or_error():
    """429 and 503 are rejections; a timeout and a broken stream are errors."""
    s = summarize(mixed_run())
    i = s["classes"]["interactive"]
    assert (i["requests"], i["ok"], i["rejected"], i["errors"], i["met"]) == (9, 5, 2, 2, 3)
    assert s["overall"] == {"requests": 11, "ok": 7, "rejected": 2, "errors": 2, "met": 4,
                            "goodput_rps": approx(0.4), "output_tokens": 22,
                            "output_tokens_per_s": approx(2.2),
                            "request_throughput_rps": approx(0.7)}


def test_latency_percentiles_are_over_ok_requests_with_itl_pooled_over_all_their_gaps():
    """TTFTs of the ok requests: 0.2 0.3 0.4 0.5 0.6. p95 at rank 3.8 -> 0.5 + 0.8 * 0.1.
    Pooled gaps: five of 0.05, two of 0.1, one of 0.3 (the broken stream's 0.9 is out).
    p95 at rank 6.65 -> 0.1 + 0.65 * 0.2; p99 at rank 6.93 -> 0.1 + 0.93 * 0.2."""
    i = summarize(mixed_run())["classes"]["interactive"]
    assert i["ttft_s"] == {"p50": approx(0.4), "p95": approx(0.58), "p99": approx(0.596),
                           "mean": approx(0.4)}
    assert i["itl_s"] == {"p50": approx(0.05), "p95": approx(0.23), "p99": approx(0.286),
                          "mean": approx(0.75 / 8)}
    # e2e 1..5 s: p99 at rank 3.96 -> 4 + 0.96
    assert i["e2e_s"] == {"p50": approx(3.0), "p95": approx(4.8), "p99": approx(4.96),
                          "mean": approx(3.0)}


def test_slo_attainment_counts_threshold_as_met_and_failures_as_misses():
    """Of nine interactive requests, TTFT is met by #0 #1 #3 #4, ITL by #0 #1 #2 #4, both by
    #0 #1 #4; the four rejected/failed ones miss everything. Goodput: met / 10 s."""
    s = summarize(mixed_run())
    i, b = s["classes"]["interactive"], s["classes"]["batch"]
    assert i["slo"] == {"ttft_s": 0.5, "itl_s": 0.1}
    assert i["attainment"] == {"ttft": approx(4 / 9), "itl": approx(4 / 9), "slo": approx(3 / 9)}
    assert i["goodput_rps"] == approx(0.3)
    assert b["attainment"] == {"ttft": approx(0.5), "itl": approx(1.0), "slo": approx(0.5)}
    assert b["goodput_rps"] == approx(0.1)


def test_output_tokens_include_partial_streams():
    """Interactive: 4 + 3 + 2 + 3 + 1 tokens from ok requests, plus 5 from the broken stream."""
    i = summarize(mixed_run())["classes"]["interactive"]
    assert i["output_tokens"] == 18 and i["output_tokens_per_s"] == approx(1.8)


def test_errors_by_reason_includes_rejections_and_retry_after_is_summarised():
    s = summarize(mixed_run())
    assert s["errors_by_reason"] == {"overloaded": 1, "rate_limited": 1, "stream_error": 1,
                                     "timeout": 1}
    assert s["retry_after_s"] == {"count": 2, "median": approx(3.0)}


def test_classes_without_requests_or_without_targets_are_still_reported():
    """A configured class nobody sent has zero counts and no statistics; a class only seen in
    the records has no targets, so every ok request of it meets its SLO."""
    s = summarize(run_of([ok(0, 9.0, [5.0], 20.0, cls="mystery")], classes=(INTERACTIVE,)))
    empty, mystery = s["classes"]["interactive"], s["classes"]["mystery"]
    assert empty["requests"] == 0 and empty["goodput_rps"] == 0.0
    assert empty["attainment"] == {"ttft": None, "itl": None, "slo": None}
    assert empty["ttft_s"] == {"p50": None, "p95": None, "p99": None, "mean": None}
    assert mystery["slo"] == {"ttft_s": None, "itl_s": None}
    assert mystery["attainment"]["slo"] == 1.0


def tenant_run(served: dict[str, int], weights: dict[str, float] | None = None,
               asked: dict[str, int] | None = None) -> RunResult:
    """One request per tenant asking for `asked` tokens (default 100) and receiving `served` of
    them (zero: rejected)."""
    asked = asked or {}
    records = [ok(i, 0.1, [0.01] * (n - 1), 1.0, tenant=t, max_tokens=asked.get(t, 100)) if n
               else failed(i, 429, "rate_limited", tenant=t, max_tokens=asked.get(t, 100))
               for i, (t, n) in enumerate(served.items())]
    return run_of(records, weights=weights)


def test_jain_index_is_one_when_tenants_get_equal_tokens():
    assert summarize(tenant_run({"a": 50, "b": 50, "c": 50}))["jain_index"] == approx(1.0)


def test_jain_index_is_one_over_n_when_one_tenant_gets_everything():
    """Four tenants asked for 100 each; a got all 80 tokens served. Fair would be 20 each: x =
    (4, 0, 0, 0), index 1/4."""
    assert summarize(tenant_run({"a": 80, "b": 0, "c": 0, "d": 0}))["jain_index"] == approx(0.25)


def test_jain_index_splits_contended_service_by_weight():
    """Both backlogged (asked 300 each), 300 served. With weights 2:1 the fair split is 200/100, so
    a getting 200 and b 100 is perfectly fair; with equal weights fair is 150/150 and the same
    service scores (4/3 + 2/3)^2 / (2 * (16/9 + 4/9)) = 0.9."""
    asked = {"a": 300, "b": 300}
    assert summarize(tenant_run({"a": 200, "b": 100}, {"a": 2.0, "b": 1.0}, asked))["jain_index"] \
        == approx(1.0)
    assert summarize(tenant_run({"a": 200, "b": 100}, asked=asked))["jain_index"] == approx(0.9)


def test_a_quiet_tenant_served_in_full_beside_a_flood_is_fair():
    """The noisy-neighbour case: flood asks 1000, quiet asks 50. Serving quiet all 50 and flood
    the remaining 500 is the max-min fair split (index 1); serving quiet only 25 of its 50 while
    flood takes 525 is not: x = (525/500, 25/50), index 1.55^2 / (2 * (1.05^2 + 0.5^2))."""
    asked = {"flood": 1000, "quiet": 50}
    assert summarize(tenant_run({"flood": 500, "quiet": 50}, asked=asked))["jain_index"] == approx(1.0)
    assert summarize(tenant_run({"flood": 525, "quiet": 25}, asked=asked))["jain_index"] == \
        approx(1.55 ** 2 / (2 * (1.05 ** 2 + 0.5 ** 2)))


def test_max_min_fair_fills_small_demands_first_then_splits_by_weight():
    assert max_min_fair({"a": 10, "b": 100, "c": 100}, {"a": 1, "b": 1, "c": 2}, 100) == \
        {"a": 10, "b": approx(30.0), "c": approx(60.0)}
    assert max_min_fair({"a": 10, "b": 0}, {"a": 1, "b": 1}, 50) == {"a": 10, "b": 0.0}


def test_jain_index_edge_cases():
    """One tenant is trivially fair; nothing served has no index; weights must be positive."""
    assert jain_index({"a": 3.0}, {"a": 5.0}, {"a": 1.0}) == 1.0
    assert jain_index({"a": 0.0, "b": 0.0}, {"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 1.0}) is None
    assert jain_index({}, {}, {}) is None
    with pytest.raises(ValueError):
        jain_index({"a": 1.0}, {"a": 1.0}, {"a": 0.0})


def test_tenant_rows_report_share_weight_and_demand_served():
    """a asked for 100 + 100 tokens and got 100 + 50; b asked 100, got 150 of 300 in all (the
    server ignored max_tokens: demand served above 1 is reported as is). c has a weight but sent
    nothing: listed, but outside Jain's index. Of the 300 served, the fair split gives b its 100
    and a the other 200: x = (150/200, 150/100), index 2.25^2 / (2 * (0.75^2 + 1.5^2)) = 0.9."""
    run = run_of([ok(0, 0.1, [], 1.0, tenant="a", tokens=100, max_tokens=100),
                  ok(1, 0.1, [], 1.0, tenant="a", tokens=50, max_tokens=100),
                  ok(2, 0.1, [], 1.0, tenant="b", tokens=150, max_tokens=100)],
                 weights={"a": 1.0, "c": 3.0})
    s = summarize(run)
    assert s["tenants"]["a"] == {"requests": 2, "ok": 2, "output_tokens": 150,
                                 "output_tokens_per_s": approx(15.0), "share": approx(0.5),
                                 "weight": 1.0, "demand_served": approx(0.75)}
    assert s["tenants"]["b"]["weight"] == 1.0 and s["tenants"]["b"]["demand_served"] == 1.5
    assert s["tenants"]["c"] == {"requests": 0, "ok": 0, "output_tokens": 0,
                                 "output_tokens_per_s": 0.0, "share": 0.0, "weight": 3.0,
                                 "demand_served": None}
    assert s["jain_index"] == approx(0.9)


def test_timeline_buckets_by_send_second_and_counts_completions_when_they_end():
    """Sent at 0.2 and 0.7 (ok, TTFT 0.1 and 0.3), at 1.5 (rejected) and at 3.1 (ok, ends at
    4.1); second 2 is empty but present."""
    run = run_of([ok(0, 0.1, [], 0.5, send=0.2), ok(1, 0.3, [], 1.0, send=0.7),
                  RequestRecord(2, "interactive", "a", 1.5, send_s=1.5, status=429,
                                error="rate_limited"),
                  ok(3, 0.2, [], 1.0, send=3.1)])
    row = dict(rejected=0, stage=None)
    assert summarize(run)["timeline"] == [
        {**row, "t_s": 0, "sent": 2, "ok": 2, "ttft_p50_s": approx(0.2), "completed": 1},
        {**row, "t_s": 1, "sent": 1, "ok": 0, "rejected": 1, "ttft_p50_s": None, "completed": 1},
        {**row, "t_s": 2, "sent": 0, "ok": 0, "ttft_p50_s": None, "completed": 0},
        {**row, "t_s": 3, "sent": 1, "ok": 1, "ttft_p50_s": approx(0.2), "completed": 0},
        {**row, "t_s": 4, "sent": 0, "ok": 0, "ttft_p50_s": None, "completed": 1}]


def test_summary_is_json_serialisable_and_needs_the_run_duration():
    s = summarize(mixed_run())
    assert json.loads(json.dumps(s)) == s
    bad = mixed_run()
    del bad.meta["duration_s"]
    with pytest.raises(ValueError, match="duration_s"):
        summarize(bad)


def test_phase_breakdown_summarises_the_servers_phase_times_of_ok_requests_only():
    # Two ok requests report their phases; a failed one with a timing, and an ok one without,
    # are left out. Shares are of the client's e2e: 0.2/1.0 and 0.4/2.0 -> median 0.2.
    timed = [ok(0, 0.2, [0.1], 1.0), ok(1, 0.5, [0.1], 2.0), ok(2, 0.3, [0.1], 3.0),
             failed(3, 200, "stream_error")]
    timed[0].timing = {"queue_s": 0.2, "prefill_s": 0.1, "transfer_s": 0.05, "decode_s": 0.6}
    timed[1].timing = {"queue_s": 0.4, "prefill_s": 0.3, "transfer_s": 0.15, "decode_s": 1.1}
    timed[3].timing = {"queue_s": 9.0}
    phases = summarize(run_of(timed))["classes"]["interactive"]["phases"]
    assert phases["requests"] == 2
    assert phases["queue_s"]["p50"] == approx(0.3)
    assert phases["queue_s"]["share_p50"] == approx(0.2)
    assert phases["transfer_s"]["mean"] == approx(0.1)
    assert phases["decode_s"]["p50"] == approx(0.85)


def test_a_run_without_server_phase_times_has_no_phase_breakdown():
    assert summarize(mixed_run())["classes"]["interactive"]["phases"] is None


def test_rejections_are_counted_by_the_stage_their_refusal_named():
    """Two refusals at S4, one at S1 (a 503 counts as a rejection too), one quota refusal that
    named no stage; an ok request's stage and a timeout are not rejections."""
    run = run_of([failed(0, 429, "overloaded", stage="S4_REJECT"),
                  failed(1, 429, "overloaded", stage="S4_REJECT"),
                  failed(2, 503, "unavailable", stage="S1_NO_BATCH"),
                  failed(3, 429, "quota_streams"),
                  failed(4, 0, "timeout"),
                  ok(5, 0.2, [], 1.0)])
    run.records[5].stage = "S4_REJECT"
    assert summarize(run)["rejections_by_stage"] == {"S1_NO_BATCH": 1, "S4_REJECT": 2,
                                                     "none": 1}
    assert summarize(run_of([ok(0, 0.2, [], 1.0)]))["rejections_by_stage"] == {}


def test_queue_time_is_summarised_by_class_from_the_servers_wait_queue_s():
    """Interactive: three ok requests waited 0, 0.2 and 0.4 s in the router's queue (p50 0.2,
    two queued at all); a failed one's wait is left out. Batch reported none: None."""
    chats = [ok(0, 0.2, [], 1.0), ok(1, 0.4, [], 1.0), ok(2, 0.6, [], 1.0),
             failed(3, 200, "stream_error")]
    for r, wait in zip(chats, (0.0, 0.2, 0.4, 9.0)):
        r.timing = {"queue_s": wait + 0.01, "wait_queue_s": wait}
    s = summarize(run_of([*chats, ok(4, 0.1, [], 1.0, cls="batch")]))
    chat = s["classes"]["interactive"]["queue_time_s"]
    assert chat["requests"] == 3 and chat["queued"] == 2
    assert chat["p50"] == approx(0.2) and chat["mean"] == approx(0.2)
    assert chat["p99"] == approx(0.2 + 0.98 * 0.2)         # rank 1.98 between 0.2 and 0.4
    assert s["classes"]["batch"]["queue_time_s"] is None
    assert s["queue_time_s_by_class"] == {"interactive": chat, "batch": None}


def test_the_timeline_names_the_highest_stage_of_each_second():
    """Second 0: S0 and S2 decisions -> 2; second 1: only a request that named no stage -> None;
    second 2: an S4 refusal -> 4, rejected 1."""
    rows = [ok(0, 0.1, [], 0.5, send=0.1), ok(1, 0.1, [], 0.5, send=0.6),
            ok(2, 0.1, [], 0.5, send=1.2),
            RequestRecord(3, "interactive", "a", 2.5, send_s=2.5, status=429, error="overloaded",
                          stage="S4_REJECT")]
    rows[0].stage, rows[1].stage = "S0_NORMAL", "S2_CAP_OUTPUT"
    timeline = summarize(run_of(rows))["timeline"]
    assert [(r["stage"], r["rejected"]) for r in timeline] == [(2, 0), (None, 0), (4, 1)]


def test_a_record_saved_before_stages_were_recorded_still_loads(tmp_path):
    """run.json written by an older tester has no `stage`: it loads as None."""
    run = run_of([ok(0, 0.1, [], 0.5)])
    d = run.to_dict()
    del d["records"][0]["stage"]
    assert RunResult.from_dict(d).records[0].stage is None
