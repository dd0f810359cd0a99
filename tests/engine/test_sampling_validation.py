"""One sampling validation for gateway and engine (services/engine/sampling_params.py): what it
accepts the sampler runs; what it refuses gets a typed error naming the field and its range."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine import errors
from services.engine.sampler import Sampler, make_generator, prompt_logprobs
from services.engine.sampling_params import (INT64, MAX_LOGPROBS, MAX_STOP_STRINGS, MAX_TEMPERATURE,
                                             SamplingParams, validate_sampling)

VOCAB = 32

_stops = st.lists(st.text(min_size=1, max_size=3), max_size=MAX_STOP_STRINGS).map(tuple)
_counts = st.none() | st.integers(0, MAX_LOGPROBS)
in_range = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 10), temperature=st.floats(0, MAX_TEMPERATURE),
    top_k=st.integers(-1, VOCAB + 3), top_p=st.floats(0, 1, exclude_min=True),
    seed=st.none() | st.integers(*INT64), stop=_stops,
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=3).map(tuple),
    ignore_eos=st.booleans(), logprobs=_counts, prompt_logprobs=_counts)

_odd = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-5, 5) | st.booleans()
_odd_counts = st.none() | st.integers(-2, MAX_LOGPROBS + 2)
anything = st.builds(
    SamplingParams,
    max_tokens=st.integers(-2, 10) | st.booleans(), temperature=_odd, top_k=st.integers(-3, 3),
    top_p=_odd, seed=st.none() | st.integers(INT64[0] - 1, INT64[1] + 1),
    stop=st.lists(st.text(max_size=3), max_size=MAX_STOP_STRINGS + 1).map(tuple),
    stop_token_ids=st.lists(st.integers(-1, VOCAB), max_size=3).map(tuple),
    ignore_eos=st.booleans(), logprobs=_odd_counts, prompt_logprobs=_odd_counts)


def _accepted(p: SamplingParams) -> bool:
    try:
        validate_sampling(p, VOCAB)
    except errors.InvalidRequestError:
        return False
    return True


@settings(max_examples=200, deadline=None)
@given(params=in_range)
def test_every_value_inside_the_named_ranges_is_accepted(params):
    validate_sampling(params, VOCAB)


@settings(max_examples=300, deadline=None)
@given(params=in_range | anything, rows=st.integers(1, 3))
def test_whatever_the_validator_accepts_the_sampler_samples(params, rows):
    if not _accepted(params):
        return
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0))
    out = Sampler(seed=0)(logits, [params] * rows, [make_generator(params.seed)] * rows)
    assert len(out) == rows and all(0 <= t.token_id < VOCAB for t in out)
    if params.logprobs is not None:
        assert all(t.logprob <= 0.0 and len(t.top) == min(params.logprobs, VOCAB) for t in out)
    if params.prompt_logprobs is not None:
        assert len(prompt_logprobs(logits, list(range(rows)), params.prompt_logprobs)) == rows


@settings(max_examples=300, deadline=None)
@given(params=anything)
def test_a_refusal_is_typed_and_names_the_field(params):
    try:
        validate_sampling(params, VOCAB)
    except errors.InvalidRequestError as e:
        assert isinstance(e, (errors.InvalidMaxTokensError, errors.InvalidSamplingError))
        assert e.param in e.message and e.code in ("invalid_max_tokens", "invalid_sampling_params")


@pytest.mark.parametrize("changes, param, limits", [
    ({"max_tokens": 0}, "max_tokens", "positive integer"),
    ({"max_tokens": True}, "max_tokens", "positive integer"),
    ({"temperature": -0.5}, "temperature", f"[0.0, {MAX_TEMPERATURE}]"),
    ({"temperature": MAX_TEMPERATURE + 0.1}, "temperature", f"[0.0, {MAX_TEMPERATURE}]"),
    ({"temperature": math.inf}, "temperature", f"[0.0, {MAX_TEMPERATURE}]"),
    ({"top_p": 0.0}, "top_p", "(0, 1]"),
    ({"top_p": math.nan}, "top_p", "(0, 1]"),
    ({"top_k": -2}, "top_k", "-1, 0 (off) or positive"),
    ({"seed": 2**63}, "seed", f"[{INT64[0]}, {INT64[1]}]"),
    ({"logprobs": MAX_LOGPROBS + 1}, "logprobs", f"between 0 and {MAX_LOGPROBS}"),
    ({"prompt_logprobs": -1}, "prompt_logprobs", f"between 0 and {MAX_LOGPROBS}"),
    ({"stop": ("",)}, "stop", f"at most {MAX_STOP_STRINGS} non-empty strings"),
    ({"stop": ("x",) * (MAX_STOP_STRINGS + 1)}, "stop", f"at most {MAX_STOP_STRINGS}"),
    ({"stop_token_ids": (VOCAB,)}, "stop_token_ids", f"[0, {VOCAB})"),
])
def test_each_bound_is_named_in_the_message(changes, param, limits):
    with pytest.raises(errors.InvalidRequestError) as info:
        validate_sampling(SamplingParams(**changes), VOCAB)
    assert info.value.param == param and limits in info.value.message, info.value.message


def test_the_limits_themselves_pass():
    validate_sampling(SamplingParams(max_tokens=1, temperature=MAX_TEMPERATURE, top_p=1.0, top_k=-1,
                                     seed=INT64[0], logprobs=MAX_LOGPROBS, prompt_logprobs=0,
                                     stop=("s",) * MAX_STOP_STRINGS, stop_token_ids=(VOCAB - 1,)), VOCAB)
    validate_sampling(SamplingParams(stop_token_ids=(10**6,)))     # no vocab given: no upper bound
