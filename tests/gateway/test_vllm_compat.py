"""A vLLM user switches with no client change: vLLM's request fields are taken (or refused as
unsupported, by name), its names and endpoints answer as vLLM's do, on a real gateway and fleet."""
from __future__ import annotations

import json

import grpc
import pytest

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from tests.gateway.gateway_helpers import bearer, events, openai_error, sse_data
from tests.harness import Gateway, start_gateway

# Every sampling field vLLM documents for its OpenAI server, at values that do something.
VLLM_SAMPLING = {
    "temperature": 0.0, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 7,
    "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.5,
    "min_tokens": 2, "stop_token_ids": [3], "ignore_eos": True, "logit_bias": {"11": 1.5},
    "include_stop_str_in_output": True, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "truncate_prompt_tokens": 6, "prompt_logprobs": 1,
    "priority": -1,
}
# vLLM-defined fields kvfleet does not implement, at the value that changes nothing: accepted
NO_OPS = {"use_beam_search": False, "length_penalty": 1.0, "best_of": 1,
          "return_tokens_as_token_ids": False, "bad_words": [], "cache_salt": None}


def test_vllms_sampling_fields_are_taken_on_completions(gateway):
    body = {"model": gateway.model, "prompt": "one two three four five six seven eight",
            "max_tokens": 5, **VLLM_SAMPLING, **NO_OPS}
    with gateway.client() as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["usage"]["prompt_tokens"] == 6             # truncate_prompt_tokens kept the last 6
    assert answer["usage"]["completion_tokens"] == 5         # ignore_eos: all of max_tokens


def test_vllms_sampling_fields_are_taken_on_chat(gateway):
    body = {"model": gateway.model, "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 2,
            **{k: v for k, v in VLLM_SAMPLING.items() if k != "truncate_prompt_tokens"},
            "add_generation_prompt": True, "tool_choice": "none", "parallel_tool_calls": True}
    with gateway.client() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert len(choice["logprobs"]["content"]) == 4
    assert all(len(e["top_logprobs"]) == 2 for e in choice["logprobs"]["content"])


