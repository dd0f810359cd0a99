"""The sampler: greedy, temperature, top-k, top-p, per-request seeds, logprobs (CPU, hand-made logits)."""
from __future__ import annotations

import math

import torch

from services.engine.sampler import Sampler, TokenLogprob, make_generator, prompt_logprobs
from services.engine.sampling_params import SamplingParams

# A hand-made 4-token distribution: p = [0.5, 0.3, 0.15, 0.05].
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def sample_many(params: SamplingParams, n: int = 4000, logits: torch.Tensor = LOGITS) -> list[int]:
    """n independent draws: one batch of n identical unseeded rows."""
    rows = logits.expand(n, -1).contiguous()
    return [t.token_id for t in Sampler(seed=0)(rows, [params] * n, [None] * n)]


def test_greedy_takes_the_argmax_without_computing_logprobs():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, [SamplingParams(temperature=0)] * 8, [None] * 8)
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()
    assert all(math.isnan(t.logprob) and t.top == () for t in out)


def test_greedy_rows_in_a_mixed_batch_still_take_the_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    greedy, sampled = SamplingParams(temperature=0), SamplingParams()
    params = [greedy, sampled, SamplingParams(temperature=0, logprobs=2), sampled]
    out = Sampler()(logits, params, [None] * 4)
    assert out[0].token_id == logits[0].argmax() and out[2].token_id == logits[2].argmax()


def test_temperature_near_zero_is_greedy_and_top_k_1_is_greedy():
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(2))
    argmax = logits.argmax(-1).tolist()
    near_zero = (SamplingParams(temperature=1e-4), SamplingParams(temperature=1e-30))
    for params in (*near_zero, SamplingParams(temperature=1.5, top_k=1)):
        assert [t.token_id for t in Sampler()(logits, [params] * 64, [None] * 64)] == argmax


def test_top_k_never_samples_outside_the_top_k():
    assert set(sample_many(SamplingParams(top_k=2))) == {0, 1}
    assert set(sample_many(SamplingParams(top_k=3, temperature=3.0))) == {0, 1, 2}


def test_top_p_samples_exactly_the_nucleus():
    # Smallest prefix of [0.5, 0.3, 0.15, 0.05] whose mass >= top_p; always at least one token.
    assert set(sample_many(SamplingParams(top_p=0.4))) == {0}
    assert set(sample_many(SamplingParams(top_p=0.6))) == {0, 1}
    assert set(sample_many(SamplingParams(top_p=0.9))) == {0, 1, 2}
    assert set(sample_many(SamplingParams(top_p=1e-9))) == {0}


def test_top_p_applies_to_the_distribution_left_by_top_k():
    # After top_k=2 the mass is [0.625, 0.375]: top_p=0.6 keeps token 0 alone
    # (applied to the full distribution it would keep {0, 1}).
    assert set(sample_many(SamplingParams(top_k=2, top_p=0.6))) == {0}


def test_sampling_follows_softmax_of_logits_over_temperature():
    n = 20000
    for temperature in (1.0, 0.5):
        expected = torch.softmax(LOGITS / temperature, -1) * n
        draws = torch.tensor(sample_many(SamplingParams(temperature=temperature), n))
        counts = torch.bincount(draws, minlength=4)
        chi_square = float(((counts - expected) ** 2 / expected).sum())
        assert chi_square < 25.0, (temperature, counts.tolist(), expected.tolist())  # 3 dof: p ~ 1e-5


def test_a_seeded_request_draws_the_same_tokens_alone_or_in_any_batch():
    vocab, steps = 1000, 6
    step_logits = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(3))
    noise = torch.randn(steps, 4, vocab, generator=torch.Generator().manual_seed(4))
    seeded = SamplingParams(seed=42, top_k=50, temperature=1.3)

    def run_alone() -> list[int]:
        generator = make_generator(42)
        sampler = Sampler(seed=0)
        return [sampler(step_logits[s : s + 1], [seeded], [generator])[0].token_id for s in range(steps)]

    def run_in_batch() -> list[int]:
        # Other rows: another seeded request, an unseeded one, a top-p row (forces a full-vocab sort),
        # and a greedy row wanting logprobs. The engine-wide seed differs too.
        greedy_with_logprobs = SamplingParams(temperature=0, logprobs=3)
        params = [SamplingParams(seed=7), SamplingParams(), seeded, SamplingParams(top_p=0.9), greedy_with_logprobs]
        mine, other_generator, sampler, tokens = make_generator(42), make_generator(7), Sampler(seed=123), []
        for s in range(steps):
            rows = torch.cat([noise[s, :2], step_logits[s : s + 1], noise[s, 2:]])
            tokens.append(sampler(rows, params, [other_generator, None, mine, None, None])[2].token_id)
        return tokens

    alone = run_alone()
    assert alone == run_alone() == run_in_batch()
    assert len(set(alone)) > 1  # it really sampled


def test_unseeded_requests_are_reproducible_from_the_engine_seed():
    logits = torch.randn(16, 200, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams()] * 16
    first = [t.token_id for t in Sampler(seed=9)(logits, params, [None] * 16)]
    assert first == [t.token_id for t in Sampler(seed=9)(logits, params, [None] * 16)]
    assert first != [t.token_id for t in Sampler(seed=10)(logits, params, [None] * 16)]


def test_logprobs_are_of_the_raw_distribution_with_sorted_top_n():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(6))
    params = [
        SamplingParams(temperature=0.5, top_k=5, logprobs=4), SamplingParams(logprobs=0), SamplingParams()
    ]
    out = Sampler()(logits, params, [make_generator(1), None, None])
    raw = torch.log_softmax(logits, -1)  # before temperature / top-k
    for row in (0, 1):
        assert math.isclose(out[row].logprob, raw[row, out[row].token_id].item(), rel_tol=1e-6)
    top_values, top_ids = raw[0].topk(4)
    assert [t for t, _ in out[0].top] == top_ids.tolist()
    assert [lp for _, lp in out[0].top] == sorted((lp for _, lp in out[0].top), reverse=True)
    assert all(math.isclose(a, b, rel_tol=1e-6) for (_, a), b in zip(out[0].top, top_values.tolist()))
    assert out[1].top == ()  # logprobs=0: the chosen token only
    assert math.isnan(out[2].logprob) and out[2].top == ()  # not requested


def test_prompt_logprobs_score_each_actual_next_prompt_token():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(7))
    next_ids = [3, 17, 0, 39, 17]
    out = prompt_logprobs(logits, next_ids, top_n=2)
    for i, entry in enumerate(out):
        manual = logits[i, next_ids[i]] - torch.logsumexp(logits[i], -1)
        assert entry.token_id == next_ids[i]
        assert math.isclose(entry.logprob, manual.item(), rel_tol=1e-5)
        assert [t for t, _ in entry.top] == logits[i].topk(2).indices.tolist()
    assert prompt_logprobs(logits[:0], [], top_n=2) == []
    assert prompt_logprobs(logits[:1], [3], top_n=0)[0].top == ()
    assert isinstance(out[0], TokenLogprob)
