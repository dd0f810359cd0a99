"""Bad requests are refused at the gateway with the right status and OpenAI's error shape, before
they reach the fleet, and the fleet serves the next request as if nothing happened."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway.gateway_helpers import CONTEXT, INTERACTIVE_MAX_PROMPT, bearer, openai_error

MODEL = "{model}"   # replaced by the served model's name
GOOD = {"model": MODEL, "prompt": "hello", "max_tokens": 4}


def _body(overrides: dict, model: str, drop: str | None = None) -> bytes:
    body = {**GOOD, **overrides}
    body.pop(drop, None)
    return json.dumps({k: (model if v == MODEL else v) for k, v in body.items()}).encode()


@pytest.mark.parametrize("overrides, drop, param, code", [
    ({"max_tokens": "5"}, None, "max_tokens", "invalid_request"),          # strict: no coercion
    ({"temperature": "hot"}, None, "temperature", "invalid_request"),
    ({"stream": "yes"}, None, "stream", "invalid_request"),
    ({"prompt": 42}, None, "prompt", "invalid_request"),
    ({"prompt": [1, "two"]}, None, "prompt", "invalid_request"),
    ({}, "prompt", "prompt", "missing_field"),
    ({"frobnicate": 1}, None, "frobnicate", "unsupported_field"),
    ({"max_tokens": 0}, None, "max_tokens", "invalid_max_tokens"),
    ({"max_tokens": -3}, None, "max_tokens", "invalid_max_tokens"),
    ({"max_tokens": 10**12}, None, "max_tokens", "context_length_exceeded"),
    ({"temperature": -1.0}, None, "temperature", "invalid_value"),
    ({"top_p": 0.0}, None, "top_p", "invalid_value"),
    ({"logprobs": 50}, None, "logprobs", "invalid_value"),
    ({"n": 2}, None, "n", "unsupported_value"),
    ({"prompt": ""}, None, "prompt", "empty_prompt"),
    ({"prompt": [5000000]}, None, "prompt", "token_out_of_vocab"),
])
def test_schema_and_value_errors_are_400_naming_the_field(gateway, overrides, drop, param, code):
    with gateway.client() as c:
        r = c.post("/v1/completions", content=_body(overrides, gateway.model, drop))
    error = openai_error(r, 400)
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")


def test_a_list_of_prompts_is_refused_saying_one_prompt_per_request(gateway):
    with gateway.client() as c:
        r = c.post("/v1/completions", content=_body({"prompt": ["a", "b"]}, gateway.model))
    assert "one prompt per request" in openai_error(r, 400)["message"]


def test_malformed_json_and_invalid_utf8_are_400(gateway):
    with gateway.client() as c:
        malformed = c.post("/v1/completions", content=b'{"model": "tiny", "prompt": ')
        not_utf8 = c.post("/v1/completions",
                          content=b'{"model": "' + gateway.model.encode() + b'", "prompt": "\xff\xfe"}')
    assert openai_error(malformed, 400)["code"] == "invalid_json"
    assert openai_error(not_utf8, 400)["code"] == "invalid_utf8"


def test_lengths_beyond_the_class_or_the_context_say_the_limits(gateway):
    with gateway.client("acme") as chat_key, gateway.client("doc") as doc_key:
        over_class = chat_key.post("/v1/completions", content=_body(
            {"prompt": [7] * (INTERACTIVE_MAX_PROMPT + 1)}, gateway.model))
        over_context = doc_key.post("/v1/completions", content=_body(
            {"prompt": [7] * (CONTEXT + 10)}, gateway.model))
        prompt_plus_output = doc_key.post("/v1/chat/completions", json={
            "model": gateway.model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": CONTEXT})
    error = openai_error(over_class, 400)
    assert error["code"] == "context_length_exceeded" and str(INTERACTIVE_MAX_PROMPT) in error["message"]
    assert "'interactive'" in error["message"]
    error = openai_error(over_context, 400)
    assert error["code"] == "context_length_exceeded" and str(CONTEXT) in error["message"]
    error = openai_error(prompt_plus_output, 400)
    assert str(CONTEXT) in error["message"] and "max_tokens" in error["message"]


def test_unknown_model_is_404(gateway):
    with gateway.client() as c:
        r = c.post("/v1/chat/completions", json={"model": "gpt-4", "messages": [
            {"role": "user", "content": "hi"}]})
    error = openai_error(r, 404)
    assert error["code"] == "model_not_found" and gateway.model in error["message"]


def test_missing_or_wrong_api_key_is_401(gateway):
    with gateway.client(key_name=None) as anonymous:
        missing = anonymous.post("/v1/completions", content=_body({}, gateway.model))
        wrong = anonymous.post("/v1/completions", content=_body({}, gateway.model),
                               headers={"Authorization": "Bearer sk-not-a-key"})
        models = anonymous.get("/v1/models")
    assert openai_error(missing, 401)["type"] == "authentication_error"
    assert openai_error(wrong, 401)["code"] == "invalid_api_key"
    openai_error(models, 401)


def test_a_body_of_several_megabytes_is_refused_with_413(gateway):
    big = _body({"prompt": "x" * (6 << 20)}, gateway.model)
    with gateway.client() as c:
        declared = c.post("/v1/completions", content=big)
        chunked = c.post("/v1/completions", content=iter([big[i:i + 65536]
                                                          for i in range(0, len(big), 65536)]))
    assert "4194304" in openai_error(declared, 413)["message"]
    assert openai_error(chunked, 413)["code"] == "body_too_large"


def test_an_error_the_workers_find_comes_back_as_400_with_their_code(gateway):
    """Only the workers know their tenants: the router's INVALID_ARGUMENT reaches the client as 400."""
    with gateway.client("stranger") as c:
        r = c.post("/v1/completions", content=_body({}, gateway.model))
    error = openai_error(r, 400)
    assert error["code"] == "unknown_tenant" and "stranger" in error["message"]


def test_the_fleet_still_serves_after_bad_requests(gateway, fleet):
    with gateway.client() as c:
        r = c.post("/v1/completions", content=_body({"max_tokens": 3}, gateway.model))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    stats = fleet.stats("mixed-0")
    assert stats.kv_blocks_reserved == 0 and stats.num_running == 0


def test_unknown_route_has_the_openai_error_shape(gateway):
    with httpx.Client(base_url=f"http://{gateway.http}", headers=bearer("acme")) as c:
        assert openai_error(c.get("/v1/engines"), 404)["type"] == "not_found_error"
