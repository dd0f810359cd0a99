"""What a worker measures of itself for the router's prediction (services/worker/rates.py): the
online prefill cost fit finds the coefficients its steps were timed with, forgets an old regime,
and starts from (and publishes) its prior; the drain rate is tokens over busy seconds."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from services.engine.scheduler import attention_pairs
from services.planner.capacity import CostModel
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.engine.warmup import MeasuredStep, default_shapes
from services.worker.rates import (SMOLLM2, TINY, CostFit, Prior, WorkerRates, default_prior,
                                   nonnegative_solve, prior_from_steps, prior_from_timer)



class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def synthetic_steps(seed: int, n: int):
    """(tokens, pairs) of chunks of 16..512 tokens at positions 0..8K, in a fixed order."""
    import random
    rnd = random.Random(seed)
    for _ in range(n):
        tokens, start = rnd.randint(16, 512), rnd.randint(0, 8192)
        yield tokens, attention_pairs(start, tokens)


@settings(max_examples=30, deadline=None)
@given(step_s=st.floats(1e-4, 0.1), per_token=st.floats(1e-6, 1e-2),
       per_pair=st.floats(1e-10, 1e-6), seed=st.integers(0, 1000))
def test_the_fit_converges_to_the_coefficients_the_steps_were_timed_with(step_s, per_token,
                                                                          per_pair, seed):
    # a prior far from the truth: the steps win (without the kept pairs-to-token ratio, which
    # biases a law whose ratio is 1e4 times the prior's: see the tests after the next)
    fit = CostFit(TINY, ratio_weight=0.0)
    for tokens, pairs in synthetic_steps(seed, 1000):
        fit.observe(tokens, pairs, step_s + per_token * tokens + per_pair * pairs)
    a, b, c = fit.coefficients
    for tokens, pairs in ((64, attention_pairs(0, 64)), (512, attention_pairs(4096, 512))):
        truth = step_s + per_token * tokens + per_pair * pairs
        assert abs(fit.step_time(tokens, pairs) - truth) <= 0.02 * truth
    assert abs(b - per_token) <= 0.05 * per_token + 0.05 * step_s / 512


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 1000), slow=st.floats(2.0, 5.0))
def test_the_fit_forgets_an_old_regime(seed, slow):
    fit = CostFit(TINY)
    for tokens, pairs in synthetic_steps(seed, 200):
        fit.observe(tokens, pairs, TINY.step_time(tokens, pairs))
    for tokens, pairs in synthetic_steps(seed + 1, 400):      # the machine got `slow` times slower
        fit.observe(tokens, pairs, slow * TINY.step_time(tokens, pairs))
    probe = (256, attention_pairs(1024, 256))
    assert abs(fit.step_time(*probe) - slow * TINY.step_time(*probe)) <= 0.05 * slow * TINY.step_time(*probe)


def test_a_cold_worker_publishes_its_prior_and_a_drain_rate_from_it():
    rates = WorkerRates(TINY, token_budget=512, chunk_size=256, kv_bytes_per_token=2048)
    stats = pb.WorkerStats(**rates.fields())
    assert (stats.prefill_step_s, stats.prefill_s_per_token, stats.prefill_s_per_pair) == (
        TINY.step_s, TINY.s_per_token, TINY.s_per_pair)
    assert stats.prefill_fit_steps == 0 and stats.prior_source.startswith("default:")
    assert stats.prefill_drain_tokens_per_s == TINY.drain_rate(512, 256) > 0
    assert stats.kv_bytes_per_token == 2048 and stats.kv_transfer_bytes_per_s == 0


def test_the_drain_rate_is_prefill_tokens_over_busy_seconds_gaps_and_decode_share_included():
    clock = FakeClock()
    rates = WorkerRates(TINY, clock=clock)
    for _ in range(4):
        rates.on_step(prefill_tokens=400, decode_tokens=100, pairs=0, duration_s=0.09, gap_s=0.01)
        rates.on_step(prefill_tokens=0, decode_tokens=100, pairs=0, duration_s=0.5, gap_s=0.0)
        clock.t += 1.0
    assert rates.drain_rate() == pytest.approx(4 * 400 / (4 * 0.1))
    clock.t += 60.0                                  # the window forgot them: the prior again
    assert rates.drain_rate() == TINY.drain_rate(512, 256)


def test_kv_bandwidth_and_the_decode_drain_are_measured_over_the_window():
    clock = FakeClock()
    rates = WorkerRates(TINY, clock=clock)
    rates.kv_written(10**6, 0.01)
    rates.kv_written(3 * 10**6, 0.01)
    rates.kv_written(5, None)                        # a write with no time is not a measurement
    for _ in range(6):
        rates.finished(blocks_freed=5)
    f = rates.fields()
    assert f["kv_transfer_bytes_per_s"] == pytest.approx(4 * 10**6 / 0.02)
    assert f["sequences_finished_per_s"] == 6 / 30.0 and f["kv_blocks_freed_per_s"] == 30 / 30.0


def test_finishes_faster_than_the_window_holds_are_counted_over_the_time_it_covers():
    """The window keeps its last 256 events: 100 sequences finishing a second filled it in 2.56 s,
    and over the whole 30 s span they read as 8.5 a second (a co-located replica's seat wait was
    predicted ~12x too long)."""
    clock = FakeClock()
    rates = WorkerRates(TINY, clock=clock)
    for _ in range(1000):
        clock.t += 0.01
        rates.finished(blocks_freed=2)
    f = rates.fields()
    assert f["sequences_finished_per_s"] == pytest.approx(100.0, rel=0.01)
    assert f["kv_blocks_freed_per_s"] == pytest.approx(200.0, rel=0.01)


def test_priors_from_a_cost_model_and_by_model_size_are_positive():
    prior = prior_from_timer(CostModel.for_target("llama-3-8b", "h200", 1, "bf16"), "cost-model")
    assert prior.step_s > 0 and prior.s_per_token > 0 and prior.drain_rate(2048, 512) > 1000
    assert default_prior(2048) == TINY
    bigger = default_prior(46080)
    assert bigger.s_per_token > TINY.s_per_token and bigger.drain_rate(512, 256) < TINY.drain_rate(512, 256)


def test_the_step_in_flight_is_the_one_that_began_as_the_last_ended_while_the_engine_is_busy():
    """A step's news comes when it ends; back to back, the next began then. The worker publishes
    that start (its wall clock) and the last step's length, and no step while its engine is idle;
    and the prompt tokens it prefilled per wall second (decode-only steps add none)."""
    clock, wall = FakeClock(), FakeClock()
    rates = WorkerRates(TINY, clock=clock, wall=wall)
    assert rates.fields()["step_predicted_s"] == 0.0            # no step yet
    for k in range(10):
        clock.t += 0.5
        wall.t = 1_000.0 + clock.t
        rates.on_step(prefill_tokens=200, decode_tokens=0, pairs=200 * 201 // 2,
                      duration_s=0.04, gap_s=0.0)
    rates.on_step(prefill_tokens=0, decode_tokens=8, pairs=800, duration_s=0.02, gap_s=0.0)
    f = rates.fields(busy=True)
    assert (f["step_started_unix_s"], f["step_predicted_s"]) == (1_005.0, 0.02)
    assert f["prefill_tokens_per_wall_s"] == pytest.approx(200 * 10 / 5.0)   # a 5-s window
    idle = rates.fields(busy=False)
    assert (idle["step_started_unix_s"], idle["step_predicted_s"]) == (0.0, 0.0)


def test_the_prefill_throughput_is_published_by_class_when_the_steps_say_it():
    """Steps that say their prefill tokens by class publish the throughput of each over the
    same window as the total; steps that do not say publish none by class."""
    clock = FakeClock()
    rates = WorkerRates(TINY, clock=clock, wall=clock)
    rates.on_step(prefill_tokens=300, decode_tokens=0, pairs=0, duration_s=0.04, gap_s=0.0)
    assert rates.fields()["prefill_tokens_per_wall_s_by_class"] == {}
    clock.t = 5.5                                    # that step is out of the window at the end
    for _ in range(10):
        clock.t += 0.5
        rates.on_step(prefill_tokens=300, decode_tokens=0, pairs=0, duration_s=0.04, gap_s=0.0,
                      prefill_by_class={"interactive": 100, "document": 200})
    f = rates.fields()
    assert f["prefill_tokens_per_wall_s_by_class"] == pytest.approx(
        {"interactive": 100 * 10 / 5.0, "document": 200 * 10 / 5.0})
    assert f["prefill_tokens_per_wall_s"] == pytest.approx(300 * 10 / 5.0)


BUDGET, CHUNK = 2048, 512          # `kvfleet up --model tiny`'s prefill worker


def document_steps(documents: int = 4, tokens: int = 8000):
    """(prefill tokens, pairs, fresh pairs) of the steps that prefill `documents` prompts of
    `tokens` side by side, each a chunk a step, deeper every step."""
    done = 0
    while done < tokens:
        n = min(CHUNK, tokens - done)
        yield (documents * n, documents * attention_pairs(done, n),
               documents * attention_pairs(0, n))
        done += n


def chat_steps(chats: int, tokens: int = 200):
    """The steps of a burst of `chats` fresh prompts: as many whole prompts as the budget holds."""
    per_step = BUDGET // tokens
    for first in range(0, chats, per_step):
        k = min(per_step, chats - first)
        yield k * tokens, k * attention_pairs(0, tokens), k * attention_pairs(0, tokens)


def chat_prediction(rates: WorkerRates, queued_chats: int) -> float:
    """The router's TTFT for a 200-token chat behind `queued_chats` others, from what `rates`
    publishes (no step in flight: the beat is older than the worker's step)."""
    from services.router.predict import predict   # noqa: PLC0415 - the router's side of it
    stats = pb.WorkerStats(**rates.fields(busy=False), role="prefill",
                           queued_prefill_tokens=200 * queued_chats)
    return predict(stats, 200).total_s


@settings(max_examples=20, deadline=None)
@given(step_s=st.floats(1e-3, 0.1), per_token=st.floats(1e-4, 6e-4),
       per_pair=st.floats(3e-8, 3e-7), gap_s=st.floats(0.0, 0.02))
def test_a_document_burst_does_not_price_the_next_bursts_chats(step_s, per_token, per_pair,
                                                               gap_s):
    """A prefill worker ran four 8K documents side by side, their chunks deeper every step (up to
    ~3x a chat's cost a token), then a burst of 50 chats. What it publishes prices the next chat
    as the chats' own steps do: as a worker that ran only those chats predicts it, not by the
    documents' slower steps (the fleet measured 2-5x too slow, refusing 23 of 32; this law, kept
    as measured: 2.2-2.4x). Within 20%: the documents' steps, timed at depth 0, still carry
    512-token chunks' own attention where the chats' carry 200-token ones (up to +16% at 1e-4 s
    a token, the cheapest drawn here; 2-5% at the fleet's fits, 3-6e-4 s a token)."""
    law = Prior(step_s, per_token, per_pair, "the machine")
    clock = FakeClock()
    after_documents = WorkerRates(TINY, token_budget=BUDGET, chunk_size=CHUNK, clock=clock)
    chats_only = WorkerRates(TINY, token_budget=BUDGET, chunk_size=CHUNK, clock=clock)
    warm_fit = list(synthetic_steps(7, 300))        # both know the machine's cost as well
    for rates in (after_documents, chats_only):
        for tokens, pairs in warm_fit:
            rates.fit.observe(tokens, pairs, law.step_time(tokens, pairs))
    for tokens, pairs, fresh in document_steps():
        clock.t += 0.1
        after_documents.on_step(tokens, 0, pairs, law.step_time(tokens, pairs), gap_s, fresh)
    for tokens, pairs, fresh in chat_steps(50):
        clock.t += 0.1
        for rates in (after_documents, chats_only):
            rates.on_step(tokens, 0, pairs, law.step_time(tokens, pairs), gap_s, fresh)
    truth = chat_prediction(chats_only, queued_chats=20)
    assert chat_prediction(after_documents, queued_chats=20) == pytest.approx(truth, rel=0.2)


def test_a_deep_step_is_timed_at_depth_0_for_the_drain_rate_and_the_recent_step():
    """A step of one 512-token chunk 8K tokens deep: the drain rate and the recent step count
    the time it would have taken at position 0 (the fit's ratio); the fit itself keeps the
    measured time; a fresh step (or one that does not say) is counted as measured."""
    clock = FakeClock()
    rates = WorkerRates(TINY, clock=clock)
    deep, fresh = attention_pairs(8192, 512), attention_pairs(0, 512)
    for _ in range(4):
        rates.on_step(512, 0, deep, TINY.step_time(512, deep), 0.0, fresh)
    shallow_s = TINY.step_time(512, fresh)
    assert rates.fields()["prefill_recent_step_s"] == pytest.approx(shallow_s, rel=0.02)
    assert rates.drain_rate() == pytest.approx(512 / shallow_s, rel=0.02)
    assert rates.fit.step_time(512, deep) == pytest.approx(TINY.step_time(512, deep), rel=0.02)
    unsaid = WorkerRates(TINY, clock=clock)
    for _ in range(4):
        unsaid.on_step(512, 0, deep, TINY.step_time(512, deep), 0.0)
    assert unsaid.drain_rate() == pytest.approx(512 / TINY.step_time(512, deep))


def document_alone_s(step_time, tokens: int = 8000) -> float:
    """An 8K prompt's prefill on an idle worker, a chunk a step, through `step_time`."""
    return sum(step_time(n, pairs) for n, pairs, _ in document_steps(1, tokens))


def mixed_chat_steps(seed: int, steps: int):
    """(tokens, pairs) of chat bursts' steps: 1-10 prompts of one length (150-250 tokens, drawn
    per burst, as `kvfleet bench burst` sends them), so a step's pairs grow with its tokens."""
    import random
    rnd = random.Random(seed)
    for _ in range(steps):
        length, k = rnd.randint(150, 250), rnd.randint(1, BUDGET // 250)
        yield k * length, k * attention_pairs(0, length)


TINY_RATIO = TINY.s_per_pair / TINY.s_per_token


@settings(max_examples=25, deadline=None)
@given(step_s=st.floats(1e-3, 0.02), per_token=st.floats(1e-4, 6e-4),
       ratio=st.floats(0.7, 1.4), noise=st.floats(0.0, 0.25), seed=st.integers(0, 1000))
def test_a_fit_that_saw_only_chats_prices_a_deep_document_within_half_again(step_s, per_token,
                                                                             ratio, noise, seed):
    """A worker whose machine runs 0.7-4x slower than the prior says (a loaded box) has prefilled
    only chat bursts, each step timed within +-`noise` of the law. Its first 8K document is
    priced within 1.5x of what the law takes: the pairs-to-token ratio the prior carries (here
    within 0.7-1.4x the machine's) holds while the chats' steps cannot tell a pair from a token.
    Without it (`ratio_weight=0`) noisy chat steps let the pair cost drift past 1.5x at the
    prior's own ratio (the CPU fleet's first mixed burst: ~5x, docs/benchmarks.md "a8burst")."""
    import random
    law = Prior(step_s, per_token, per_token * TINY_RATIO * ratio, "the machine")
    rnd = random.Random(seed)
    rates = WorkerRates(TINY, token_budget=BUDGET, chunk_size=CHUNK, clock=FakeClock())
    for tokens, pairs in mixed_chat_steps(seed, 300):
        rates.on_step(tokens, 0, pairs, law.step_time(tokens, pairs) * rnd.uniform(
            1 - noise, 1 + noise), 0.0, pairs)
    truth = document_alone_s(law.step_time)
    assert truth / 1.5 <= document_alone_s(rates.fit.step_time) <= 1.5 * truth


@settings(max_examples=20, deadline=None)
@given(per_token=st.floats(1e-4, 6e-4), ratio=st.sampled_from([0.25, 4.0]),
       seed=st.integers(0, 1000))
def test_the_prior_ratio_gives_way_to_deep_steps(per_token, ratio, seed):
    """The machine's pair costs 4x more (or less) of a token than the prior says: after chat
    bursts and one burst of four 8K documents (16 steps of 512-token chunks, each deeper), the
    next document is priced within 10% of the law, the kept ratio outweighed."""
    law = Prior(0.005, per_token, per_token * TINY_RATIO * ratio, "the machine")
    rates = WorkerRates(TINY, token_budget=BUDGET, chunk_size=CHUNK, clock=FakeClock())
    for tokens, pairs in mixed_chat_steps(seed, 100):
        rates.on_step(tokens, 0, pairs, law.step_time(tokens, pairs), 0.0, pairs)
    chats_only = document_alone_s(rates.fit.step_time)
    for tokens, pairs, fresh in document_steps():
        rates.on_step(tokens, 0, pairs, law.step_time(tokens, pairs), 0.0, fresh)
    truth, priced = document_alone_s(law.step_time), document_alone_s(rates.fit.step_time)
    assert priced == pytest.approx(truth, rel=0.1)
    assert abs(chats_only - truth) > 2 * abs(priced - truth)   # the chats alone held the prior


@settings(max_examples=30, deadline=None)
@given(step_s=st.floats(1e-4, 0.1), per_token=st.floats(1e-6, 1e-2),
       per_pair=st.floats(0.0, 1e-6))
@example(step_s=1e-4, per_token=0.0078125, per_pair=8.090481575772747e-08)   # failed at 1e-6
def test_a_warm_up_profile_is_fitted_to_the_coefficients_its_steps_took(step_s, per_token,
                                                                         per_pair):
    """The default warm-up shapes, timed with a known law: the measured prior is that law, the
    pair cost included when it is 0 (never negative)."""
    law = Prior(step_s, per_token, per_pair, "law")
    steps = [MeasuredStep(sum(n for n, _ in s.prefill), len(s.decodes), s.pairs,
                          law.step_time(s.tokens, s.pairs))
             for s in default_shapes(2048, 512, 256, 8192)]      # decode-only ones left out
    fitted = prior_from_steps(steps, "measured-at-start: test")
    assert fitted.source == "measured-at-start: test"
    assert min(fitted.step_s, fitted.s_per_token, fitted.s_per_pair) >= 0
    # each coefficient to float64's precision of the steps it is solved from: a 0.1 ms fixed
    # cost beside 16 s of tokens is known to ~1e-9 of those 16 s, not to 1e-6 of itself
    longest = max(s.seconds for s in steps)
    assert fitted.step_s == pytest.approx(step_s, rel=1e-6, abs=1e-9 * longest)
    assert fitted.s_per_token == pytest.approx(
        per_token, rel=1e-6, abs=1e-9 * longest / max(s.prefill_tokens for s in steps))
    assert fitted.s_per_pair == pytest.approx(
        per_pair, rel=1e-6, abs=1e-9 * longest / max(s.pairs for s in steps))


def test_noisy_steps_that_would_fit_a_negative_cost_fit_it_at_zero():
    """Steps whose free fit has a negative fixed cost (a small step slower than its share): the
    fixed cost is 0 and the rest the best fit without it."""
    steps = [MeasuredStep(n, 0, 0, t) for n, t in ((100, 0.004), (200, 0.010), (300, 0.016),
                                                   (400, 0.022))]    # 6e-5 s a token - 2 ms
    fitted = prior_from_steps(steps, "s")
    assert fitted.step_s == 0 and fitted.s_per_pair == 0
    assert 4e-5 < fitted.s_per_token < 6e-5
    for s in steps:
        assert fitted.step_time(s.prefill_tokens, 0) == pytest.approx(s.seconds, rel=0.25)


def test_decode_only_warm_up_steps_do_not_price_prompts():
    """A decode-only step (its tokens ~5x a prefill token's on this CPU) is left out of the fit,
    as CostFit leaves it out: the prefill steps alone set the law."""
    law = Prior(0.004, 1e-4, 1e-7, "law")
    prefill = [MeasuredStep(n, 0, attention_pairs(0, n), law.step_time(n, attention_pairs(0, n)))
               for n in (64, 200, 512)]
    decodes = [MeasuredStep(0, 16, 4096, 0.004 + 16 * 5e-4)]
    fitted = prior_from_steps(prefill + decodes, "s")
    assert fitted.s_per_token == pytest.approx(1e-4, rel=1e-6)
    assert prior_from_steps(decodes * 3, "s") is None


def test_too_few_warm_up_steps_give_no_prior():
    one_size = [MeasuredStep(64, 0, 2080, 0.01)] * 3
    assert prior_from_steps(one_size, "s") is None
    assert prior_from_steps(one_size[:1] + [MeasuredStep(128, 0, 8256, 0.02)], "s") is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-3, 3), min_size=9, max_size=9), st.lists(st.floats(-3, 3), min_size=3,
                                                                      max_size=3))
