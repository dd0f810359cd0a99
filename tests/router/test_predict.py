"""The router's TTFT prediction: its terms, from what the workers publish of themselves; a cold
worker (its prior) is never predicted as 0."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.router.predict import (IN_FLIGHT_STEP, PATH_S, Prior, decode_wait_s, kv_bytes_of,
                                     predict)
from services.worker.rates import TINY, WorkerRates


def test_a_cold_worker_is_predicted_from_the_prior():
    cold = pb.WorkerStats(worker_id="p0", queued_prefill_tokens=1000)
    p = predict(cold, 1000, prior=Prior(prefill_tokens_per_s=500.0))
    assert (p.wait_s, p.prefill_s) == (2.0, 2.0) and p.total_s == pytest.approx(4.0 + PATH_S)


def test_a_measured_rate_wins_over_the_prior_and_cached_tokens_cost_nothing():
    w = pb.WorkerStats(worker_id="p0", prefill_tokens_per_s=4000.0)
    p = predict(w, 2000, cached_tokens=1000, prior=Prior(prefill_tokens_per_s=1.0))
    assert p.prefill_s == 0.25 and p.wait_s == 0.0


def test_the_decode_wait_adds_up_and_names_itself_the_dominant_term():
    w = pb.WorkerStats(worker_id="p0", prefill_tokens_per_s=1e6)
    p = predict(w, 100, decode_wait_s=0.5)
    assert p.decode_wait_s == 0.5 and p.dominant() == "decode slot"
    assert p.total_s == pytest.approx(PATH_S + p.prefill_s + 0.5)


def test_the_kv_transfer_follows_the_first_token_it_is_not_part_of_the_ttft():
    # the prefill worker sends the first token to the gateway before any KV moves: a slow KV
    # path delays the second token (and must fit the reservation), never the first
    w = pb.WorkerStats(worker_id="p0", prefill_tokens_per_s=1e6)
    moved = predict(w, 100, kv_bytes=10**9, prior=Prior(kv_gbps=8.0))
    kept = predict(w, 100)
    assert moved.transfer_s == 1.0 and kept.transfer_s == 0.0
    assert moved.total_s == kept.total_s and moved.dominant() == "prefill"
    assert moved.kv_landed_s == pytest.approx(moved.total_s + 1.0)


@given(st.integers(0, 10**6), st.integers(1, 10**5), st.integers(0, 10**5),
       st.floats(0, 1e-6))
def test_longer_prompts_and_longer_queues_never_predict_sooner(queued, prompt, extra, pair_s):
    prior = Prior(attention_s_per_pair=pair_s)
    w = pb.WorkerStats(queued_prefill_tokens=queued)
    longer = pb.WorkerStats(queued_prefill_tokens=queued + extra)
    assert predict(w, prompt, prior=prior).total_s <= predict(w, prompt + extra, prior=prior).total_s
    assert predict(w, prompt, prior=prior).total_s <= predict(longer, prompt, prior=prior).total_s


def cold_worker(queued: int = 0, **fields) -> pb.WorkerStats:
    """A prefill worker's first heartbeat: its prior, nothing measured yet."""
    rates = WorkerRates(TINY, token_budget=2048, chunk_size=512, kv_bytes_per_token=2048)
    return pb.WorkerStats(worker_id="p0", role="prefill", queued_prefill_tokens=queued,
                          **{**rates.fields(), **fields})


@given(st.integers(0, 10**6), st.integers(1, 10**5), st.integers(1, 10**5))
def test_a_cold_fleet_predicts_more_than_0_and_more_behind_a_longer_queue(queued, prompt, extra):
    now, later = predict(cold_worker(queued), prompt), predict(cold_worker(queued + extra), prompt)
    assert now.total_s > 0 and now.prefill_s > 0
    assert later.wait_s > now.wait_s and later.total_s > now.total_s


