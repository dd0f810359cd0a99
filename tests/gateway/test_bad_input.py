"""Bad requests are refused at the gateway with the right status and OpenAI's error shape, before
they reach the fleet, and the fleet serves the next request as if nothing happened."""
from __future__ import annotations

import json
import os
import socket

import grpc
import httpx
import pytest

from tests.waiting import wait_until
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from tests.gateway.gateway_helpers import CONTEXT, INTERACTIVE_MAX_PROMPT, KEYS, bearer, openai_error

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
    ({"frobnicate": 1}, None, "frobnicate", "unknown_field"),
    ({"best_of": 2}, None, "best_of", "unsupported_field"),           # vLLM's, not implemented
    ({"guided_json": {"type": "object"}}, None, "guided_json", "unsupported_field"),
    ({"presence_penalty": 2.5}, None, "presence_penalty", "invalid_value"),
    ({"repetition_penalty": 0.0}, None, "repetition_penalty", "invalid_value"),
    ({"min_p": 1.5}, None, "min_p", "invalid_value"),
    ({"priority": 2**31}, None, "priority", "invalid_value"),          # past int32
    ({"truncate_prompt_tokens": -2}, None, "truncate_prompt_tokens", "invalid_value"),
    ({"logit_bias": {"7": 101.0}}, None, "logit_bias", "invalid_request"),
    ({"logit_bias": {"seven": 1.0}}, None, "logit_bias", "invalid_request"),
    ({"max_tokens": 0}, None, "max_tokens", "invalid_max_tokens"),
    ({"max_tokens": -3}, None, "max_tokens", "invalid_max_tokens"),
    ({"max_tokens": 10**12}, None, "max_tokens", "invalid_max_tokens"),   # past uint32
    ({"temperature": -1.0}, None, "temperature", "invalid_value"),
    ({"top_p": 0.0}, None, "top_p", "invalid_value"),
    ({"logprobs": 50}, None, "logprobs", "invalid_value"),
    ({"n": 17}, None, "n", "invalid_value"),                        # n: 1..16
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
        prompt_plus_output = doc_key.post("/v1/completions", content=_body(   # 3000 + 2048 > 4096
            {"prompt": [7] * 3000, "max_tokens": 2048}, gateway.model))
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




def test_the_fleet_still_serves_after_bad_requests(gateway, fleet):
    with gateway.client() as c:
        r = c.post("/v1/completions", content=_body({"max_tokens": 3}, gateway.model))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    stats = fleet.stats("mixed-0")
    assert stats.kv_blocks_reserved == 0 and stats.num_running == 0


def test_unknown_route_has_the_openai_error_shape(gateway):
    with httpx.Client(base_url=f"http://{gateway.http}", headers=bearer("acme")) as c:
        assert openai_error(c.get("/v1/engines"), 404)["type"] == "not_found_error"


# --- numbers past what their protobuf field holds ------------------------------------------------

@pytest.mark.parametrize("path, overrides, param, limits", [
    ("/v1/completions", {"top_k": 2**31}, "top_k", "[-1, 2147483647]"),                 # int32
    ("/v1/completions", {"logprobs": 2**32}, "logprobs", "[0, 20]"),                     # uint32
    ("/v1/completions", {"max_tokens": 2**32}, "max_tokens", "[1, 4294967295]"),         # uint32
    ("/v1/completions", {"seed": 2**63}, "seed", "9223372036854775807]"),                # int64
    ("/v1/completions", {"seed": -(2**63) - 1}, "seed", "[-9223372036854775808"),
    ("/v1/completions", {"n": 0}, "n", "[1, 16]"),
    ("/v1/completions", {"prompt": [2**40]}, "prompt", "[0, 4096)"),                     # vocab
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2**32}, "top_logprobs", "[0, 20]"),
    ("/v1/chat/completions", {"max_completion_tokens": 2**64}, "max_completion_tokens",
     "[1, 4294967295]"),
])
def test_integers_out_of_range_are_400_naming_the_field_and_its_range(gateway, path, overrides,
                                                                      param, limits):
    """Each of these used to overflow its protobuf field: a 500."""
    body = {"model": gateway.model, "max_tokens": 4, **overrides}
    body.update({"prompt": "hello"} if path == "/v1/completions" and "prompt" not in overrides else {})
    if path == "/v1/chat/completions":
        body.pop("max_tokens")
        body["messages"] = [{"role": "user", "content": "hello"}]
    with gateway.client() as c:
        error = openai_error(c.post(path, json=body), 400)
    assert error["param"] == param and limits in error["message"], error


