"""The gateway makes the fleet's text: worker chunks carry token ids only, and the output processor
turns them into vLLM's text, however the workers split them into chunks. vLLM's recorded sampling
cases (tests/engine/data) are replayed as worker streams: the same text, finish reason and stop
reason come out, a stop string cuts the stream after the token that completed it (a worker would
have gone on), and a completion ending inside a multi-byte character ends without U+FFFD."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadtests.check_vllm_sampling import kvfleet_params
from services.engine.tokenizer import Tokenizer
from services.gateway.output_processor import OutputProcessor
from services.protocol.params import params_to_pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb

DATA = json.loads((Path(__file__).parents[1] / "engine" / "data" /
                   "vllm_sampling_params.json").read_text())
CASES = {c["name"]: c for c in DATA["cases"]}
SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
THE, CRAB = 1834, [446, 99, 222]     # " the"; "🦀" is three byte tokens in the tiny tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def worker_stream(ids: list[int], cuts: list[int], finish_reason: str, stop_reason: str = "",
                  index: int = 0, last: bool = True) -> list[pb.TokenChunk]:
    """What a worker sends for one sample: `ids` split at `cuts`, no text, the finish on the last
    chunk (`last`: the request's last chunk too)."""
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(ids)}), len(ids)]
    chunks = [pb.TokenChunk(request_id="r", index=index, token_ids=ids[a:b],
                            logprobs=[pb.TokenLogprob(token_id=t) for t in ids[a:b]])
              for a, b in zip(bounds, bounds[1:])]
    chunks[-1].finish_reason, chunks[-1].stop_reason = finish_reason, stop_reason
    chunks[-1].finished = last
    return chunks


def run(processor: OutputProcessor, chunks: list[pb.TokenChunk]) -> list[pb.TokenChunk]:
    """The chunks a client gets, up to the one that ends the request."""
    out = []
    for chunk in chunks:
        if (c := processor.process(chunk)) is not None:
            out.append(c)
            if c.finished:
                break
    return out


def fleet_stream(case: dict, cuts: list[int]) -> list[pb.TokenChunk]:
    """vLLM's ids as the fleet streams them: workers match no stop strings, so where vLLM stopped
    on one they go on (here: five more tokens) until max_tokens."""
    ids, params = case["vllm_token_ids"], case["params"]
    if case["finish_reason"] == "stop" and params.get("stop"):
        return worker_stream(ids + ids[-1:] * 5, cuts, "length")
    if case["finish_reason"] == "stop":     # EOS or a stop token id, the last token
        return worker_stream(ids, cuts, "stop", str(case["stop_reason"] or ids[-1]))
    return worker_stream(ids, cuts, case["finish_reason"])


@SETTINGS
@given(cuts=st.lists(st.integers(1, 24), max_size=6))
@pytest.mark.parametrize("name", list(CASES))
def test_vllms_cases_replayed_as_worker_chunks_give_vllms_text(tokenizer, name, cuts):
    case = CASES[name]
    params = params_to_pb(kvfleet_params(case))
    out = run(OutputProcessor(tokenizer, case["prompt_token_ids"], params),
              fleet_stream(case, cuts))
    assert "".join(c.text for c in out) == case["vllm_text"]
    assert [t for c in out for t in c.token_ids] == case["vllm_token_ids"]
    assert len([lp for c in out for lp in c.logprobs]) == len(case["vllm_token_ids"])
    assert out[-1].finished and out[-1].finish_reason == case["finish_reason"]
    if case["params"].get("stop"):
        assert out[-1].stop_reason == case["stop_reason"]


def test_text_that_may_start_a_stop_string_is_held_back_until_it_cannot(tokenizer):
    params = pb.SamplingParams(max_tokens=8, stop=[" the end"])
    processor = OutputProcessor(tokenizer, [4080, 46], params)
    held = processor.process(worker_stream([THE], [], "", last=False)[0])
    assert held.text == "" and list(held.token_ids) == [THE]     # " the" may begin " the end"
    (rest,) = worker_stream([THE], [], "length")
    assert processor.process(rest).text == " the the"             # it did not: both are sent


def test_a_completion_ending_inside_a_character_leaves_its_bytes_out(tokenizer):
    """The issue's case: a stop token id whose bytes are half of a UTF-8 character."""
    for include in (False, True):
        params = pb.SamplingParams(max_tokens=8, stop_token_ids=[CRAB[1]],
                                   include_stop_str_in_output=include)
        out = run(OutputProcessor(tokenizer, [4080, 46], params),
                  worker_stream([THE, *CRAB[:2]], [1, 2], "stop", str(CRAB[1])))
        assert "".join(c.text for c in out) == " the"
    out = run(OutputProcessor(tokenizer, [4080, 46], pb.SamplingParams(max_tokens=3)),
              worker_stream([THE, *CRAB], [1, 2], "length"))
    assert "".join(c.text for c in out) == " the🦀"


def test_min_tokens_bars_a_stop_string_until_it_is_reached(tokenizer):
    params = pb.SamplingParams(max_tokens=8, stop=["the"], min_tokens=2)
    out = run(OutputProcessor(tokenizer, [4080, 46], params),
              worker_stream([THE] * 6, [1, 2, 3], "length"))
    # the first two " the" are barred; the third matches (the text ends before its "the")
    assert "".join(c.text for c in out) == " the the "
    assert sum(len(c.token_ids) for c in out) == 3
    assert out[-1].finish_reason == "stop" and out[-1].finished


def test_one_sample_stopped_by_a_string_while_another_runs_on(tokenizer):
    """n = 2: sample 0 ends here on its stop string, sample 1 goes on; what the workers still
    send for sample 0 is dropped, and the request ends when sample 1 does."""
    params = pb.SamplingParams(max_tokens=4, stop=["🦀"], n=2)
    processor = OutputProcessor(tokenizer, [4080, 46], params)
    fleet = [*worker_stream([THE, *CRAB], [1, 2, 3], "", index=0, last=False),
             *worker_stream([THE, THE], [1], "", index=1, last=False),
             *worker_stream([THE], [], "length", index=0, last=False),
             *worker_stream([THE, THE], [], "length", index=1)]
    out = run(processor, fleet)
    by = {i: [c for c in out if c.index == i] for i in (0, 1)}
    assert "".join(c.text for c in by[0]) == " the" and by[0][-1].finish_reason == "stop"
    assert [t for c in by[0] for t in c.token_ids] == [THE, *CRAB]
    assert "".join(c.text for c in by[1]) == " the" * 4 and by[1][-1].finish_reason == "length"
    assert [c.finished for c in out] == [False] * (len(out) - 1) + [True]


def test_a_model_without_a_tokenizer_streams_ids_only():
    params = pb.SamplingParams(max_tokens=4, stop=["x"])
    out = run(OutputProcessor(None, [1, 2], params), worker_stream([5, 6, 7], [1], "length"))
    assert [t for c in out for t in c.token_ids] == [5, 6, 7]
    assert all(c.text == "" for c in out) and out[-1].finish_reason == "length"
