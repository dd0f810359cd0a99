"""vLLM's sampling parameters, as vLLM 0.32 ran them, reproduced by kvfleet's LLMEngine.

data/vllm_sampling_params.json was recorded once by `loadtests/check_vllm_sampling.py` (vLLM CPU,
float32, the tiny checkpoint; command and versions in docs/engine.md, "Sampling parameters"):
17 deterministic cases (greedy with repetition / presence / frequency penalties and logit_bias,
min_tokens barring EOS, stop_token_ids and stop strings, include_stop_str_in_output,
skip_special_tokens=False with and without spaces_between_special_tokens, and two sampled rows
whose top_k=1 / min_p=1 leave one candidate), each with vLLM's token ids, text, finish reason,
and the chosen and top-2 logprobs in both logprobs modes (raw: vLLM's default).

Here the same cases run through kvfleet's engine in one batch, once per logprobs mode, and every
case must give vLLM's ids, text and finish reason, with logprobs within 1e-4.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.check_vllm_sampling import compare, kvfleet_replay
from services.engine.tokenizer import Tokenizer

DATA = json.loads((Path(__file__).parent / "data" / "vllm_sampling_params.json").read_text())
CASES = {c["name"]: (i, c) for i, c in enumerate(DATA["cases"])}
TOLERANCE = 1e-4
MODES = ("raw_logprobs", "processed_logprobs")


@pytest.fixture(scope="module")
def replay(tiny_model_dir):
    return kvfleet_replay(str(tiny_model_dir), DATA)


def test_the_prompts_are_kvfleets_tokenization_too(tiny_model_dir):
    tok = Tokenizer.from_dir(tiny_model_dir)
    assert all(tok.encode(c["prompt"]) == c["prompt_token_ids"] for c in DATA["cases"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_kvfleet_reproduces_vllm(replay, name, mode):
    i, case = CASES[name]
    kv = replay[mode][i]
    result = compare(case, kv, mode, TOLERANCE)
    assert kv["token_ids"] == case["vllm_token_ids"], result
    assert kv["text"] == case["vllm_text"], result
    assert kv["finish_reason"] == case["finish_reason"], result
    assert result["ok"], result


def test_the_cases_test_what_they_name():
    """The recording shows each parameter acting, so agreeing with it means something."""
    by = {name: c for name, (_, c) in CASES.items()}
    plain = by["greedy_plain"]
    # a penalty changes vLLM's processed distribution (and, below 1, the greedy pick)
    assert by["greedy_repetition_1.3"]["processed_logprobs"] != plain["processed_logprobs"]
    assert by["greedy_repetition_0.7"]["vllm_token_ids"] != by["greedy_presence_frequency"][
        "vllm_token_ids"]
    # min_tokens: the forced EOS / stop token comes right after min_tokens outputs
    assert by["min_tokens_bars_eos"]["vllm_token_ids"][6:] == [4084]
    assert len(by["min_tokens_bars_stop_token_ids"]["vllm_token_ids"]) == 6
    assert by["min_tokens_bars_stop_strings"]["vllm_text"] == " the the the "
    assert by["include_stop_str_in_output"]["vllm_text"] == " the the the the"
    assert by["eos_text_included"]["vllm_text"].endswith("<|eot_id|>")
    assert "<|eot_id|>" not in by["eos_text_excluded"]["vllm_text"]
    # raw logprobs are the model's; processed ones saw the bias (0.0: one candidate left)
    assert by["min_tokens_bars_stop_strings"]["raw_logprobs"][0] < -10
    assert by["top_k_1_with_temperature"]["processed_logprobs"] == [0.0] * 16
