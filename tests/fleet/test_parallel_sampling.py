"""n > 1 through the REST gateway, on a disaggregated fleet (the prefill worker samples the n
first tokens and ships them with the KV; the decode worker forks) and on a co-located one: OpenAI's
choices indexed 0..n-1, streamed and not, usage with the prompt once and the completions summed,
`prompt_tokens_details.cached_tokens` for a repeated prompt, and every block freed afterwards."""
from __future__ import annotations

import openai
import pytest

from tests.waiting import wait_until
from services.engine.engine import LLMEngine, engine_config
from services.engine.sampling_params import SamplingParams
from tests.harness import running_fleet, start_gateway

# 40+ tokens: two full 16-token blocks, which a repeated prompt finds in the prefix cache
PROMPT = ("Parallel samples share the prompt's KV blocks: the full blocks once, ref-counted, "
          "and each sample its own copy of the partial last block, copy on write.")
IGNORE_EOS = {"ignore_eos": True}
# one fleet per mode for all four tests: the first's claim (every greedy sample is the engine's
# greedy text) needs the model
pytestmark = pytest.mark.real_model("n greedy samples each equal the in-process engine's text")


def fleet_idle(fleet, workers) -> bool:
    return all(s.kv_blocks_used == 0 and s.kv_blocks_reserved == 0 and s.num_running == 0
               for s in (fleet.stats(w) for w in workers))


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    engine = LLMEngine(engine_config(str(tiny_model_dir), kv_cache_mib=8))
    (ref,) = engine.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0,
                                                      ignore_eos=True))
    return ref


@pytest.fixture(scope="module", params=["disagg", "colocated"])
def setup(request, redis_url, tiny_model_dir):
    mode = request.param
    with running_fleet(redis_url, str(tiny_model_dir), mode, engine="real") as fleet:
        workers = ("prefill-0", "decode-0") if mode == "disagg" else ("mixed-0",)
        gw = start_gateway(fleet, str(tiny_model_dir))
        yield fleet, workers, openai.OpenAI(base_url=f"http://{gw.http}/v1", api_key="unused"), gw


def test_n_choices_not_streamed_with_usage_summed(setup, reference):
    fleet, workers, client, gw = setup
    out = client.completions.create(model=gw.model, prompt=PROMPT, max_tokens=6, temperature=0,
                                    n=2, extra_body=IGNORE_EOS)
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.text == reference.text and c.finish_reason == "length" for c in out.choices)
    assert out.usage.prompt_tokens == len(reference.prompt_token_ids)     # once, not n times
    assert out.usage.completion_tokens == 2 * 6
    assert wait_until(lambda: fleet_idle(fleet, workers), 1.0)


def test_n_choices_streamed_by_index_with_usage(setup):
    fleet, workers, client, gw = setup
    stream = client.chat.completions.create(
        model=gw.model, messages=[{"role": "user", "content": PROMPT}], max_tokens=5, n=3,
        temperature=1.0, seed=11, stream=True, stream_options={"include_usage": True},
        extra_body=IGNORE_EOS)
    text: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for event in stream:
        if event.usage is not None:
            usage = event.usage
        for choice in event.choices:
            text[choice.index] = text.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert sorted(text) == [0, 1, 2] and all(text.values())
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 3 * 5 and usage.total_tokens == usage.prompt_tokens + 15
    assert wait_until(lambda: fleet_idle(fleet, workers), 1.0)


def test_a_repeated_prompt_reports_cached_tokens(setup):
    fleet, workers, client, gw = setup
    ask = dict(model=gw.model, prompt=PROMPT + " Again.", max_tokens=2, temperature=0)
    client.completions.create(**ask)
    out = client.completions.create(**ask)
    assert out.usage.prompt_tokens_details.cached_tokens >= 32      # two full 16-token blocks
    assert out.usage.prompt_tokens_details.cached_tokens < out.usage.prompt_tokens


def test_hanging_up_frees_every_sample_everywhere(setup):
    fleet, workers, client, gw = setup
    stream = client.completions.create(model=gw.model, prompt=PROMPT, max_tokens=2000, n=2,
                                       temperature=0, stream=True, extra_body=IGNORE_EOS)
    seen = set()
    for event in stream:
        seen.update(c.index for c in event.choices)
        if seen == {0, 1}:
            break
    assert fleet.stats(workers[-1]).kv_blocks_used > 0
    stream.close()
    assert wait_until(lambda: fleet_idle(fleet, workers), 1.0)


def test_a_stop_string_in_every_sample_ends_the_request_and_frees_it_everywhere(setup, reference):
    """The gateway matches the stop string in each of the n samples; once all have stopped it
    ends the request on the workers, whose 2 x 2000-token samples are freed."""
    fleet, workers, client, gw = setup
    text = reference.text
    stop = next(text[i:i + 2] for i in range(2, len(text) - 2)
                if text[i:i + 2].isascii() and text[i:i + 2].strip())
    out = client.completions.create(model=gw.model, prompt=PROMPT, max_tokens=2000, n=2,
                                    temperature=0, stop=[stop], extra_body=IGNORE_EOS)
    assert [c.text for c in out.choices] == [text[:text.index(stop)]] * 2
    assert all(c.finish_reason == "stop" for c in out.choices)
    assert wait_until(lambda: fleet_idle(fleet, workers), 1.0)


def test_a_stop_string_in_one_sample_ends_it_alone_and_frees_its_blocks_at_once(setup):
    """Two seeded samples: a stop string found early in one and nowhere in the other. The gateway
    ends the stopped sample alone on the worker that decodes it (its blocks go back while the
    request runs on: one sequence left there), and the other runs to its length."""
    fleet, workers, client, gw = setup
    ask = dict(model=gw.model, prompt=PROMPT, max_tokens=1000, n=2, temperature=1.0, seed=5,
               extra_body=IGNORE_EOS)
    texts = [c.text for c in client.completions.create(**ask).choices]   # no stop: both in full
    stopped, stop = one_sample_stop(texts)
    runner = 1 - stopped
    stream = client.completions.create(**ask, stop=[stop], stream=True)
    text, finish = {0: "", 1: ""}, {}
    checked = False
    for event in stream:
        for choice in event.choices:
            text[choice.index] += choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
        if finish.get(stopped) == "stop" and not checked:
            # the request still runs (the other sample has ~1000 tokens to go); the stopped
            # sample's sequence has left the decoding worker
            assert wait_until(lambda: fleet.stats(workers[-1]).num_running == 1, 5.0)
            assert fleet.stats(workers[-1]).kv_blocks_used > 0
            checked = True
    assert checked
    assert text[stopped] == texts[stopped][:texts[stopped].index(stop)]
    assert text[runner] == texts[runner] and finish == {stopped: "stop", runner: "length"}
    assert wait_until(lambda: fleet_idle(fleet, workers), 1.0)


def one_sample_stop(texts: list[str]) -> tuple[int, str]:
    """(which sample, a stop string) such that the string is early in that sample's text and
    nowhere in the other's."""
    for stopped in (0, 1):
        mine, other = texts[stopped], texts[1 - stopped]
        for size in range(2, 12):
            for i in range(2, min(40, len(mine) - size)):
                stop = mine[i:i + size]
                if stop.strip() and stop not in other:
                    return stopped, stop
    raise AssertionError("no string tells the two samples apart")
