"""Numbers of one load-test run: latency percentiles, SLO attainment, goodput, tenant fairness.

Pure functions of a `RunResult` (loadtests/records.py); `summarize` returns a JSON-serialisable
dict that `loadtests/report.py` renders and the compare command reads back.

Conventions used throughout:
- A request is "ok" when `RequestRecord.ok`; "rejected" when its HTTP status is 429 or 503; every
  other request is an "error" (so requests = ok + rejected + errors).
- Latency statistics (TTFT, ITL, e2e) are over ok requests only; ITL pools every gap of them.
- SLO attainment is over ALL requests of a class: a rejected or failed request is a miss.
- Output tokens count every token received, partial streams of failed requests included.
- Rates divide by the run's wall time `meta["duration_s"]`.
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict

import numpy as np

from loadtests.records import ClassSLO, RequestRecord, RunResult

REJECT_STATUSES = (429, 503)
QUANTILES = (50, 95, 99)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (q in [0, 100]) by linear interpolation between closest ranks.

    Sorted values v[0..n-1]; rank h = (n - 1) * q / 100; result v[floor h] + (h - floor h) *
    (v[floor h + 1] - v[floor h]). Same as numpy's default method ("linear", R type 7): q=0 is the
    minimum, q=100 the maximum, one value is its own every percentile. Empty input -> None.
    """
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q, method="linear"))


def latency_stats(values: list[float]) -> dict:
    """p50, p95, p99 and mean of `values` (all None when empty)."""
    stats = {f"p{q}": percentile(values, q) for q in QUANTILES}
    stats["mean"] = float(np.mean(values)) if values else None
    return stats


def is_rejected(r: RequestRecord) -> bool:
    return r.status in REJECT_STATUSES


def meets_ttft(r: RequestRecord, slo: ClassSLO) -> bool:
    """Completed, and TTFT at most the target (inclusive) when there is one."""
    return r.ok and (slo.ttft_s is None or r.ttft_s <= slo.ttft_s)


def meets_itl(r: RequestRecord, slo: ClassSLO) -> bool:
    """Completed, and the p99 of its own gaps at most the target (inclusive) when there is one.
    A completed request without gaps (a single token) meets it trivially."""
    if not r.ok:
        return False
    if slo.itl_s is None or not r.itl_s:
        return True
    return percentile(r.itl_s, 99) <= slo.itl_s


def meets_slo(r: RequestRecord, slo: ClassSLO) -> bool:
    """The `ClassSLO` rule: completed, TTFT met and ITL met."""
    return meets_ttft(r, slo) and meets_itl(r, slo)


def _fraction(n: int, d: int) -> float | None:
    return n / d if d else None


def _counts(records: list[RequestRecord]) -> dict:
    ok = sum(r.ok for r in records)
    rejected = sum(is_rejected(r) for r in records)
    return {"requests": len(records), "ok": ok, "errors": len(records) - ok - rejected,
            "rejected": rejected}


PHASES = ("queue_s", "prefill_s", "transfer_s", "decode_s")


def phase_breakdown(records: list[RequestRecord]) -> dict | None:
    """Where the time of the ok requests that reported server-side phase times went: per phase
    (queue, prefill, transfer, decode) its stats, and its median share of the request's e2e as the
    client measured it. None when no request reported them (e.g. a server other than kvfleet)."""
    timed = [r for r in records if r.ok and r.timing and r.e2e_s]
    if not timed:
        return None
    out = {"requests": len(timed)}
    for phase in PHASES:
        values = [r.timing.get(phase, 0.0) for r in timed]
        out[phase] = {**latency_stats(values),
                      "share_p50": percentile([v / r.e2e_s for v, r in zip(values, timed)], 50)}
    return out


def prediction_error(records: list[RequestRecord]) -> dict | None:
    """How far the router's TTFT prediction was off, from the server's timing: p50 and p90 of
    |predicted - actual| / actual TTFT over the ok requests that reported it (None: none did)."""
    errors = [abs(r.timing["ttft_prediction_error"]) for r in records
              if r.ok and r.timing and "ttft_prediction_error" in r.timing]
    if not errors:
        return None
    return {"requests": len(errors), "p50": percentile(errors, 50), "p90": percentile(errors, 90)}


NO_STAGE = "none"     # the stage key of a refusal that named none (decided outside the router)


def stage_level(stage: str | None) -> int | None:
    """An overload stage's number, from its name (S0_NORMAL -> 0, ..., S4_REJECT -> 4; None:
    not a stage name)."""
    if stage and len(stage) >= 2 and stage[0] == "S" and stage[1].isdigit():
        return int(stage[1])
    return None


