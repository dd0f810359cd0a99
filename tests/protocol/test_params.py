"""The wire's sampling fields (kvfleet.v1.SamplingParams 1-21) read and written by
services/protocol/params.py, the one conversion the gateway and the workers share."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.sampling_params import SamplingParams
from services.protocol.params import params_from_pb, params_to_pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb

# floats the wire's float32 holds exactly, so a round trip is equality
_f32 = st.integers(-8, 8).map(lambda i: i / 4)

every_field = st.builds(
    SamplingParams, max_tokens=st.integers(1, 100), temperature=st.sampled_from([0.0, 0.5, 1.0]),
    top_k=st.integers(-1, 50), top_p=st.sampled_from([0.25, 1.0]),
    seed=st.none() | st.integers(-2**63, 2**63 - 1), stop=st.lists(st.text(min_size=1)).map(tuple),
    stop_token_ids=st.lists(st.integers(0, 1000)).map(tuple), ignore_eos=st.booleans(),
    logprobs=st.none() | st.integers(0, 20), prompt_logprobs=st.none() | st.integers(0, 20),
    n=st.integers(1, 16), repetition_penalty=st.sampled_from([0.5, 1.0, 1.25, 2.0]),
    presence_penalty=_f32.filter(lambda x: abs(x) <= 2),
    frequency_penalty=_f32.filter(lambda x: abs(x) <= 2), min_p=st.sampled_from([0.0, 0.5]),
    min_tokens=st.integers(0, 5), logit_bias=st.dictionaries(st.integers(0, 4095), _f32),
    include_stop_str_in_output=st.booleans(), skip_special_tokens=st.booleans(),
    spaces_between_special_tokens=st.booleans(), priority=st.integers(-2**31, 2**31 - 1))


@settings(max_examples=150, deadline=None)
@given(every_field)
def test_every_field_survives_the_wire(params):
    wire = pb.SamplingParams.FromString(params_to_pb(params).SerializeToString())
    assert params_from_pb(wire) == params


def test_unset_fields_read_as_vllms_defaults():
    p = params_from_pb(pb.SamplingParams(max_tokens=5))
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.min_p) == (1, 0, 0, 0)
    assert (p.min_tokens, p.logit_bias, p.n, p.priority) == (0, (), 1, 0)
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.include_stop_str_in_output


def test_set_fields_are_read_including_explicit_false():
    p = params_from_pb(pb.SamplingParams(
        max_tokens=5, repetition_penalty=1.5, skip_special_tokens=False,
        spaces_between_special_tokens=False, logit_bias={7: -2.5}, n=3, priority=-4))
    assert (p.repetition_penalty, p.logit_bias, p.n, p.priority) == (1.5, ((7, -2.5),), 3, -4)
    assert not p.skip_special_tokens and not p.spaces_between_special_tokens
