"""The OpenAI REST API over a real fleet: greedy output equals the in-process engine's, streamed or
not; SSE ends with [DONE]; usage, logprobs, echo, stop strings and seeds behave as OpenAI's do."""
from __future__ import annotations

import pytest

from services.engine.sampling_params import SamplingParams
from tests.gateway.gateway_helpers import events, sse_data

pytestmark = pytest.mark.real_model("greedy output equals the in-process engine's")

PROMPT = "The quick brown fox jumps over the lazy dog"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]


def greedy(engine, prompt, n: int, **kw):
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0,
                                                      ignore_eos=True, **kw))
    return out


def chat_ids(engine, messages) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


def test_completion_equals_the_engine_and_names_the_model(gateway, engine):
    ref = greedy(engine, PROMPT, 12)
    with gateway.client() as c:
        r = c.post("/v1/completions", json={"model": gateway.model, "prompt": PROMPT, "max_tokens": 12,
                                            "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == gateway.model == r.headers["x-kvfleet-model"]
    assert body["system_fingerprint"] == r.headers["x-kvfleet-quality-version"]
    (choice,) = body["choices"]
    assert choice["text"] == ref.text and choice["finish_reason"] == "length"
    n_prompt = len(engine.tokenizer.encode(PROMPT))
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]   # vLLM's, always here
    assert 0 <= cached < n_prompt
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 12,
                             "total_tokens": n_prompt + 12,
                             "prompt_tokens_details": {"cached_tokens": cached}}


def test_token_id_prompt_is_served_like_text(gateway, engine):
    ids = engine.tokenizer.encode(PROMPT)
    with gateway.client() as c:
        r = c.post("/v1/completions", json={"model": gateway.model, "prompt": ids, "max_tokens": 6,
                                            "temperature": 0, "ignore_eos": True})
    assert r.json()["choices"][0]["text"] == greedy(engine, ids, 6).text


def test_streamed_completion_concatenates_to_the_engine_text_and_ends_with_done(gateway, engine):
    with gateway.client() as c, c.stream("POST", "/v1/completions", json={
            "model": gateway.model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        evs = events(sse_data(r))
    *text_events, usage_event = evs
    assert "".join(e["choices"][0]["text"] for e in text_events) == greedy(engine, PROMPT, 10).text
    assert text_events[-1]["choices"][0]["finish_reason"] == "length"
    assert all(e["usage"] is None for e in text_events)
    assert usage_event["choices"] == [] and usage_event["usage"]["completion_tokens"] == 10


def test_chat_uses_the_chat_template_streamed_or_not(gateway, engine):
    ref = greedy(engine, chat_ids(engine, CHAT), 8)
    req = {"model": gateway.model, "messages": CHAT, "max_completion_tokens": 8, "temperature": 0,
           "ignore_eos": True}
    with gateway.client() as c:
        body = c.post("/v1/chat/completions", json=req).json()
        with c.stream("POST", "/v1/chat/completions", json={**req, "stream": True}) as r:
            evs = events(sse_data(r))
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ref.text}
    assert body["usage"]["prompt_tokens"] == len(chat_ids(engine, CHAT))
    assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in evs)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in evs) == ref.text
    assert evs[-1]["choices"][0]["finish_reason"] == "length"


def test_logprobs_are_the_engines_and_echo_prepends_the_prompt(gateway, engine):
    ref = greedy(engine, PROMPT, 5, logprobs=2)
    n_prompt = len(engine.tokenizer.encode(PROMPT))
    with gateway.client() as c:
        plain = c.post("/v1/completions", json={"model": gateway.model, "prompt": PROMPT,
                                                "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                                                "logprobs": 2}).json()["choices"][0]
        echoed = c.post("/v1/completions", json={"model": gateway.model, "prompt": PROMPT,
                                                 "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                                                 "logprobs": 1, "echo": True}).json()["choices"][0]
    lp = plain["logprobs"]
    assert lp["token_logprobs"] == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-3)
    assert all(len(top) <= 3 for top in lp["top_logprobs"]) and len(lp["tokens"]) == 5
    assert echoed["text"] == PROMPT + ref.text
    elp = echoed["logprobs"]
    assert len(elp["tokens"]) == n_prompt + 5 and elp["tokens"][0] == "<|begin_of_text|>"
    assert elp["token_logprobs"][0] is None and all(x is not None for x in elp["token_logprobs"][1:])


def test_chat_logprobs_have_openais_shape(gateway):
    with gateway.client() as c:
        body = c.post("/v1/chat/completions", json={
            "model": gateway.model, "messages": CHAT, "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 2}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0


def test_stop_string_ends_the_text_before_it(gateway, engine):
    ref = greedy(engine, PROMPT, 16).text
    stop = next(ref[i:i + 3] for i in range(4, len(ref) - 3) if ref[i:i + 3].isascii()
                and ref[i:i + 3].strip())
    with gateway.client() as c:
        choice = c.post("/v1/completions", json={"model": gateway.model, "prompt": PROMPT,
                                                 "max_tokens": 16, "temperature": 0,
                                                 "stop": [stop]}).json()["choices"][0]
    assert choice["text"] == ref[:ref.index(stop)]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop


def test_a_seed_makes_sampling_reproducible(gateway):
    req = {"model": gateway.model, "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0,
           "seed": 1234, "ignore_eos": True}
    with gateway.client() as c:
        texts = [c.post("/v1/completions", json=req).json()["choices"][0]["text"] for _ in range(2)]
    assert texts[0] == texts[1] and texts[0]


def test_models_and_health(gateway):
    with gateway.client() as c:
        models = c.get("/v1/models").json()
        health = c.get("/health")
    assert [m["id"] for m in models["data"]] == [gateway.model]
    assert models["data"][0]["max_model_len"] == 4096
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_tokenize_counts_what_a_completion_would_be_charged(gateway, engine):
    """vLLM's /tokenize: the load generator sizes prompts with it, so its count must be the one the
    completion reports as usage.prompt_tokens; it is keyed and model-checked like the rest."""
    with gateway.client() as c:
        t = c.post("/tokenize", json={"model": gateway.model, "prompt": PROMPT})
        done = c.post("/v1/completions", json={"model": gateway.model, "prompt": PROMPT,
                                               "max_tokens": 1})
        wrong = c.post("/tokenize", json={"model": "nope", "prompt": PROMPT})
        extra = c.post("/tokenize", json={"model": gateway.model, "prompt": PROMPT, "x": 1})
    assert t.status_code == 200, t.text
    body = t.json()
    assert body["tokens"] == engine.tokenizer.encode(PROMPT)
    assert body["count"] == len(body["tokens"]) == done.json()["usage"]["prompt_tokens"]
    assert body["max_model_len"] > 0
    assert wrong.status_code == 404 and "nope" in wrong.json()["error"]["message"]
    assert extra.status_code == 400
