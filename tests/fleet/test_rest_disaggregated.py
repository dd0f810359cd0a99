"""The OpenAI REST API over a disaggregated fleet (prefill and decode workers, KV over TCP):
the official client gets the in-process engine's greedy text, vLLM's recorded sampling cases
(tests/engine/data) come out as vLLM's text through the gateway that makes it, and a client that
hangs up during decode, like a stop string that ends a long answer early, leaves both workers
and the tenant's Redis counters at zero."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest

from services.state.fleet_state import FleetState
from services.worker.engine_client import MERGE_BACKLOG
from tests.waiting import wait_until
from services.engine.engine import LLMEngine, engine_config
from services.engine.sampling_params import SamplingParams
from tests.harness import running_fleet, start_gateway

# one fleet for both tests: its greedy-text claim needs the model (a second, simulated fleet for
# the hang-up test would cost more than the real model's few decode steps)
pytestmark = pytest.mark.real_model("the client's text equals the in-process engine's greedy text")

PROMPT = "Disaggregated serving sends the prompt's KV from prefill to decode"
VLLM = json.loads((Path(__file__).parents[1] / "engine" / "data" /
                   "vllm_sampling_params.json").read_text())
VLLM_CASES = {c["name"]: c for c in VLLM["cases"]}


@pytest.fixture(scope="module")
def setup(redis_url, tiny_model_dir):
    with running_fleet(redis_url, str(tiny_model_dir), "disagg", engine="real") as fleet:
        yield fleet, start_gateway(fleet, str(tiny_model_dir))


def idle(fleet) -> bool:
    return all(s.kv_blocks_used == 0 and s.kv_blocks_reserved == 0
               for s in (fleet.stats("prefill-0"), fleet.stats("decode-0")))


def test_openai_client_gets_the_engines_greedy_text(setup, tiny_model_dir):
    fleet, gw = setup
    client = openai.OpenAI(base_url=f"http://{gw.http}/v1", api_key="unused")
    out = client.completions.create(model=gw.model, prompt=PROMPT, max_tokens=12, temperature=0)
    engine = LLMEngine(engine_config(str(tiny_model_dir), kv_cache_mib=8))
    (ref,) = engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0))
    assert out.choices[0].text == ref.text
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert wait_until(lambda: idle(fleet), 1.0)


def streams(fleet) -> int:
    async def count() -> int:
        async with FleetState(fleet.redis_url) as state:
            return await state.streams("default")
    return asyncio.run(count())


def vllm_body(case: dict, model: str) -> dict:
    """A recorded case as a /v1/completions body (vLLM's parameter names; the prompt as ids)."""
    params = dict(case["params"])
    if "logit_bias" in params:
        params["logit_bias"] = {str(t): b for t, b in params["logit_bias"]}
    return {"model": model, "prompt": case["prompt_token_ids"], **params}


@pytest.mark.parametrize("name", list(VLLM_CASES))
def test_vllms_sampling_cases_give_vllms_text_through_the_fleet(setup, name):
    """The workers send ids; the gateway's text is vLLM's, stop strings and special-token options
    included, with the same tokens (by their raw logprobs, vLLM's default mode)."""
    fleet, gw = setup
    case = VLLM_CASES[name]
    with gw.client(None) as c:
        r = c.post("/v1/completions", json=vllm_body(case, gw.model))
    assert r.status_code == 200, r.text
    answer = r.json()
    choice = answer["choices"][0]
    assert choice["text"] == case["vllm_text"]
    assert choice["finish_reason"] == case["finish_reason"]
    if case["params"].get("stop"):
        assert choice["stop_reason"] == case["stop_reason"]
    assert answer["usage"]["completion_tokens"] == len(case["vllm_token_ids"])
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(case["raw_logprobs"], abs=1e-3)
    assert wait_until(lambda: idle(fleet), 1.0)


def test_a_stop_string_ends_a_long_answer_and_frees_the_decode_reservation(setup, tiny_model_dir):
    """The gateway matches the stop string a few tokens in and cancels the request on the
    workers: the decode worker's reservation for 3000 tokens and the stream slot are freed."""
    fleet, gw = setup
    engine = LLMEngine(engine_config(str(tiny_model_dir), kv_cache_mib=8))
    (ref,) = engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0,
                                                      ignore_eos=True))
    stop = next(ref.text[i:i + 3] for i in range(6, len(ref.text) - 3)
                if ref.text[i:i + 3].isascii() and ref.text[i:i + 3].strip())
    client = openai.OpenAI(base_url=f"http://{gw.http}/v1", api_key="unused")
    stream = client.completions.create(model=gw.model, prompt=PROMPT, max_tokens=3000,
                                       temperature=0, stream=True, stop=[stop],
                                       extra_body={"ignore_eos": True})
    events = list(stream)
    assert "".join(e.choices[0].text for e in events) == ref.text[:ref.text.index(stop)]
    assert events[-1].choices[0].finish_reason == "stop"
    assert wait_until(lambda: idle(fleet), 1.0)
    assert wait_until(lambda: streams(fleet) == 0, 1.0)


def test_hanging_up_during_decode_frees_both_workers_and_the_quota(setup):
    fleet, gw = setup
    client = openai.OpenAI(base_url=f"http://{gw.http}/v1", api_key="unused")
    stream = client.completions.create(model=gw.model, prompt=PROMPT, max_tokens=3000,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert fleet.stats("decode-0").kv_blocks_reserved > 0
    stream.close()
    assert wait_until(lambda: idle(fleet), 1.0)
    assert wait_until(lambda: streams(fleet) == 0, 1.0)


def test_a_streamed_completion_sends_one_event_per_token(setup):
    """As vLLM streams: each content event carries one engine delta, one token (its logprob
    names it), on the decode worker's relay as on the first token's. A relay that fell more than
    MERGE_BACKLOG deltas behind the engine (its process starved for a few steps on a loaded box)
    gets that backlog merged into one delta, as vLLM v1's output collector does
    (tests/worker/test_output_stream.py tests that rule alone): so an event carries one token or
    a merged backlog, never 2..MERGE_BACKLOG, and the relay's own one-token events are there."""
    fleet, gw = setup
    client = openai.OpenAI(base_url=f"http://{gw.http}/v1", api_key="unused")
    stream = client.completions.create(model=gw.model, prompt=PROMPT, max_tokens=64, logprobs=0,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True})
    events = list(stream)
    content = [e for e in events if e.choices]
    sizes = [len(e.choices[0].logprobs.tokens) for e in content]
    assert sum(sizes) == 64 and events[-1].usage.completion_tokens == 64
    assert sizes[0] == 1                                  # the prefill worker's first token
    assert all(n == 1 or n > MERGE_BACKLOG for n in sizes), sizes
    assert sizes[1:].count(1) >= 1, sizes                 # the decode relay's, one by one
    assert wait_until(lambda: idle(fleet), 1.0)
