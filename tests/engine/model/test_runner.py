"""ModelRunner against transformers' LlamaForCausalLM: chunked prefill, mixed batches, greedy decode,
and positions past Llama-3's original context. Block size 16 with shuffled block ids throughout, so
chunks straddle blocks and block tables are never contiguous."""
from __future__ import annotations

import pytest
import torch

from services.engine.model import KVCache, ModelRunner, SeqChunk, TorchAttentionBackend, load_model
from tests.engine.model.helpers import (CONFIG_A, ShuffledBlockIds, Seq, load_reference, make_checkpoint,
                                        random_tokens, reference_logprobs)

BLOCK = 16
TOLERANCE = 1e-4  # max |log_softmax(ours) - log_softmax(transformers)|
NEAR_TIE = 1e-4   # greedy comparison stops once the top-2 logit gap is this small


@pytest.fixture(scope="module")
def model_a(config_a_dir):
    return load_model(config_a_dir)


@pytest.fixture(scope="module")
def model_b(config_b_dir):
    return load_model(config_b_dir)


def new_runner(model, num_blocks: int = 256) -> ModelRunner:
    return ModelRunner(model, KVCache(model.config, num_blocks, BLOCK, torch.float32))


def max_diff(logits: torch.Tensor, reference_logprobs: torch.Tensor) -> float:
    return (logits.log_softmax(-1) - reference_logprobs).abs().max().item()


@pytest.mark.parametrize("which", ["a", "b"])
@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_prompt_logprobs_match_transformers_for_any_chunk_size(request, which, chunk_size):
    model, hf = request.getfixturevalue(f"model_{which}"), request.getfixturevalue(f"hf_{which}")
    tokens = random_tokens(150, seed=3)
    runner = new_runner(model)
    seq = Seq(tokens, ShuffledBlockIds(256, seed=chunk_size), BLOCK)

    logits = []
    while seq.computed < len(tokens):
        logits.append(runner.execute([seq.chunk(min(chunk_size, len(tokens) - seq.computed))]))

    assert max_diff(torch.cat(logits), reference_logprobs(hf, tokens)) <= TOLERANCE


@pytest.mark.parametrize("which", ["a", "b"])
def test_one_step_mixing_decodes_and_prefills_at_different_stages(request, which):
    model, hf = request.getfixturevalue(f"model_{which}"), request.getfixturevalue(f"hf_{which}")
    runner, pool = new_runner(model), ShuffledBlockIds(256, seed=7)
    prompts = [random_tokens(n, seed=10 + i) for i, n in enumerate((60, 45, 33, 5, 1, 90))]
    seqs = [Seq(p, pool, BLOCK) for p in prompts]

    # earlier iterations leave the sequences at different stages
    runner.execute([seqs[0].chunk(59, "none"), seqs[1].chunk(20, "none"), seqs[3].chunk(4, "none"),
                    seqs[5].chunk(40, "none")])
    runner.execute([seqs[5].chunk(30, "none"), seqs[1].chunk(3, "last")])

    # this iteration: decode at 59 | chunk 23..44 | fresh 33-token prompt | decode at 4 |
    # 1-token prompt | chunk 70..89 sampling its last row only
    step = [seqs[0].chunk(1), seqs[1].chunk(22), seqs[2].chunk(33), seqs[3].chunk(1), seqs[4].chunk(1),
            seqs[5].chunk(20, "last")]
    logits = runner.execute(step)

    assert logits.shape == (1 + 22 + 33 + 1 + 1 + 1, model.config.vocab_size)
    for chunk, prompt, rows in zip(step, prompts, logits.split([len(c.logit_rows) for c in step])):
        positions = [chunk.start_pos + r for r in chunk.logit_rows]
        assert max_diff(rows, reference_logprobs(hf, prompt)[positions]) <= TOLERANCE, chunk.start_pos


def test_decodes_of_very_different_context_lengths_share_a_step(model_a, hf_a):
    """Decodes are grouped by context length (a power-of-two number of blocks per group) so a long
    context doesn't pad the short ones; a decode-only step spanning four groups stays exact."""
    runner, pool = new_runner(model_a), ShuffledBlockIds(256, seed=11)
    prompts = [random_tokens(n, seed=30 + i) for i, n in enumerate((6, 40, 150, 17, 300))]
    seqs = [Seq(p, pool, BLOCK) for p in prompts]
    runner.execute([s.chunk(len(p) - 1, "none") for s, p in zip(seqs, prompts)])

    logits = runner.execute([s.chunk(1) for s in seqs])

    for row, prompt in zip(logits, prompts):
        assert max_diff(row[None], reference_logprobs(hf_a, prompt)[-1:]) <= TOLERANCE


