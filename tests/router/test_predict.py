"""The router's TTFT prediction: its terms, and a cold worker predicted from the prior, not as 0."""
from __future__ import annotations

from hypothesis import given, strategies as st

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.router.predict import Prior, predict


def test_a_cold_worker_is_predicted_from_the_prior():
    cold = pb.WorkerStats(worker_id="p0", queued_prefill_tokens=1000)
    p = predict(cold, 1000, prior=Prior(prefill_tokens_per_s=500.0))
    assert (p.wait_s, p.prefill_s) == (2.0, 2.0) and p.total_s == 4.0


def test_a_measured_rate_wins_over_the_prior_and_cached_tokens_cost_nothing():
    w = pb.WorkerStats(worker_id="p0", prefill_tokens_per_s=4000.0)
    p = predict(w, 2000, cached_tokens=1000, prior=Prior(prefill_tokens_per_s=1.0))
    assert p.prefill_s == 0.25 and p.wait_s == 0.0


def test_the_transfer_and_decode_wait_terms_add_up_and_name_the_dominant_one():
    w = pb.WorkerStats(worker_id="p0", prefill_tokens_per_s=1e6)
    p = predict(w, 100, kv_bytes=10**9, decode_wait_s=0.5, prior=Prior(kv_gbps=8.0))
    assert p.transfer_s == 1.0 and p.decode_wait_s == 0.5 and p.dominant() == "kv transfer"


@given(st.integers(0, 10**6), st.integers(1, 10**5), st.integers(0, 10**5),
       st.floats(0, 1e-6))
def test_longer_prompts_and_longer_queues_never_predict_sooner(queued, prompt, extra, pair_s):
    prior = Prior(attention_s_per_pair=pair_s)
    w = pb.WorkerStats(queued_prefill_tokens=queued)
    longer = pb.WorkerStats(queued_prefill_tokens=queued + extra)
    assert predict(w, prompt, prior=prior).total_s <= predict(w, prompt + extra, prior=prior).total_s
    assert predict(w, prompt, prior=prior).total_s <= predict(longer, prompt, prior=prior).total_s
