"""vLLM's logits processors (services/engine/logits_process.py) and the sampler's use of them, on
hand-made logits: what each one does to a row, in which order, and what logprobs report."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.logits_process import LogitsProcessors, apply_min_p
from services.engine.sampler import Sampler
from services.engine.sampling_params import SamplingParams

EOS = 7


@dataclass(eq=False)   # identity-hashed, like Request (the processors cache per request)
class Hist:
    params: SamplingParams
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    eos_token_ids: frozenset[int] = frozenset({EOS})

    @property
    def token_ids(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)


def process(logits: list[float], p: SamplingParams, prompt=(0,), output=()) -> list[float]:
    row = torch.tensor([logits], dtype=torch.float32)
    return LogitsProcessors()(row, [p], [Hist(p, list(prompt), list(output))])[0].tolist()


def sample(logits: torch.Tensor, params: list[SamplingParams], hists, mode="raw_logprobs"):
    return Sampler(seed=0, logprobs_mode=mode)(logits, params, [None] * len(params), hists)


# ------------------------------------------------------------------------ each processor


def test_repetition_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    # token 0 in the prompt, token 1 in the output, tokens 2 and 3 never seen
    assert process([4.0, -4.0, 4.0, -4.0], p, prompt=[0], output=[1]) == [2.0, -8.0, 4.0, -4.0]


def test_presence_and_frequency_count_output_tokens_only():
    p = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
    # token 1 three times in the output, token 2 once; token 0 only in the prompt
    out = process([1.0, 1.0, 1.0, 1.0], p, prompt=[0, 0], output=[1, 2, 1, 1])
    assert out == [1.0, 1.0 - 0.75 - 0.5, 1.0 - 0.25 - 0.5, 1.0]


def test_negative_penalties_reward_repeats():
    p = SamplingParams(temperature=0, presence_penalty=-1.0, repetition_penalty=0.5)
    assert process([2.0, 2.0], p, prompt=[0], output=[1]) == [4.0, 2.0 / 0.5 + 1.0]


def test_logit_bias_adds_and_comes_before_the_penalties():
    # bias first: (-1 + 3) / 4 = 0.5; the other order would give -1 * 4 + 3 = -1
    p = SamplingParams(temperature=0, logit_bias={0: 3.0, 2: -100.0}, repetition_penalty=4.0)
    assert process([-1.0, 0.0, 5.0], p, prompt=[0]) == [0.5, 0.0, -95.0]


def test_min_tokens_masks_eos_and_stop_token_ids_until_enough_outputs():
    p = SamplingParams(min_tokens=2, stop_token_ids=(3,))
    masked = process([1.0] * 8, p, output=[5])
    assert [i for i, v in enumerate(masked) if v == -math.inf] == [3, EOS]
    assert process([1.0] * 8, p, output=[5, 5]) == [1.0] * 8    # two outputs: nothing barred


def test_rows_that_ask_for_nothing_are_left_alone():
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    plain = SamplingParams(temperature=0)
    hists = [Hist(plain, [1, 2, 3], [4, 5]) for _ in range(3)]
    LogitsProcessors()(logits, [plain] * 3, hists)
    assert torch.equal(logits, before)


def test_min_p_keeps_tokens_with_at_least_min_p_of_the_top_probability():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = apply_min_p(probs.log(), torch.tensor([0.5])) > -math.inf
    assert kept.tolist() == [[True, True, False, False]]       # 0.15 < 0.5 * 0.5


# ---------------------------------------------------------------- in the sampler


def test_greedy_with_a_penalty_picks_the_penalized_argmax():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(logits, [p], [Hist(p, [0])])[0].token_id == 1            # 3 / 2 < 2
    assert sample(logits, [p], [Hist(p, [2])])[0].token_id == 0


def test_min_p_and_top_k_filter_sampled_rows_only():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(400, -1).contiguous()
    p = SamplingParams(temperature=1.0, min_p=0.5)
    drawn = {t.token_id for t in sample(logits, [p] * 400, [Hist(p, [0])] * 400)}
    assert drawn == {0, 1}


def test_raw_logprobs_are_the_models_and_processed_ones_what_was_sampled_from():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    greedy = SamplingParams(temperature=0, logprobs=1, logit_bias={3: 10.0})
    raw = sample(logits, [greedy], [Hist(greedy, [0])])[0]
    processed = sample(logits, [greedy], [Hist(greedy, [0])], "processed_logprobs")[0]
    assert raw.token_id == processed.token_id == 3
    assert raw.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[3].item())
    biased = logits[0] + torch.tensor([0.0, 0.0, 0.0, 10.0])
    assert processed.logprob == pytest.approx(torch.log_softmax(biased, -1)[3].item())


def test_processed_logprobs_of_a_sampled_row_are_minus_inf_outside_its_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = SamplingParams(temperature=0.5, top_k=2, logprobs=3, seed=1)
    out = sample(logits, [p], [Hist(p, [0])], "processed_logprobs")[0]
    kept = torch.log_softmax(logits[0, :2] / 0.5, -1).tolist()
    assert [v for _, v in out.top] == pytest.approx(kept + [-math.inf])


def test_logit_bias_applies_without_a_history_and_penalties_need_one():
    p = SamplingParams(temperature=0, logit_bias={2: 50.0}, repetition_penalty=100.0)
    assert Sampler()(torch.zeros(1, 4), [p], [None])[0].token_id == 2


def test_a_bad_logprobs_mode_is_refused():
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler(logprobs_mode="raw_logits")


# ---------------------------------------------------------------------------- properties

_logits = st.lists(st.floats(-20, 20, width=32), min_size=8, max_size=8)
_ids = st.lists(st.integers(0, 7), max_size=6)
_penalties = st.builds(SamplingParams, temperature=st.just(0.0),
                       repetition_penalty=st.floats(0.1, 3.0), presence_penalty=st.floats(-2, 2),
                       frequency_penalty=st.floats(-2, 2))


@settings(max_examples=60, deadline=None)
@given(_logits, _penalties, _ids, _ids)
def test_penalties_change_only_tokens_the_row_has_seen(logits, p, prompt, output):
    out = process(logits, p, prompt=prompt, output=output)
    seen = set(prompt) | set(output)
    assert all(o == v for t, (o, v) in enumerate(zip(out, logits)) if t not in seen)
    if not output:            # presence / frequency look at the output only
        assert all(o == v for t, (o, v) in enumerate(zip(out, logits)) if t not in prompt)


@settings(max_examples=60, deadline=None)
@given(_logits, st.integers(1, 5), st.integers(0, 6), st.floats(0, 2),
       st.sampled_from([0, 0.7]), st.integers(0, 2**31))
def test_min_tokens_never_yields_a_stop_token_early(logits, min_tokens, done, eos_bias,
                                                    temperature, seed):
    # EOS (7) and stop token 6 made likely; `done` outputs so far
    p = SamplingParams(temperature=temperature, min_tokens=min_tokens, stop_token_ids=(6,),
                       seed=seed, logit_bias={EOS: eos_bias * 10, 6: eos_bias * 10})
    row = torch.tensor([logits], dtype=torch.float32)
    token = sample(row, [p], [Hist(p, [0], [1] * done)])[0].token_id
    if done < min_tokens:
        assert token not in (6, EOS)


@settings(max_examples=60, deadline=None)
@given(_logits, st.integers(0, 7))
def test_a_logit_bias_of_100_forces_the_token_under_greedy(logits, token):
    p = SamplingParams(temperature=0, logit_bias={token: 100.0})
    row = torch.tensor([logits], dtype=torch.float32)
    assert sample(row, [p], [Hist(p, [0])])[0].token_id == token