def test_an_infinite_temperature_is_400(gateway):
    with gateway.client() as c:
        r = c.post("/v1/completions", content=_body({}, gateway.model).replace(
            b'"max_tokens": 4', b'"max_tokens": 4, "temperature": 1e999'))
    error = openai_error(r, 400)
    assert error["param"] == "temperature" and "[0.0, 2.0]" in error["message"]


# --- text that cannot fit is refused by its size ---------------------------------------------------

def test_a_text_prompt_too_long_to_fit_is_refused_by_its_bytes_before_tokenizing(gateway, engine):
    """3.9 MB of text (which took 13 s of CPU to tokenize): no token of the model covers more than
    `max_bytes_per_token` bytes, so the class's 2048 prompt tokens hold at most that many times
    2048 bytes, and the gateway says so without tokenizing."""
    limit = INTERACTIVE_MAX_PROMPT * engine.tokenizer.max_bytes_per_token
    text = "lorem ipsum " * (3_900_000 // 12)
    with gateway.client() as c:
        completion = c.post("/v1/completions", content=_body({"prompt": text}, gateway.model))
        chat = c.post("/v1/chat/completions", json={"model": gateway.model, "messages": [
            {"role": "system", "content": text[:limit // 2]},
            {"role": "user", "content": text[:limit // 2 + 10]}]})
    error = openai_error(completion, 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert f"{len(text)} bytes" in error["message"] and f"at most {limit} bytes" in error["message"]
    assert str(INTERACTIVE_MAX_PROMPT) in error["message"]
    error = openai_error(chat, 400)        # the messages' text together is over the limit
    assert error["param"] == "messages" and f"at most {limit} bytes" in error["message"]


# --- gRPC: bytes that are not a request ------------------------------------------------------------

def test_invalid_utf8_in_a_grpc_string_field_is_invalid_argument(gateway):
    """GenerateRequest field 2 (`text`, a proto3 string) holding the bytes ff fe."""
    raw = bytes([0x12, 2, 0xFF, 0xFE])
    with grpc.insecure_channel(gateway.grpc) as channel:
        generate = channel.unary_stream("/kvfleet.v1.Gateway/Generate",
                                        response_deserializer=pb.TokenChunk.FromString)
        cancel = channel.unary_unary("/kvfleet.v1.Gateway/Cancel",
                                     response_deserializer=pb.CancelResponse.FromString)
        with pytest.raises(grpc.RpcError) as generated:
            list(generate(raw, metadata=(("authorization", f"Bearer {KEYS['acme']['key']}"),)))
        with pytest.raises(grpc.RpcError) as cancelled:
            cancel(bytes([0x0A, 1, 0xC3]), metadata=(("authorization",
                                                      f"Bearer {KEYS['acme']['key']}"),))
    for e in (generated.value, cancelled.value):
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "UTF-8" in e.details() and "kvfleet.v1." in e.details()


# --- a client that leaves while sending ------------------------------------------------------------

def test_a_client_gone_while_sending_its_body_is_one_info_line(gateway, fleet):
    """The body is announced as 1000 bytes, 20 arrive, then the connection closes: the gateway
    logs one line, no traceback, and serves the next request."""
    log_path = fleet.launcher.log_path("gateway")
    start = os.path.getsize(log_path)
    host, port = gateway.http.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json"
                     b"\r\nAuthorization: Bearer " + KEYS["acme"]["key"].encode() +
                     b"\r\nContent-Length: 1000\r\n\r\n" + b'{"model": "x", "prom')

    def logged() -> str:
        with open(log_path, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")

    assert wait_until(lambda: "client went away after 20 bytes of its body" in logged(), 10), logged()
    assert "Traceback" not in logged() and "internal error" not in logged()
    with gateway.client() as c:
        assert c.post("/v1/completions", content=_body({}, gateway.model)).status_code == 200


# --- the document schema fuzzers start from ------------------------------------------------------

def test_the_openapi_document_describes_the_generation_bodies_and_their_ranges(gateway):
    with httpx.Client(base_url=f"http://{gateway.http}") as c:
        doc = c.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, body in (("/v1/completions", "CompletionRequest"),
                       ("/v1/chat/completions", "ChatCompletionRequest")):
        post = doc["paths"][path]["post"]
        assert post["requestBody"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{body}"}
        assert post["responses"]["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/Error"}
        assert schemas[body]["additionalProperties"] is False
    top_k = schemas["CompletionRequest"]["properties"]["top_k"]["anyOf"][0]
    assert (top_k["minimum"], top_k["maximum"]) == (-1, 2**31 - 1)
    messages = schemas["ChatCompletionRequest"]["properties"]["messages"]
    assert messages["items"] == {"$ref": "#/components/schemas/ChatMessage"}
    assert "ChatMessage" in schemas and "Error" in schemas