def rejections_by_stage(records: list[RequestRecord]) -> dict[str, int]:
    """Rejected requests (429/503) counted by the stage their refusal named (`NO_STAGE` when it
    named none: a quota, or a server that does not say)."""
    return dict(sorted(Counter(r.stage or NO_STAGE for r in records if is_rejected(r)).items()))


def queue_time(records: list[RequestRecord]) -> dict | None:
    """How long the ok requests that reported it waited in the router's wait queue (the server's
    `wait_queue_s`, 0 when admitted at once): its stats, and how many waited at all. None when
    no request reported it."""
    waits = [r.timing["wait_queue_s"] for r in records
             if r.ok and r.timing and "wait_queue_s" in r.timing]
    if not waits:
        return None
    return {"requests": len(waits), "queued": sum(w > 0 for w in waits), **latency_stats(waits)}


def class_summary(records: list[RequestRecord], slo: ClassSLO, duration_s: float) -> dict:
    """Counts, latency stats, SLO attainment, goodput and token throughput of one class."""
    good = [r for r in records if r.ok]
    met = sum(meets_slo(r, slo) for r in records)
    tokens = sum(r.output_tokens for r in records)
    n = len(records)
    return {
        **_counts(records),
        "met": met,
        "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s},
        "ttft_s": latency_stats([r.ttft_s for r in good]),
        "itl_s": latency_stats([g for r in good for g in r.itl_s]),
        "e2e_s": latency_stats([r.e2e_s for r in good if r.e2e_s is not None]),
        "attainment": {"ttft": _fraction(sum(meets_ttft(r, slo) for r in records), n),
                       "itl": _fraction(sum(meets_itl(r, slo) for r in records), n),
                       "slo": _fraction(met, n)},
        "goodput_rps": met / duration_s,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration_s,
        "phases": phase_breakdown(records),
        "prediction_error": prediction_error(records),
        "queue_time_s": queue_time(records),
    }


def max_min_fair(demands: dict[str, float], weights: dict[str, float],
                 capacity: float) -> dict[str, float]:
    """The weighted max-min fair split of `capacity` (water-filling): a tenant asking for less
    than its weighted share of what is left gets all it asks; the others split the rest by weight.
    Tenants asking for nothing get nothing."""
    alloc = {name: 0.0 for name in demands}
    active = {name for name, d in demands.items() if d > 0}
    remaining = capacity
    while active and remaining > 0:
        total_weight = sum(weights[name] for name in active)
        share = {name: remaining * weights[name] / total_weight for name in active}
        satisfied = {name for name in active if demands[name] <= share[name]}
        if not satisfied:
            alloc.update(share)
            break
        for name in satisfied:
            alloc[name] = demands[name]
            remaining -= demands[name]
        active -= satisfied
    return alloc


def jain_index(served: dict[str, float], demands: dict[str, float],
               weights: dict[str, float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n * sum x^2) over x_i = served_i / fair_i, where fair_i
    is tenant i's weighted max-min fair share of everything served (`max_min_fair`, demands in
    output tokens asked for).

    So "fair" means what a weighted fair scheduler (DRR, VTC) aims at: a tenant asking for little
    gets all of it, and backlogged tenants split the rest in proportion to weight. 1.0 when the
    service was exactly that split; 1/n when one tenant got everything while others asked; None
    when nothing was served or asked for. Tenants are those with a demand > 0."""
    if any(weights[name] <= 0 for name in demands):
        raise ValueError(f"tenant weights must be positive: {weights}")
    fair = max_min_fair(demands, weights, sum(served.values()))
    xs = [served[name] / fair[name] if fair[name] > 0 else 0.0
          for name in demands if demands[name] > 0]
    square_sum = sum(x * x for x in xs)
    if square_sum == 0:
        return None
    return sum(xs) ** 2 / (len(xs) * square_sum)


def tenant_summary(records: list[RequestRecord], weight: float, total_tokens: int,
                   duration_s: float) -> dict:
    """One tenant's counts, tokens, share of all tokens, and tokens received / max_tokens asked."""
    tokens = sum(r.output_tokens for r in records)
    demand = sum(r.max_tokens for r in records)
    return {"requests": len(records), "ok": sum(r.ok for r in records), "output_tokens": tokens,
            "output_tokens_per_s": tokens / duration_s, "share": _fraction(tokens, total_tokens),
            "weight": weight, "demand_served": _fraction(tokens, demand)}