def test_the_non_negative_solve_meets_its_optimality_conditions(entries, moment):
    """For any positive definite normal equations the coefficients are >= 0, and optimal (KKT):
    the objective's gradient is 0 along every coefficient above 0 and >= 0 along every one held
    at 0."""
    m = np.array(entries).reshape(3, 3)
    info, moment = m @ m.T + 0.1 * np.eye(3), np.array(moment)
    theta = nonnegative_solve(info, moment)
    gradient = info @ theta - moment
    assert (theta >= 0).all()
    tol = 1e-7 * (1 + np.abs(moment).max())
    assert all(abs(g) <= tol if t > 0 else g >= -tol for t, g in zip(theta, gradient))


def test_a_cold_worker_whose_steps_are_all_one_size_is_priced_at_what_they_took():
    """A worker started from a prior ~800x too slow (SmolLM2's CPU figures) whose measured steps
    are all 2,048-token chat steps of 16 ms: as the prior is forgotten the fit prices that step at
    what it took. Clipping the unconstrained solve kept a negative fixed cost's compensating
    per-token cost: the step stayed priced at ~2.5 s after 300 steps, and a cold worker probed for
    its pace was never priced by it."""
    fit = CostFit(SMOLLM2)
    pairs = 10 * attention_pairs(0, 200)
    prior_s = SMOLLM2.step_time(2000, pairs)
    for _ in range(60):
        fit.observe(2000, pairs, 0.016)
    assert fit.step_time(2000, pairs) < prior_s / 50
    for _ in range(240):
        fit.observe(2000, pairs, 0.016)
    assert fit.step_time(2000, pairs) == pytest.approx(0.016, rel=0.05)
