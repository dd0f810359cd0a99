"""The prediction's step terms once a worker publishes its step in flight (`step_started_unix_s`,
`step_predicted_s`) and its prefill throughput: what is left of the step then running, and the
prompt's own step priced with the chunks that share it. Numbers and clocks are injected."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.router.predict import (ARRIVALS_JOINING, PATH_S, Prediction, attention_pairs,
                                     in_flight_s, predict, step_s)

STEP_S, PER_TOKEN, PER_PAIR = 0.010, 2e-5, 1e-9
T0 = 1_000.0                      # when the published step began (the worker's wall clock)


def prefill_worker(queued: int = 0, *, started: float = T0, length: float = 0.030,
                   running: int = 1, role: str = "prefill", **fields) -> pb.WorkerStats:
    """A prefill worker with a fitted cost, 2,048 tokens a step in 512-token chunks, running a
    step that began at `started` and is predicted to last `length`."""
    return pb.WorkerStats(worker_id="p0", role=role, prefill_step_s=STEP_S,
                          prefill_s_per_token=PER_TOKEN, prefill_s_per_pair=PER_PAIR,
                          prefill_drain_tokens_per_s=50_000.0, token_budget=2048, chunk_size=512,
                          queued_prefill_tokens=queued, num_running=running,
                          step_started_unix_s=started, step_predicted_s=length, **fields)


def alone_s(tokens: int, others: int = 0, other_pairs: int = 0) -> float:
    """One step holding a `tokens`-token prompt and `others` tokens of other fresh chunks."""
    return (STEP_S + PER_TOKEN * (tokens + others)
            + PER_PAIR * (attention_pairs(0, tokens) + other_pairs))


def test_a_prompt_waits_for_what_is_left_of_the_step_in_flight():
    w = prefill_worker()
    assert in_flight_s(w, T0 + 0.010) == pytest.approx(0.020)
    p = predict(w, 100, now_unix_s=T0 + 0.010)
    assert p.in_flight_s == pytest.approx(0.020)
    assert p.prefill_s == pytest.approx(alone_s(100))
    assert p.total_s == pytest.approx(PATH_S + 0.020 + alone_s(100))


def test_a_beat_older_than_its_step_keeps_the_older_rule():
    """The published step has ended: the worker has moved on (its queue too), at an unknown phase
    of a later step: a whole busy step in flight, inside the prefill term, as before."""
    stale = prefill_worker(queued=4000, prefill_recent_step_s=0.4)
    p = predict(stale, 1024, now_unix_s=T0 + 0.5)
    assert in_flight_s(stale, T0 + 0.5) == 0.0
    assert p.in_flight_s == 0.0 and p.prefill_s == pytest.approx(3 * 0.4)  # 2 chunks + 1 in flight


def test_the_prompts_step_carries_the_queued_chunks_ahead_and_behind_it():
    """A document queued behind a chat still fills the rest of the chat's step (the scheduler
    fills the budget): the chat's step costs the document's chunk too, though it does not wait
    for it."""
    w = prefill_worker(queued=8000)
    w.queued_prefill_tokens_ahead.update({"interactive": 0, "document": 8000})
    w.prefill_step_tokens_ahead.update({"interactive": 0, "document": 512})
    p = predict(w, 100, traffic_class="interactive", now_unix_s=T0 + 0.020)
    assert p.wait_s == 0.0
    assert p.prefill_s == pytest.approx(alone_s(100, 512, attention_pairs(0, 512)))


def test_prompts_expected_to_arrive_before_its_step_starts_join_it_within_the_budget():
    w = prefill_worker(prefill_tokens_per_wall_s=20_000.0)
    # 20 ms left of the step in flight: 400 tokens expected, the typical step sees part of them
    joining = round(ARRIVALS_JOINING * 400)
    p = predict(w, 100, now_unix_s=T0 + 0.010)
    assert p.prefill_s == pytest.approx(alone_s(100, joining, attention_pairs(0, joining)))
    # a flood: never more than what the prompt leaves of the 2,048-token budget
    flood = prefill_worker(prefill_tokens_per_wall_s=1e9)
    full = predict(flood, 100, now_unix_s=T0 + 0.010).prefill_s
    assert full == pytest.approx(alone_s(100, 1948, 3 * attention_pairs(0, 512)
                                         + attention_pairs(0, 1948 - 3 * 512)))
    # an idle worker (its last step over, nothing queued) starts the prompt at once: nobody joins
    idle = prefill_worker(running=0, started=T0 - 1.0, prefill_tokens_per_wall_s=20_000.0)
    assert predict(idle, 100, now_unix_s=T0 + 0.010).prefill_s == pytest.approx(alone_s(100))


def test_a_colocated_replica_prices_its_step_in_flight_and_its_decode_batch_in_every_step():
    """Decodes go first: a mixed replica decoding 100 sequences leaves its prompts 1,948 of the
    2,048-token budget, and every step also costs the batch (its tokens, its context)."""
    w = prefill_worker(role="mixed", num_decoding=100, decode_context_tokens=50_000,
                       running=100)
    p = predict(w, 100, now_unix_s=T0 + 0.020)
    assert p.in_flight_s == pytest.approx(0.010)
    assert p.prefill_s == pytest.approx(step_s(w, 100, attention_pairs(0, 100)))


def test_a_colocated_replica_whose_beat_is_older_than_its_step_keeps_its_decode_batch_rule():
    w = prefill_worker(role="mixed", num_decoding=100, decode_context_tokens=50_000,
                       running=100)
    p = predict(w, 100, now_unix_s=T0 + 0.5)
    assert p.in_flight_s == 0.0
    own = step_s(w, 0, 0) + 100 * PER_TOKEN + attention_pairs(0, 100) * PER_PAIR
    assert p.prefill_s == pytest.approx(own + 0.5 * step_s(w, 0, 0))   # half a decode step


def test_a_step_past_its_predicted_end_is_still_the_one_in_flight_until_twice_its_length():
    """A step that overran its predicted 30 ms (the fit is a few % off) is still running: the
    prompt starts as it ends (nothing left in flight), in the next step; a step begun more than
    two of its lengths ago has ended, and the beat is stale (the older rule)."""
    w = prefill_worker(queued=4000, prefill_recent_step_s=0.4)
    overran = predict(w, 100, now_unix_s=T0 + 0.035)
    assert overran.in_flight_s == 0.0 and overran.prefill_s < 0.4
    stale = predict(w, 100, now_unix_s=T0 + 0.061)
    assert stale.in_flight_s == 0.0 and stale.prefill_s == pytest.approx(2 * 0.4)


def test_the_in_flight_term_counts_as_queue_and_is_written_into_the_plans_wait():
    p = Prediction(wait_s=0.01, prefill_s=0.015, transfer_s=0.0, decode_wait_s=0.0,
                   in_flight_s=0.02)
    assert p.dominant() == "queue"
    assert p.fill(pb.Plan()).predicted_wait_s == pytest.approx(0.03)


def test_a_worker_that_publishes_no_step_keeps_the_older_rule():
    old = prefill_worker(length=0.0, queued=4000, prefill_recent_step_s=0.4)
    p = predict(old, 1024, now_unix_s=T0)
    assert p.in_flight_s == 0.0 and p.prefill_s == pytest.approx(3 * 0.4)  # 2 chunks + 1 in flight


@given(st.floats(0, 0.014), st.floats(0, 0.014), st.integers(0, 20_000), st.integers(0, 20_000),
       st.integers(1, 9000), st.floats(0, 1e5))
def test_later_never_predicts_more_and_more_queued_never_predicts_less(early, more, queued,
                                                                       extra, prompt, rate):
    """Within the published step (past it, the older rule prices a stale beat)."""
    w = prefill_worker(queued, prefill_tokens_per_wall_s=rate)
    longer = prefill_worker(queued + extra, prefill_tokens_per_wall_s=rate)
    at = predict(w, prompt, now_unix_s=T0 + early).total_s
    assert predict(w, prompt, now_unix_s=T0 + early + more).total_s <= at + 1e-12
    assert predict(longer, prompt, now_unix_s=T0 + early).total_s >= at - 1e-12


def test_a_long_prompts_later_steps_carry_the_prompts_arriving_meanwhile():
    """Past its first step, each of a long prompt's steps is shared with what arrives while the
    step before it runs (ARRIVALS_JOINING of the worker's throughput x that step, in chunks), not
    with the queue it found."""
    busy = prefill_worker(prefill_tokens_per_wall_s=20_000.0)
    end = T0 + 0.030 - 1e-5              # the step in flight ends as it arrives: nobody joins
    shared = predict(busy, 2048, now_unix_s=end).prefill_s
    expected, previous = 0.0, 0.0
    for k in range(4):                   # four 512-token chunks
        later = round(ARRIVALS_JOINING * 20_000.0 * previous)
        pieces = [512] * (later // 512) + ([later % 512] if later % 512 else [])
        previous = (STEP_S + PER_TOKEN * (512 + later) + PER_PAIR * (
            attention_pairs(512 * k, 512) + sum(attention_pairs(0, n) for n in pieces)))
        expected += previous
    assert shared == pytest.approx(expected, rel=1e-9)
