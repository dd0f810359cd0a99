"""vLLM's benchmark client, replayed: every request `vllm bench serve` (vLLM 0.32) sent in
tests/loadtests/data/vllm_bench_requests.json (captured by loadtests/capture_vllm_bench.py, the
command in the file) goes unchanged to a real `kvfleet up` fleet serving the same name, and gets
what the client reads: 200, an SSE stream whose every event is JSON or [DONE] with a first token
chunk, then the usage chunk (`completion_tokens`, `prompt_tokens`) it takes its token counts
from; /tokenize's `tokens` (vLLM's prompt-alignment check) and /metrics."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.harness import up_fleet

DATA = json.loads((Path(__file__).parent / "data" / "vllm_bench_requests.json").read_text())
GENERATE = ("/v1/completions", "/v1/chat/completions")
DROPPED_HEADERS = ("host", "content-length")          # httpx writes its own


@pytest.fixture(scope="module")
def fleet(tiny_model_dir):
    """A disaggregated fleet serving the name the client used (`--served-model-name`)."""
    with up_fleet(tiny_model_dir, "--served-model-name", DATA["served_model_name"]) as up:
        yield up.url


def captured(run: str, paths: tuple[str, ...]) -> list[dict]:
    (found,) = [r for r in DATA["runs"] if r["name"] == run]
    return [q for q in found["requests"] if q["path"] in paths]


def send(url: str, request: dict) -> httpx.Response:
    """The captured request as the client sent it (body bytes re-encoded as JSON, its headers)."""
    headers = {k: v for k, v in request["headers"].items() if k not in DROPPED_HEADERS}
    content = None if request["body"] is None else json.dumps(request["body"]).encode()
    with httpx.Client(timeout=60) as client:
        r = client.request(request["method"], url + request["path"], content=content,
                           headers=headers)
        r.read()
        return r


def read_stream(response: httpx.Response, chat: bool) -> tuple[int, dict]:
    """(token chunks, usage) as vLLM's client reads them; asserts the stream is well formed."""
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in response.text.split("\n")
              if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", response.text[-500:]
    chunks, usage = 0, None
    for event in map(json.loads, events[:-1]):
        assert "error" not in event, event
        if event.get("choices"):
            choice = event["choices"][0]
            assert isinstance(choice["delta"] if chat else choice["text"], (dict if chat else str))
            chunks += 1
        elif event.get("usage"):
            usage = event["usage"]
    assert chunks > 0 and usage is not None, response.text[-500:]
    return chunks, usage


@pytest.mark.parametrize("run", ["completions", "chat"])
def test_every_generation_request_streams_with_the_usage_the_client_reads(fleet, run):
    requests = captured(run, GENERATE)
    assert len(requests) == 8
    with ThreadPoolExecutor(len(requests)) as pool:         # request rate inf: all at once
        responses = list(pool.map(lambda q: send(fleet, q), requests))
    for request, response in zip(requests, responses):
        assert response.status_code == 200, (request["body"], response.text)
        _, usage = read_stream(response, chat=run == "chat")
        body = request["body"]
        assert body["ignore_eos"] is True
        assert usage["completion_tokens"] == body.get("max_tokens",
                                                      body.get("max_completion_tokens"))
        assert usage["prompt_tokens"] > 0


@pytest.mark.parametrize("run", ["completions", "chat"])
def test_tokenize_and_metrics_answer_as_the_client_expects(fleet, run):
    for request in captured(run, ("/tokenize", "/detokenize", "/metrics")):
        response = send(fleet, request)
        assert response.status_code == 200, (request, response.text)
        if request["path"] == "/tokenize":
            tokens = response.json()["tokens"]
            assert tokens and all(isinstance(t, int) for t in tokens)
        elif request["path"] == "/detokenize":
            assert isinstance(response.json()["prompt"], str)