def test_the_fitted_cost_prices_the_prompt_in_chunks_and_the_queue_at_the_drain_rate():
    idle = predict(cold_worker(0, prefill_drain_tokens_per_s=2000.0), 1024, cached_tokens=0)
    steps = 2                                            # 1024 tokens in 512-token chunks
    assert idle.wait_s == 0
    assert idle.prefill_s == pytest.approx(steps * TINY.step_s + 1024 * TINY.s_per_token
                                           + (1024 * 1025 // 2) * TINY.s_per_pair)
    # behind 4,000 queued tokens: they drain at 2,000 tokens/s, and while they are there each of
    # the prompt's steps is a full one (2,048 tokens at the drain rate), after the one in flight;
    # or of the worker's recent prefill step time, when it says
    busy = predict(cold_worker(4000, prefill_drain_tokens_per_s=2000.0), 1024)
    assert busy.wait_s == pytest.approx(2.0)
    assert busy.prefill_s == pytest.approx((steps + IN_FLIGHT_STEP) * 2048 / 2000.0)
    recent = cold_worker(4000, prefill_drain_tokens_per_s=2000.0, prefill_recent_step_s=0.4)
    assert predict(recent, 1024).prefill_s == pytest.approx((steps + IN_FLIGHT_STEP) * 0.4)


def test_a_class_waits_behind_the_tokens_ahead_of_it_when_the_worker_says():
    w = cold_worker(9000, prefill_drain_tokens_per_s=1000.0)
    w.queued_prefill_tokens_ahead["interactive"] = 1000
    assert predict(w, 10, traffic_class="interactive").wait_s == pytest.approx(1.0)
    assert predict(w, 10, traffic_class="batch").wait_s == pytest.approx(9.0)   # not published


def test_the_transfer_is_the_prompts_kv_at_the_measured_bandwidth():
    w = cold_worker(kv_transfer_bytes_per_s=1e6)
    assert predict(w, 1000, kv_bytes=kv_bytes_of(w, 1000)).transfer_s == pytest.approx(2.048)


def test_the_decode_wait_is_0_with_free_blocks_else_the_missing_ones_at_the_drain_rate():
    d = pb.WorkerStats(worker_id="d0", role="decode", kv_blocks_free=100, kv_blocks_reserved=40,
                       kv_blocks_freed_per_s=20.0)
    assert decode_wait_s(d, 60) == 0.0
    assert decode_wait_s(d, 100) == pytest.approx(2.0)


def test_a_quiet_tenant_waits_behind_its_drr_turn_of_a_floods_queue_not_all_of_it():
    """The engine serves a class's tenants by weighted DRR: a new request of a tenant with nothing
    queued waits behind the higher classes only; one whose tenant has work queued waits behind
    that and, of each other tenant, weight_u / weight_own times that at most."""
    w = cold_worker(9000, prefill_drain_tokens_per_s=1000.0)
    w.queued_prefill_tokens_ahead["interactive"] = 8000 + 500        # 500 of a higher class
    w.prefill_queues.add(traffic_class="interactive", tenant="flood", tokens=7800)
    w.prefill_queues.add(traffic_class="interactive", tenant="chatty", tokens=200)
    w.prefill_queues.add(traffic_class="document", tenant="quiet", tokens=5000)
    weights = {"flood": 1.0, "chatty": 2.0, "quiet": 1.0}
    at = {t: predict(w, 10, traffic_class="interactive", tenant=t, weights=weights).wait_s
          for t in weights}
    assert at["quiet"] == pytest.approx(0.5)                   # the higher class only
    assert at["chatty"] == pytest.approx((500 + 200 + 100) / 1000)   # flood: 1/2 x 200
    assert at["flood"] == pytest.approx((500 + 7800 + 200) / 1000)   # chatty's all (< 2 x 7800)
    assert predict(w, 10, traffic_class="interactive").wait_s == pytest.approx(8.5)  # no tenant


def test_a_short_prompt_behind_one_long_prompt_does_not_wait_for_all_of_it():
    """The long prompt ahead takes one 512-token chunk a step of the 2,048 budget: the chat's first
    chunk fits the next step beside it (its own step is the shared one, priced as before)."""
    w = cold_worker(20_000, prefill_drain_tokens_per_s=2000.0)
    w.queued_prefill_tokens_ahead["interactive"] = 20_000
    w.prefill_step_tokens_ahead["interactive"] = 512
    assert predict(w, 100, traffic_class="interactive").wait_s == 0.0
    w.prefill_step_tokens_ahead["interactive"] = 2000        # four prompts ahead fill the step
    assert predict(w, 100, traffic_class="interactive").wait_s == pytest.approx(10.0)
