"""A co-located fleet (router + mixed worker processes, real Redis) serves the same greedy tokens
as the in-process engine (token ids only: the gateway makes the text), and a cancelled stream
frees everything on the worker."""
from __future__ import annotations


import pytest

from tests.waiting import wait_until
from services.protocol import status
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.engine.engine import LLMEngine, engine_config
from services.engine.sampling_params import SamplingParams
from tests.harness import route_request, running_fleet

# one fleet for the module: its first test's claim (greedy tokens equal the engine's) needs the model
pytestmark = pytest.mark.real_model("greedy tokens equal the in-process engine's")

PROMPT = [4080, 39, 72, 311, 464, 68, 500, 501, 502, 503]


@pytest.fixture(scope="module")
def fleet(redis_url, tiny_model_dir):
    with running_fleet(redis_url, str(tiny_model_dir), "colocated", decode=1,
                       engine="real") as f:
        assert wait_until(lambda: f.router_stub().Health(pb.HealthRequest()).status ==
                          pb.HealthResponse.SERVING, 10)
        yield f


def test_greedy_tokens_equal_the_in_process_engine(fleet, tiny_model_dir):
    chunks = list(fleet.generate(route_request("c1", PROMPT, 12, ignore_eos=True)))
    tokens = [t for c in chunks for t in c.token_ids]
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    engine = LLMEngine(engine_config(str(tiny_model_dir), kv_cache_mib=8))
    (ref,) = engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0,
                                                      ignore_eos=True))
    assert tokens == ref.token_ids


def test_the_workers_chunks_carry_no_text_and_match_no_stop_string(fleet, tiny_model_dir):
    """The gateway makes the text: a worker streams ids and logprobs, and a stop string in the
    request does not end it there (the gateway's output processor does)."""
    engine = LLMEngine(engine_config(str(tiny_model_dir), kv_cache_mib=8))
    (ref,) = engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0,
                                                      ignore_eos=True))
    stop = ref.text[len(ref.text) // 2:][:2]
    chunks = list(fleet.generate(route_request("c-text", PROMPT, 12, ignore_eos=True,
                                               stop=[stop], logprobs=0)))
    assert all(c.text == "" for c in chunks)
    assert [t for c in chunks for t in c.token_ids] == ref.token_ids
    assert len([lp for c in chunks for lp in c.logprobs]) == 12
    assert chunks[-1].finish_reason == "length"


def test_bad_request_gets_invalid_argument_with_the_limits(fleet):
    with pytest.raises(status.CallFailed) as info:
        list(fleet.generate(route_request("c2", PROMPT, 0)))
    assert info.value.status.reason == pb.INVALID_REQUEST
    assert "max_tokens" in info.value.status.message


def test_client_cancel_frees_every_block_on_the_worker(fleet):
    call = fleet.generate(route_request("c3", PROMPT, 2000, ignore_eos=True))
    next(iter(call))                                   # streaming has begun
    assert fleet.stats("mixed-0").kv_blocks_reserved > 0
    call.cancel()
    assert wait_until(lambda: (lambda s: s.kv_blocks_used == 0 and s.kv_blocks_reserved == 0)(
        fleet.stats("mixed-0")), 1.0)