def timeline(records: list[RequestRecord]) -> list[dict]:
    """One row per second of the run (dense, from second 0): requests sent in it (bucketed by
    floor(send_s)), how many of those were ok and how many rejected, their median TTFT, the
    highest overload stage any of them was decided in (`stage_level`; None when none said), and
    ok requests completed in it (bucketed by floor(send_s + e2e_s)). Requests never sent are
    left out."""
    sent = [r for r in records if r.send_s is not None]
    by_send: dict[int, list[RequestRecord]] = defaultdict(list)
    for r in sent:
        by_send[max(0, math.floor(r.send_s))].append(r)
    completed = Counter(max(0, math.floor(r.send_s + r.e2e_s))
                        for r in sent if r.ok and r.e2e_s is not None)
    last = max([*by_send, *completed], default=-1)
    return [{"t_s": t, "sent": len(by_send[t]), "ok": sum(r.ok for r in by_send[t]),
             "rejected": sum(is_rejected(r) for r in by_send[t]),
             "ttft_p50_s": percentile([r.ttft_s for r in by_send[t] if r.ok], 50),
             "stage": max((lv for r in by_send[t] if (lv := stage_level(r.stage)) is not None),
                          default=None),
             "completed": completed[t]}
            for t in range(last + 1)]


def summarize(run: RunResult) -> dict:
    """Every number the report shows, as a JSON-serialisable dict:

        duration_s
        classes[name]: requests ok errors rejected met, slo{ttft_s itl_s},
                       ttft_s / itl_s / e2e_s {p50 p95 p99 mean}, attainment{ttft itl slo},
                       goodput_rps output_tokens output_tokens_per_s,
                       phases (None, or requests and {queue_s prefill_s transfer_s decode_s}:
                               {p50 p95 p99 mean share_p50})
                       prediction_error (None, or {requests p50 p90} of |predicted - actual|
                                         / actual TTFT, from the server's timing)
                       queue_time_s (None, or {requests queued p50 p95 p99 mean}: the time in
                                     the router's wait queue, the server's wait_queue_s)
        overall: requests ok errors rejected met goodput_rps output_tokens output_tokens_per_s
                 request_throughput_rps
        prediction_error: overall, as the classes' (None when no request reported it)
        rejections_by_stage{stage: count}: rejected requests by the stage their refusal named
                                           ("none": it named none)
        queue_time_s_by_class{name: the class's queue_time_s}
        tenants[name]: requests ok output_tokens output_tokens_per_s share weight demand_served
        jain_index, errors_by_reason{reason: count}, retry_after_s{count median}
        timeline: [{t_s sent ok rejected ttft_p50_s stage completed}, ...]

    Classes are those of `run.classes` plus any seen in records (no targets: met when ok); tenants
    those of `run.tenant_weights` plus any seen (weight 1.0). Statistics with nothing to measure
    are None. Raises ValueError if meta["duration_s"] is missing or not positive."""
    duration_s = run.meta.get("duration_s")
    if not isinstance(duration_s, (int, float)) or duration_s <= 0:
        raise ValueError(f"run.meta['duration_s'] must be a positive number, got {duration_s!r}")

    by_class: dict[str, list[RequestRecord]] = {name: [] for name in run.classes}
    by_tenant: dict[str, list[RequestRecord]] = {name: [] for name in run.tenant_weights}
    for r in run.records:
        by_class.setdefault(r.traffic_class, []).append(r)
        by_tenant.setdefault(r.tenant, []).append(r)

    classes = {name: class_summary(recs, run.classes.get(name, ClassSLO(name, None, None)),
                                   duration_s)
               for name, recs in by_class.items()}

    total_tokens = sum(r.output_tokens for r in run.records)
    weights = {name: run.tenant_weights.get(name, 1.0) for name in by_tenant}
    tenants = {name: tenant_summary(recs, weights[name], total_tokens, duration_s)
               for name, recs in by_tenant.items()}

    met = sum(c["met"] for c in classes.values())
    overall = {**_counts(run.records), "met": met, "goodput_rps": met / duration_s,
               "output_tokens": total_tokens, "output_tokens_per_s": total_tokens / duration_s,
               "request_throughput_rps": sum(r.ok for r in run.records) / duration_s}

    retry_after = [r.retry_after_s for r in run.records
                   if is_rejected(r) and r.retry_after_s is not None]
    return {
        "duration_s": duration_s,
        "classes": classes,
        "overall": overall,
        "tenants": tenants,
        "jain_index": jain_index({n: float(t["output_tokens"]) for n, t in tenants.items()},
                                 {n: float(sum(r.max_tokens for r in by_tenant[n])) for n in tenants},
                                 weights),
        "errors_by_reason": dict(sorted(Counter(r.error for r in run.records
                                                if r.error is not None).items())),
        "retry_after_s": {"count": len(retry_after), "median": percentile(retry_after, 50)},
        "timeline": timeline(run.records),
        "prediction_error": prediction_error(run.records),
        "rejections_by_stage": rejections_by_stage(run.records),
        "queue_time_s_by_class": {name: c["queue_time_s"] for name, c in classes.items()},
    }
