"""The engine end to end on the tiny model: reference equivalence, streaming, stop strings,
seeds, cancellation, the disaggregated roles, and bad input."""
from __future__ import annotations


import pytest
import torch

from services.engine import errors
from services.engine.engine import LLMEngine, engine_config
from services.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import export_kv, import_kv

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(engine_config(str(tiny_model_dir), token_budget=64, chunk_size=7,
                                   max_running=32, kv_cache_mib=64, reject_late=False))


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32).eval()


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_greedy_generation_matches_transformers_in_a_mixed_batch(tiny_model_dir, reference, chunk):
    """Several prompts of different lengths at once (prefill chunks of 1, 7 or 64 tokens, decodes
    mixed with prefills): every generated token and its logprob, and every prompt logprob, match
    the reference model."""
    engine = LLMEngine(engine_config(str(tiny_model_dir), token_budget=max(chunk, 32),
                                     chunk_size=chunk, max_running=32, kv_cache_mib=16))
    tok = engine.tokenizer
    prompts = ["The quick brown fox", "Once upon a time, in a land far away, there lived",
               "def main():\n    return 42\n" * 3, "Zebra"]
    params = SamplingParams(max_tokens=12, logprobs=2, prompt_logprobs=0, **GREEDY)
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt) + out.token_ids
        ref = reference_logprobs(reference, ids)
        n = len(out.prompt_token_ids)
        for i, lp in enumerate(out.logprobs):                      # generated tokens
            row = ref[n - 1 + i]
            top2 = row.topk(2).values
            if (top2[0] - top2[1]).item() < 1e-4:                  # near-tie: stop comparing
                break
            assert out.token_ids[i] == row.argmax().item()
            assert abs(lp.logprob - row[out.token_ids[i]].item()) <= 1e-4
        assert out.prompt_logprobs[0] is None                       # echo: prompt tokens
        for pos in range(1, n):
            assert abs(out.prompt_logprobs[pos].logprob - ref[pos - 1, ids[pos]].item()) <= 1e-4


def test_streamed_deltas_add_up_to_the_completion(engine):
    rid = engine.add_request("Streaming works one token at a time",
                             SamplingParams(max_tokens=10, **GREEDY))
    tokens, text, finished = [], "", []
    for out in engine.stream():
        if out.request_id == rid:
            tokens += out.new_token_ids
            text += out.new_text
            finished.append(out.finished)
    assert len(tokens) == 10 and finished[-1] and not any(finished[:-1])
    assert text == engine.tokenizer.decode(tokens)


def test_stop_string_ends_the_request_and_is_not_returned(engine):
    (full,) = engine.generate(["Tell me a story"], SamplingParams(max_tokens=24, **GREEDY))
    stop = full.text[5:8]
    assert stop.strip(), "the tiny model's continuation should contain text to stop on"
    (out,) = engine.generate(["Tell me a story"],
                             SamplingParams(max_tokens=24, stop=(stop,), **GREEDY))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:full.text.index(stop)]
    assert engine.pool.num_used == 0 and engine.pool.num_reserved == 0


def test_seeded_sampling_is_reproducible_whatever_else_runs(engine):
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234,
                       ignore_eos=True)
    (alone,) = engine.generate(["A seeded request"], p)
    crowd = engine.generate(["noise one", "A seeded request", "noise two"],
                            [SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True), p,
                             SamplingParams(max_tokens=9, temperature=0.5, seed=9, ignore_eos=True)])
    assert crowd[1].token_ids == alone.token_ids


def test_cancel_frees_every_block_immediately(engine):
    ids = [engine.add_request("cancel me " * 20, SamplingParams(max_tokens=50, **GREEDY))
           for _ in range(3)]
    engine.step()
    engine.step()
    assert engine.stats().kv_blocks_reserved > 0
    for rid in ids:
        assert engine.cancel(rid)
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_reserved == 0
    finals = [o for o in engine.step() if o.request_id in ids]
    assert {o.finish_reason for o in finals} == {"abort"} and len(finals) == 3
    assert not engine.cancel(ids[0])


