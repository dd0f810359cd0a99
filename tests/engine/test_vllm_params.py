"""vLLM's extra request fields outside the sampler: their validation, `priority` in the
scheduler's queues, and the detokenizer's special-token options. (The sampler's side:
test_logits_process.py; against vLLM itself: test_sampling_params_vllm.py.)"""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from services.engine import errors
from services.engine.config_file import engine_config_from_dict
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.fairness import priority_slot
from services.engine.request import Status
from services.engine.sampling_params import (INT32, MAX_N, MAX_PENALTY, SamplingParams,
                                             validate_sampling)
from tests.engine.scheduler_helpers import add, make_scheduler, step

VOCAB = 32


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize("changes, param, limits", [
    ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
    ({"repetition_penalty": math.inf}, "repetition_penalty", "> 0"),
    ({"presence_penalty": 2.5}, "presence_penalty", f"[{-MAX_PENALTY}, {MAX_PENALTY}]"),
    ({"frequency_penalty": -2.01}, "frequency_penalty", f"[{-MAX_PENALTY}, {MAX_PENALTY}]"),
    ({"min_p": 1.5}, "min_p", "[0, 1]"),
    ({"min_p": math.nan}, "min_p", "[0, 1]"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", "[0, max_tokens=8]"),
    ({"min_tokens": -1}, "min_tokens", "[0, max_tokens=16]"),
    ({"logit_bias": {VOCAB: 1.0}}, "logit_bias", f"[0, {VOCAB})"),
    ({"logit_bias": {1: math.nan}}, "logit_bias", "[-100.0, 100.0]"),
    ({"n": 0}, "n", f"[1, {MAX_N}]"),
    ({"n": MAX_N + 1}, "n", f"[1, {MAX_N}]"),
    ({"priority": INT32[1] + 1}, "priority", f"[{INT32[0]}, {INT32[1]}]"),
    ({"skip_special_tokens": 1}, "skip_special_tokens", "true or false"),
])
def test_each_new_bound_is_named_in_the_message(changes, param, limits):
    with pytest.raises(errors.InvalidSamplingError) as info:
        validate_sampling(SamplingParams(**changes), VOCAB)
    assert info.value.param == param and limits in info.value.message, info.value.message


def test_the_new_limits_themselves_pass():
    validate_sampling(SamplingParams(
        repetition_penalty=1e-3, presence_penalty=-MAX_PENALTY, frequency_penalty=MAX_PENALTY,
        min_p=1.0, min_tokens=16, max_tokens=16, logit_bias={0: -100.0, VOCAB - 1: 100.0},
        n=MAX_N, priority=INT32[0], include_stop_str_in_output=True, skip_special_tokens=False,
        spaces_between_special_tokens=False), VOCAB)


def test_logit_bias_is_clamped_like_vllm_and_a_mapping_equals_its_pairs():
    p = SamplingParams(logit_bias={5: 300.0, 2: -math.inf, 3: 1})
    assert p.logit_bias == ((2, -100.0), (3, 1.0), (5, 100.0))
    assert p == SamplingParams(logit_bias=[(5, 100.0), (3, 1.0), (2, -100.0)])


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.integers(0, VOCAB - 1), st.floats(allow_nan=False), max_size=5))
def test_any_finite_or_infinite_bias_in_vocab_passes_and_lands_in_range(bias):
    p = SamplingParams(logit_bias=bias)
    validate_sampling(p, VOCAB)
    assert all(-100.0 <= b <= 100.0 for _, b in p.logit_bias)


def test_logprobs_mode_is_an_engine_config_key_and_unknown_modes_are_refused():
    assert engine_config_from_dict({"logprobs_mode": "processed_logprobs"}).logprobs_mode == (
        "processed_logprobs")
    assert engine_config_from_dict({}).logprobs_mode == "raw_logprobs"     # vLLM's default
    with pytest.raises(ValueError, match="raw_logprobs|processed_logprobs"):
        engine_config_from_dict({"logprobs_mode": "raw_logits"})


# -------------------------------------------------------------------------------- priority


def test_priority_slot_is_behind_equal_or_lower_values_and_admitted_requests():
    rank = lambda x: x                      # noqa: E731 - the queue holds ranks directly
    assert priority_slot([0, 0, 0], 0, rank) == 3                 # ties: FCFS
    assert priority_slot([0, 5, 5], 1, rank) == 1                 # lower value first
    assert priority_slot([None, 5], -1, rank) == 1                # an admitted head keeps its place
    assert priority_slot([], 3, rank) == 0


def test_lower_priority_values_are_admitted_first_within_a_class_and_tenant():
    sched, _ = make_scheduler(token_budget=16, chunk_size=16, max_running=16)
    late = [add(sched, 12, priority=p, prompt=[10 + i] * 12) for i, p in enumerate((5, 0, -3, 0))]
    other = add(sched, 12, tenant="b", priority=9)               # another tenant: its own queue
    order = []                                                    # first prefill chunk order
    for _ in range(8):
        order += [c.request for c in step(sched).prefills if c.request not in order]
    mine = [r for r in order if r.tenant == "a"]
    assert mine == [late[2], late[1], late[3], late[0]]            # -3, 0, 0 (FCFS), 5
    assert other in order and other.status != Status.WAITING


def test_a_class_ages_from_its_oldest_request_whatever_priority_put_at_its_head():
    sched, clock = make_scheduler(token_budget=16, chunk_size=16, max_running=16)
    add(sched, 16, cls="document", prompt=[20] * 16, clock=clock)            # waits from t=0
    clock.now = 20.0                                                        # 2 aging steps
    urgent = add(sched, 16, cls="document", prompt=[21] * 16, clock=clock, priority=-5)
    add(sched, 16, cls="interactive", prompt=[22] * 16, clock=clock)
    # document: 1 + 20 s / 10 s = 3 beats interactive's 2, though its head arrived just now
    assert step(sched).prefills[0].request is urgent


# ------------------------------------------------------------------------- special tokens


@pytest.fixture(scope="module")
def spaced():
    """A word-level tokenizer with no decoder: `tokenizers` joins its tokens with spaces, so
    spaces_between_special_tokens shows."""
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<X>", "<Y>"])
    return tok


def pushed(tok, ids, **options) -> str:
    detok = IncrementalDetokenizer(tok, [0], **options)
    return "".join(detok.push(t) for t in ids) + detok.flush()


def test_special_tokens_skip_or_stay_and_without_spaces_abut(spaced):
    x, y = spaced.token_to_id("<X>"), spaced.token_to_id("<Y>")
    ids = [1, x, y, 0]
    assert pushed(spaced, ids) == " b a"
    assert pushed(spaced, ids, skip_special_tokens=False) == " b <X> <Y> a"
    # vLLM: an added token right after another one is its bare content
    assert pushed(spaced, ids, skip_special_tokens=False,
                  spaces_between_special_tokens=False) == " b <X><Y> a"
