"""Admission policies and chunking change scheduling, never results: greedy outputs are the same
under `reserve` and under `predict` with preemption by recompute, and for any chunk size."""
from __future__ import annotations

from dataclasses import replace

import pytest

from services.engine.config import INTERACTIVE
from services.engine.engine import LLMEngine, engine_config
from services.engine.sampling_params import SamplingParams

PROMPTS = ["Paged attention keeps the KV cache in fixed blocks",
           "Chunked prefill interleaves long prompts with decoding",
           "A tenant's cache is salted so no other tenant can probe it",
           "Short", "Preemption recomputes what it gave back"]
PARAMS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def baseline(tiny_model_dir):
    engine = LLMEngine(engine_config(str(tiny_model_dir), kv_cache_mib=16, reject_late=False))
    return [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]


def test_predict_policy_preempts_and_recomputes_to_the_same_tokens(tiny_model_dir, baseline):
    # 20 blocks of 16 tokens cannot hold five ~12-token prompts growing to ~52 tokens each
    classes = (replace(INTERACTIVE, predicted_output_tokens=4),)
    engine = LLMEngine(engine_config(str(tiny_model_dir), num_blocks=12, admission="predict",
                                     classes=classes, reject_late=False))
    outs = engine.generate(PROMPTS, PARAMS)
    assert engine.stats().preemptions > 0
    assert [o.token_ids for o in outs] == baseline
    assert engine.pool.num_used == 0 and engine.pool.num_reserved == 0


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunk_size_does_not_change_the_output(tiny_model_dir, baseline, chunk):
    engine = LLMEngine(engine_config(str(tiny_model_dir), kv_cache_mib=16, chunk_size=chunk,
                                     token_budget=max(chunk, 32), max_running=32,
                                     reject_late=False))
    assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == baseline


def test_prefix_cache_hits_do_not_change_the_output(tiny_model_dir, baseline):
    engine = LLMEngine(engine_config(str(tiny_model_dir), kv_cache_mib=16, reject_late=False))
    engine.generate(PROMPTS, PARAMS)                         # warms the prefix cache
    cached_before = engine.stats().kv_blocks_cached
    again = engine.generate(PROMPTS, PARAMS)
    assert cached_before > 0
    assert engine.stats().prefill_tokens < 2 * sum(len(o.prompt_token_ids) for o in again)
    assert [o.token_ids for o in again] == baseline