@pytest.mark.parametrize("prompt, params, kwargs, error", [
    ("", SamplingParams(), {}, errors.EmptyPromptError),
    ([], SamplingParams(), {}, errors.EmptyPromptError),
    ([1] * 50_000, SamplingParams(), {"traffic_class": "document"}, errors.ContextLengthError),
    ([1] * 9000, SamplingParams(), {}, errors.ContextLengthError),   # interactive max prompt 8K
    ("hi", SamplingParams(max_tokens=0), {}, errors.InvalidMaxTokensError),
    ("hi", SamplingParams(max_tokens=-3), {}, errors.InvalidMaxTokensError),
    # prompt + max_tokens (clamped to the class output cap first) past the 40,960-token context
    ([1] * 40_000, SamplingParams(max_tokens=1000), {"traffic_class": "document"},
     errors.ContextLengthError),
    ([5, 4096], SamplingParams(), {}, errors.TokenOutOfVocabError),
    ([5, -1], SamplingParams(), {}, errors.TokenOutOfVocabError),
    ("hi", SamplingParams(), {"tenant": "nobody"}, errors.UnknownTenantError),
    ("hi", SamplingParams(), {"traffic_class": "vip"}, errors.UnknownClassError),
    ("hi", SamplingParams(temperature=-1), {}, errors.InvalidSamplingError),
    ("hi", SamplingParams(top_p=0.0), {}, errors.InvalidSamplingError),
])
def test_bad_input_gets_a_typed_error_and_the_engine_keeps_serving(engine, prompt, params,
                                                                   kwargs, error):
    good = engine.add_request("a healthy neighbour", SamplingParams(max_tokens=6, **GREEDY))
    engine.step()
    with pytest.raises(error) as info:
        engine.add_request(prompt, params, **kwargs)
    assert info.value.code and len(info.value.message) > 10
    outs = [o for o in engine.stream() if o.request_id == good]
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outs) == 6
    assert engine.pool.num_used == 0 and engine.pool.num_reserved == 0


def test_prefill_and_decode_roles_hand_over_kv_and_match_the_mixed_engine(tiny_model_dir, engine):
    """Prefill role samples the first token and exports the prompt's KV; the decode role reserves,
    imports it and continues: the result equals the co-located engine's."""
    params = SamplingParams(max_tokens=10, logprobs=0, **GREEDY)
    prompt = "Disaggregated serving moves the KV cache between workers"
    (mixed,) = engine.generate([prompt], params)
    prefill = LLMEngine(engine_config(str(tiny_model_dir), role="prefill", kv_cache_mib=16))
    decode = LLMEngine(engine_config(str(tiny_model_dir), role="decode", kv_cache_mib=16))
    ids = decode.tokenizer.encode(prompt)
    blocks = decode.reserve_remote(ids, params, request_id="r1")   # 1. reserve on decode
    assert blocks is not None and decode.stats().kv_blocks_reserved > 0
    rid = prefill.add_request(ids, params, request_id="r1")        # 2. prefill
    first = [o for o in prefill.stream()]
    assert first[-1].prefilled and first[-1].finish_reason is None and len(first[-1].new_token_ids) == 1
    kv = export_kv(prefill, rid)                                      # 3. transfer
    prefill.release(rid)
    assert prefill.stats().kv_blocks_used == 0
    import_kv(decode, "r1", kv, first[-1].new_token_ids[0])          # 4. decode
    rest = [t for o in decode.stream() for t in o.new_token_ids]
    assert first[-1].new_token_ids + rest == mixed.token_ids
    assert decode.stats().kv_blocks_used == 0 and decode.stats().kv_blocks_reserved == 0


def test_stats_describe_the_kv_pool(engine):
    s = engine.stats()
    assert s.kv_blocks_total == engine.pool.num_blocks
    assert s.kv_blocks_free + s.kv_blocks_used == s.kv_blocks_total
    assert s.steps > 0 and s.decode_tokens > 0 and s.prefill_tokens > 0


@pytest.mark.parametrize("end", ["max_tokens", "stop_token_id"])
def test_a_completion_ending_mid_character_leaves_the_incomplete_bytes_out(engine, end):
    """As vLLM's detokenizer: an output whose last token is the first byte of a 3-byte character
    (forced by logit_bias; kept as a stop token with include_stop_str_in_output, or cut by
    max_tokens) ends at its last complete character, with no U+FFFD."""
    lead_byte = engine.tokenizer.raw.token_to_id("ä")     # byte-level BPE: the byte 0xE4 alone
    assert lead_byte is not None
    force = {lead_byte: 100.0}
    params = (SamplingParams(max_tokens=1, logit_bias=force, **GREEDY) if end == "max_tokens" else
              SamplingParams(max_tokens=4, temperature=0.0, logit_bias=force,
                             stop_token_ids=[lead_byte], include_stop_str_in_output=True))
    (out,) = engine.generate(["Half a character: "], params)
    assert out.token_ids == [lead_byte]
    assert out.text == ""