@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "best_of", 3),
    ("/v1/completions", "suffix", "the end"),
    ("/v1/completions", "use_beam_search", True),
    ("/v1/completions", "response_format", {"type": "json_object"}),
    ("/v1/completions", "allowed_token_ids", [1, 2]),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "guided_choice", ["yes", "no"]),
    ("/v1/chat/completions", "continue_final_message", True),
])
def test_a_vllm_field_kvfleet_does_not_implement_is_refused_by_name(gateway, path, field, value):
    base = ({"prompt": "hi"} if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": "hi"}]})
    with gateway.client() as c:
        r = c.post(path, json={"model": gateway.model, "max_tokens": 2, **base, field: value})
    error = openai_error(r, 400)
    assert (error["param"], error["code"]) == (field, "unsupported_field")
    assert "not supported" in error["message"] and "accepted only as" in error["message"]


def test_a_field_neither_openai_nor_vllm_defines_is_unknown(gateway):
    with gateway.client() as c:
        r = c.post("/v1/completions", json={"model": gateway.model, "prompt": "hi", "temprature": 0})
    error = openai_error(r, 400)
    assert (error["param"], error["code"]) == ("temprature", "unknown_field")


def test_model_may_be_left_out_as_vllm_allows(gateway):
    with gateway.client() as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == gateway.model


def test_continuous_usage_stats_puts_usage_on_every_chunk(gateway):
    body = {"model": gateway.model, "prompt": "hello there", "max_tokens": 4, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}
    with gateway.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        chunks = events(sse_data(r))
    # every chunk with a choice (a token whose text is held back, half a UTF-8 character,
    # comes with empty text) carries the usage so far
    with_choice = [e for e in chunks if e["choices"]]
    assert with_choice and all(e["usage"] and e["usage"]["prompt_tokens"] > 0 for e in with_choice)
    counts = [e["usage"]["completion_tokens"] for e in with_choice]
    assert counts == sorted(counts) and counts[-1] == 4
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_prompt_logprobs_come_back_per_prompt_token_as_vllm_shapes_them(gateway):
    body = {"model": gateway.model, "prompt": "a b c d", "max_tokens": 1, "prompt_logprobs": 2}
    with gateway.client() as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    plp = answer["choices"][0]["prompt_logprobs"]
    assert len(plp) == answer["usage"]["prompt_tokens"] and plp[0] is None
    for entry in plp[1:]:
        # the actual prompt token, plus the top 2 (which may include it)
        assert 1 <= len(entry) <= 3
        assert all({"logprob", "rank", "decoded_token"} <= set(v) for v in entry.values())


# ------------------------------------------------------------------------- names, endpoints
@pytest.fixture(scope="module")
def named_gateway(fleet, tiny_model_dir, configs) -> Gateway:
    engine_yaml, keys_yaml = configs
    g = start_gateway(fleet, str(tiny_model_dir), "gateway-named", "--config", engine_yaml,
                      "--api-keys", keys_yaml, "--served-model-name", "acme/llama-70b", "llama")
    return Gateway(g.http, g.grpc, "acme/llama-70b")


def test_every_served_name_is_listed_and_answers_with_the_first(named_gateway, tiny_model_dir):
    with named_gateway.client() as c:
        cards = c.get("/v1/models").raise_for_status().json()["data"]
        r = c.post("/v1/completions", json={"model": "llama", "prompt": "hi", "max_tokens": 2})
        one = c.get("/v1/models/llama").raise_for_status().json()
        missing = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert [card["id"] for card in cards] == ["acme/llama-70b", "llama"]
    for card in (*cards, one):
        assert card["object"] == "model" and card["root"] == str(tiny_model_dir)
        assert card["max_model_len"] == 4096 and card["parent"] is None and card["owned_by"]
    assert r.status_code == 200 and r.json()["model"] == "acme/llama-70b"
    assert openai_error(missing, 404)["code"] == "model_not_found"


def test_tokenize_and_detokenize_round_trip_as_vllm_shapes_them(gateway):
    with gateway.client() as c:
        tok = c.post("/tokenize", json={"model": gateway.model, "prompt": "hello world"}).json()
        bare = c.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()
        chat = c.post("/tokenize", json={"messages": [{"role": "user", "content": "hello"}]})
        back = c.post("/detokenize", json={"model": gateway.model, "tokens": bare["tokens"]})
        bad = c.post("/detokenize", json={"tokens": [10**9]})
    assert tok["count"] == len(tok["tokens"]) == len(bare["tokens"]) + 1   # the BOS
    assert tok["max_model_len"] == 4096
    assert chat.status_code == 200 and chat.json()["count"] > tok["count"]  # the template's tokens
    assert back.status_code == 200 and back.json() == {"prompt": "hello world"}
    assert openai_error(bad, 400)["param"] == "tokens"


def test_version_and_ping_answer_without_a_key(gateway):
    with gateway.client(key_name=None) as c:
        version = c.get("/version")
        pings = [c.get("/ping"), c.post("/ping")]
    assert version.status_code == 200 and version.json()["version"]
    assert [p.status_code for p in pings] == [200, 200]


# ----------------------------------------------------------------------------------- gRPC
def test_grpc_takes_the_same_fields_and_refuses_a_bad_one_by_name(gateway):
    with grpc.insecure_channel(gateway.grpc) as channel:
        stub = pb_grpc.GatewayStub(channel)
        metadata = tuple((k.lower(), v) for k, v in bearer("acme").items())
        params = pb.SamplingParams(max_tokens=3, temperature=0.0, repetition_penalty=1.3,
                                   presence_penalty=0.2, min_p=0.1, min_tokens=3, ignore_eos=True,
                                   logit_bias={5: 2.0}, priority=3)
        chunks = list(stub.Generate(pb.GenerateRequest(model=gateway.model, text="hello",
                                                       params=params), metadata=metadata))
        assert sum(len(c.token_ids) for c in chunks) == 3 and chunks[-1].finished
        params.presence_penalty = 7.0
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(model=gateway.model, text="hello", params=params),
                               metadata=metadata))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "presence_penalty" in e.value.details()


def test_the_openapi_document_states_the_new_ranges(gateway):
    with gateway.client() as c:
        doc = c.get("/openapi.json").raise_for_status().json()
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    ranges = json.dumps({k: props[k] for k in ("presence_penalty", "min_p", "priority")})
    assert '"maximum": 2.0' in ranges and '"maximum": 1.0' in ranges and "2147483647" in ranges


def test_grpc_streams_n_samples_each_chunk_naming_its_index(gateway):
    with grpc.insecure_channel(gateway.grpc) as channel:
        stub = pb_grpc.GatewayStub(channel)
        metadata = tuple((k.lower(), v) for k, v in bearer("acme").items())
        params = pb.SamplingParams(max_tokens=3, temperature=0.8, seed=11, ignore_eos=True, n=2)
        chunks = list(stub.Generate(pb.GenerateRequest(model=gateway.model, text="hello",
                                                       params=params), metadata=metadata))
    tokens = {i: [t for c in chunks if c.index == i for t in c.token_ids] for i in (0, 1)}
    assert {c.index for c in chunks} == {0, 1}
    assert [len(tokens[0]), len(tokens[1])] == [3, 3]
    assert [c.finished for c in chunks].count(True) == 1 and chunks[-1].finished   # the request's end
