"""Workload specs: a seeded spec always expands to the same requests, and what it samples follows
what it says (rates, length distributions, trace replay), within statistical tolerance."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from loadtests.arrivals import parse_arrival
from loadtests.distributions import SpecError, parse_length
from loadtests.workload import WORKLOADS_DIR, load_workload, parse_workload, plan_requests

TRACE = WORKLOADS_DIR.parent / "data" / "azure-llm-inference-2023-conv.csv"
SHIPPED = ["chat-only", "mixed", "noisy-neighbor", "overload-ramp", "azure-conv"]


def spec_with(arrival: dict, prompt=None, output=None, duration_s=100.0, **top):
    return parse_workload({
        "name": "t", "duration_s": duration_s, **top,
        "classes": {"interactive": {"slo": {"ttft_s": 1.0, "itl_s": 0.1},
                                    "prompt_tokens": prompt or 100, "output_tokens": output or 10}},
        "tenants": {"a": {"class": "interactive", "arrival": arrival}}})


def times(spec) -> np.ndarray:
    return np.array([r.at_s for r in plan_requests(spec)])


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_workload_loads_and_replans_identically(name):
    spec = load_workload(name)
    first, second = plan_requests(spec), plan_requests(spec)
    assert first == second and len(first) > 10
    assert [r.index for r in first] == list(range(len(first)))
    assert all(0 <= r.at_s < spec.duration_s for r in first)
    assert all(a.at_s <= b.at_s for a, b in zip(first, first[1:]))
    assert plan_requests(spec.with_overrides(seed=spec.seed + 1)) != first


def test_the_mixed_workload_scales_the_seeds_documents_to_this_machine():
    """32K documents at scale.prompt 0.25 are 4K-8K tokens; chats stay small; all classes appear."""
    reqs = plan_requests(load_workload("mixed"))
    by = {c: [r.prompt_tokens for r in reqs if r.traffic_class == c] for c in ("interactive", "document", "batch")}
    assert all(by.values())
    assert all(4096 <= n <= 8192 for n in by["document"])
    assert np.median(by["interactive"]) == pytest.approx(50, rel=0.2)


def test_poisson_arrivals_have_the_rate_and_exponential_gaps():
    t = times(spec_with({"process": "poisson", "rate_rps": 20}, duration_s=200))
    n_expected = 20 * 200
    assert abs(len(t) - n_expected) < 4 * math.sqrt(n_expected)
    gaps = np.diff(t)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)     # exponential: CV 1


def test_rate_scale_multiplies_the_rate_and_keeps_the_shape():
    base = spec_with({"process": "onoff", "on_rps": 10, "on_s": 2, "off_s": 3}, duration_s=500)
    doubled = times(base.with_overrides(rate_scale=2.0))
    assert len(doubled) / len(times(base)) == pytest.approx(2.0, rel=0.08)
    assert np.all(np.mod(doubled, 5.0) < 2.0)                            # still only in the on phases


def test_onoff_is_bursty_on_its_schedule():
    t = times(spec_with({"process": "onoff", "on_rps": 30, "off_rps": 1, "on_s": 1, "off_s": 4}, duration_s=500))
    on = np.mod(t, 5.0) < 1.0
    assert on.sum() == pytest.approx(30 * 100, rel=0.06)
    assert (~on).sum() == pytest.approx(1 * 400, rel=0.2)


def test_mmpp_averages_its_states_rates_by_their_dwell_times():
    spec = spec_with({"process": "mmpp", "rates_rps": [2.0, 20.0], "mean_dwell_s": [3.0, 1.0]}, duration_s=2000)
    expected = (2.0 * 3.0 + 20.0 * 1.0) / 4.0
    assert len(times(spec)) / 2000 == pytest.approx(expected, rel=0.1)
    per_second = np.bincount(times(spec).astype(int))
    assert per_second.var() / per_second.mean() > 3        # overdispersed: bursts, not Poisson (ratio 1)


def test_a_staircase_ramp_offers_each_stair_its_rate():
    t = times(spec_with({"process": "ramp", "start_rps": 2, "end_rps": 12, "steps": 3}, duration_s=300))
    counts = np.bincount((t // 100).astype(int), minlength=3)
    for count, rate in zip(counts, (2, 7, 12)):
        assert count == pytest.approx(rate * 100, rel=0.15)


def test_a_linear_ramp_rises_steadily():
    t = times(spec_with({"process": "ramp", "start_rps": 0, "end_rps": 20}, duration_s=400))
    assert len(t) == pytest.approx(10 * 400, rel=0.05)                 # the mean rate
    first, last = (t < 100).sum(), (t >= 300).sum()
    assert first == pytest.approx(2.5 * 100, rel=0.2) and last == pytest.approx(17.5 * 100, rel=0.08)


def test_lognormal_lengths_match_their_median_mean_and_tail():
    spec = spec_with({"process": "poisson", "rate_rps": 100},
                     prompt={"dist": "lognormal", "median": 200, "sigma": 0.5, "min": 1, "max": 100_000})
    n = np.array([r.prompt_tokens for r in plan_requests(spec)])
    assert len(n) > 5000
    assert np.median(n) == pytest.approx(200, rel=0.03)
    assert n.mean() == pytest.approx(200 * math.exp(0.5 ** 2 / 2), rel=0.03)
    assert np.percentile(n, 99) == pytest.approx(200 * math.exp(2.3263 * 0.5), rel=0.08)


def test_uniform_and_fixed_lengths_and_the_scale_factors():
    spec = spec_with({"process": "poisson", "rate_rps": 50}, prompt={"dist": "uniform", "min": 1000, "max": 3000},
                     output=7, scale={"prompt": 0.5, "output": 2.0})
    reqs = plan_requests(spec)
    prompts = np.array([r.prompt_tokens for r in reqs])
    assert prompts.min() >= 500 and prompts.max() <= 1500
    assert prompts.mean() == pytest.approx(1000, rel=0.02)
    assert {r.max_tokens for r in reqs} == {14}


def test_trace_replay_keeps_the_traces_gaps_and_lengths_and_splits_rows_between_tenants():
    spec = load_workload("azure-conv").with_overrides(duration_s=30)
    reqs = plan_requests(spec)
    rows = np.genfromtxt(TRACE, delimiter=",", skip_header=1, usecols=(1, 2), dtype=np.int64)
    n = len(reqs)
    # every row of the first 30 s, each once: tenants take rows i mod 3
    assert [r.tenant for r in reqs[:6]] == ["conv-0", "conv-1", "conv-2"] * 2
    assert [r.prompt_tokens for r in reqs] == [max(1, round(p * 0.25)) for p in rows[:n, 0]]
    assert [r.max_tokens for r in reqs] == [max(1, round(o * 0.5)) for o in rows[:n, 1]]
    stamps = np.array([4.3145789, 4.5418769, 4.7104269]) - 0.0    # rows 2-4 minus row 1, from the CSV
    assert [round(r.at_s, 4) for r in reqs[1:4]] == pytest.approx(stamps, abs=1e-4)
    faster = plan_requests(spec.with_overrides(rate_scale=2.0))
    assert faster[3].at_s == pytest.approx(reqs[3].at_s / 2)


def test_max_requests_cuts_the_list():
    spec = replace(load_workload("chat-only"), max_requests=7)
    assert len(plan_requests(spec)) == 7


@pytest.mark.parametrize("bad, says", [
    ({"name": "x", "classes": {}, "tenants": {}}, "classes: expected a non-empty mapping"),
    ({"name": "x", "classes": {"c": {"slo": {}, "prompt_tokens": 5, "output_tokens": 5}},
      "tenants": {"a": {"class": "nope", "arrival": {"process": "poisson", "rate_rps": 1}}}},
     "'nope' is not one of the spec's classes ['c']"),
    ({"name": "x", "colour": 1, "classes": {}, "tenants": {}}, "unknown field(s) ['colour']"),
    ({"name": "x", "classes": {"c": {"slo": {"ttft": 1}, "prompt_tokens": 5, "output_tokens": 5}},
      "tenants": {}}, "classes.c.slo: unknown field(s) ['ttft']"),
])
def test_bad_specs_say_what_is_wrong(bad, says):
    with pytest.raises(SpecError) as e:
        parse_workload(bad)
    assert says in str(e.value)


@pytest.mark.parametrize("arrival, says", [
    ({"process": "poisson"}, "missing ['rate_rps']"),
    ({"process": "poisson", "rate_rps": -1}, "expected a rate >= 0"),
    ({"process": "zipf"}, "unknown process 'zipf'"),
    ({"process": "mmpp", "rates_rps": [1], "mean_dwell_s": [1]}, "2+ states"),
    ({"process": "trace", "file": str(TRACE), "prompt_column": "Prompt"}, "'Prompt' is not a column"),
    ({"process": "trace", "file": "/nonexistent.csv"}, "does not exist"),
])
def test_bad_arrival_processes_say_what_is_wrong(arrival, says, tmp_path):
    with pytest.raises(SpecError) as e:
        parse_arrival(arrival, "tenants.a.arrival", tmp_path)
    assert says in str(e.value)


@pytest.mark.parametrize("length, says", [
    ({"dist": "lognormal", "median": 0, "sigma": 1}, "median > 0"),
    ({"dist": "uniform", "min": 10, "max": 5}, "min <= max"),
    ({"dist": "gamma"}, "unknown distribution 'gamma'"),
    ("200", "expected an int or a mapping"),
])
def test_bad_length_distributions_say_what_is_wrong(length, says, tmp_path):
    with pytest.raises(SpecError) as e:
        parse_length(length, "classes.c.prompt_tokens", tmp_path)
    assert says in str(e.value)


def test_an_unknown_workload_name_lists_the_shipped_ones():
    with pytest.raises(SpecError) as e:
        load_workload("no-such-workload")
    assert all(name in str(e.value) for name in SHIPPED)


def test_multi_turn_tenants_share_one_prompt_seed_per_conversation():
    from collections import defaultdict
    plain = plan_requests(load_workload("azure-conv"))
    turns = plan_requests(load_workload("azure-conv-turns"))
    assert [(r.at_s, r.tenant, r.prompt_tokens) for r in plain] == \
        [(r.at_s, r.tenant, r.prompt_tokens) for r in turns]          # only the content differs
    by_tenant = defaultdict(list)
    for r in turns:
        by_tenant[r.tenant].append(r.prompt_seed)
    for seeds in by_tenant.values():
        conversations = [seeds[i:i + 4] for i in range(0, len(seeds), 4)]
        assert all(len(set(c)) == 1 for c in conversations)             # one seed a conversation
        assert len({c[0] for c in conversations}) == len(conversations)  # each its own
    assert len({r.prompt_seed for r in plain}) == len(plain)            # azure-conv: none shared
    with pytest.raises(SpecError, match="turns"):
        spec = {"name": "x", "classes": {"c": {"slo": {}, "prompt_tokens": {"dist": "fixed", "value": 8},
                                               "output_tokens": {"dist": "fixed", "value": 8}}},
                "tenants": {"t": {"class": "c", "turns": 0,
                                  "arrival": {"process": "poisson", "rate_rps": 1}}}}
        parse_workload(spec)