def test_greedy_decoding_matches_transformers_generate(model_a, hf_a):
    new_tokens = 24
    prompts = [random_tokens(n, seed=20 + i) for i, n in enumerate((12, 30, 7))]
    runner, pool = new_runner(model_a), ShuffledBlockIds(256, seed=3)
    seqs = [Seq(list(p), pool, BLOCK) for p in prompts]

    logits = runner.execute([s.chunk(len(s.tokens), "last") for s in seqs])
    gaps = []
    for _ in range(new_tokens):
        top2 = logits.topk(2, dim=-1).values
        gaps.append((top2[:, 0] - top2[:, 1]).tolist())
        for seq, token in zip(seqs, logits.argmax(-1).tolist()):
            seq.tokens.append(token)
        logits = runner.execute([s.chunk(1, "last") for s in seqs])  # batched decode step

    compared = 0
    for i, (seq, prompt) in enumerate(zip(seqs, prompts)):
        expected = hf_generate(hf_a, prompt, new_tokens)
        for step, (ours, theirs) in enumerate(zip(seq.tokens[len(prompt):], expected)):
            if gaps[step][i] < NEAR_TIE:
                break
            assert ours == theirs, f"prompt {i}, step {step}"
            compared += 1
    assert compared >= len(prompts) * new_tokens // 2  # near-ties are rare: the comparison is not vacuous


def test_long_prefills_split_into_query_blocks_give_the_same_logprobs(model_a, hf_a):
    """A tiny score budget forces many SDPA calls per chunk (the memory bound for 32K contexts)."""
    runner = ModelRunner(model_a, KVCache(model_a.config, 64, BLOCK, torch.float32),
                         TorchAttentionBackend(model_a.config.num_heads, max_score_elements=8 * 8 * 100))
    tokens = random_tokens(100, seed=8)
    seq = Seq(tokens, ShuffledBlockIds(64, seed=8), BLOCK)
    logits = torch.cat([runner.execute([seq.chunk(n)]) for n in (40, 60)])
    assert max_diff(logits, reference_logprobs(hf_a, tokens)) <= TOLERANCE


def test_runner_rejects_ids_outside_the_cache_or_vocab(model_b):
    runner = new_runner(model_b, num_blocks=4)
    with pytest.raises(ValueError, match="block id 4"):
        runner.execute([SeqChunk([1, 2], 0, [4], (1,))])
    with pytest.raises(ValueError, match="token id 4096"):
        runner.execute([SeqChunk([4096], 0, [0], (0,))])
    assert runner.execute([]).shape == (0, 4096)


def hf_generate(hf, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def long_context_dir(tmp_path_factory):
    """Config A's shape and llama3 RoPE with one layer: the attention cost of a 9K prompt, quartered."""
    return make_checkpoint(tmp_path_factory.mktemp("config-a-1-layer"), seed=4,
                           **{**CONFIG_A, "num_hidden_layers": 1})


def test_positions_past_the_original_context_use_llama3_scaling(long_context_dir):
    """A 8704-token prompt in 512-token chunks, then a decode at position 8704 (original max 8192)."""
    model, hf = load_model(long_context_dir), load_reference(long_context_dir)
    tokens = random_tokens(8705, seed=5)
    runner = new_runner(model, num_blocks=8705 // BLOCK + 8)
    seq = Seq(tokens, ShuffledBlockIds(8705 // BLOCK + 8, seed=5), BLOCK)

    logits = []
    while seq.computed < 8704:  # logits for the two chunks either side of 8192 only
        logits.append(runner.execute([seq.chunk(512, "all" if seq.computed >= 7680 else "none")]))
    logits.append(runner.execute([seq.chunk(1)]))

    with torch.inference_mode():  # transformers in one pass, head on the last 1025 rows only
        reference = hf(torch.tensor([tokens]), logits_to_keep=1025).logits[0].log_softmax(-1)
    assert max_diff(torch.cat(logits), reference) <= TOLERANCE
