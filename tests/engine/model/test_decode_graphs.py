"""Decode steps padded to fixed batch sizes (services/engine/model/decode_graphs.py), on the CPU:
the padded forward runs eagerly through the same static buffers a CUDA graph replays, so these
stories prove the padding and the buffers; only the capture itself needs CUDA.

Two runners share the model, each with its own KV cache: the plain ModelRunner (unpadded) and the
DecodeGraphRunner. They prefill the same prompts, then decode the same tokens; their logits agree
within the equivalence tests' tolerance, and padded rows never write the KV cache."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.engine.model import KVCache, ModelRunner, load_model
from services.engine.model.decode_graphs import (MAX_CAPTURE_SIZE, DecodeGraphConfig,
                                                 DecodeGraphRunner, capture_sizes)
from tests.engine.model.helpers import Seq, ShuffledBlockIds, random_tokens

BLOCK = 16
NUM_BLOCKS = 96
TOLERANCE = 1e-4   # max |log_softmax(padded) - log_softmax(unpadded)| (test_runner.py's)


@pytest.fixture(scope="module")
def model(config_b_dir):
    return load_model(config_b_dir)


def cache(model, dtype=torch.float32) -> KVCache:
    return KVCache(model.config, NUM_BLOCKS, BLOCK, dtype)


def padded(model, kv: KVCache, max_batch: int = 16, max_model_len: int = 4096) -> DecodeGraphRunner:
    return DecodeGraphRunner(ModelRunner(model, kv), DecodeGraphConfig(max_batch, max_model_len,
                                                                       capture=False))


def prefilled(runners, lengths, seed=0, pool=None) -> list[Seq]:
    """Sequences of `lengths` prompt tokens, prefilled by every runner; room for 64 more tokens."""
    pool = pool or ShuffledBlockIds(NUM_BLOCKS, seed=seed)
    seqs = [Seq(random_tokens(n, seed=seed + n) + [0] * 64, pool, BLOCK) for n in lengths]
    chunks = [s.chunk(n, "last") for s, n in zip(seqs, lengths)]
    logits = [r.execute(chunks) for r in runners]
    for s, token in zip(seqs, logits[0].argmax(-1).tolist()):
        s.tokens[s.computed] = token
    return seqs


def decode_step(seqs: list[Seq]):
    return [s.chunk(1, "last") for s in seqs]


def lp_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.log_softmax(-1) - b.log_softmax(-1)).abs().max().item()


def test_sizes_are_powers_of_two_up_to_the_batch_the_scheduler_runs():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(5) == (1, 2, 4, 8)
    assert capture_sizes(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert capture_sizes(10_000)[-1] == MAX_CAPTURE_SIZE
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        capture_sizes(0)
    with pytest.raises(ValueError, match="max_batch >= 1 and max_model_len >= 1"):
        DecodeGraphConfig(0, 4096, capture=False)


def test_padded_greedy_decode_gives_the_unpadded_tokens_and_logprobs(model):
    """Five sequences decode (padded to 8); two finish, three go on (padded to 4), one goes on
    alone (size 1, no padding): every step's logprobs within the tolerance, the same greedy token."""
    plain, graphs = ModelRunner(model, cache(model)), padded(model, cache(model))
    seqs = prefilled([plain, graphs], (40, 17, 5, 33, 1))
    for batch in [seqs] * 4 + [seqs[:3]] * 4 + [seqs[:1]] * 2:
        chunks = decode_step(batch)
        want, got = plain.execute(chunks), graphs.execute(chunks)
        assert got.shape == want.shape == (len(batch), model.config.vocab_size)
        assert lp_diff(got, want) <= TOLERANCE
        gap = want.topk(2).values.diff().abs().squeeze(-1)
        agree = got.argmax(-1) == want.argmax(-1)
        assert bool((agree | (gap < 1e-4)).all())
        for s, token in zip(batch, want.argmax(-1).tolist()):
            s.tokens[s.computed] = token
    assert graphs.padded_steps == 10
    assert (plain.kv_cache.data - graphs.kv_cache.data).abs().max().item() < 1e-4


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_padded_rows_write_nothing_to_the_kv_cache(model, kv_dtype):
    """Three sequences padded to four: after the step, the only cache slots that changed are the
    three the sequences wrote (the padding row's slot is -1; the torch path's stand-in slot is
    rewritten with what it held)."""
    graphs = padded(model, cache(model, kv_dtype))
    seqs = prefilled([graphs], (20, 9, 3), seed=5)
    before = graphs.kv_cache.data.clone()
    chunks = decode_step(seqs)
    graphs.execute(chunks)
    after = graphs.kv_cache.data
    # bytes, [layers, 2, blocks, block_size, ...] -> the (block, offset) slots that changed anywhere
    changed = (after.view(torch.uint8) != before.view(torch.uint8)).flatten(4).any(-1).any(0).any(0)
    changed = changed.nonzero().tolist()
    written = sorted([c.block_table[c.start_pos // BLOCK], c.start_pos % BLOCK] for c in chunks)
    assert sorted(changed) == written


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 70), min_size=1, max_size=9), seed=st.integers(0, 1000))
def test_any_decode_batch_padded_matches_unpadded(model, lengths, seed):
    """Whatever the batch's size and contexts, one padded decode step (from identical caches)
    gives the unpadded logprobs within the tolerance and writes the same cache slots."""
    plain = ModelRunner(model, cache(model))
    seqs = prefilled([plain], lengths, seed=seed)
    graphs = padded(model, KVCache.over(plain.kv_cache.data.clone()), max_batch=8)
    chunks = decode_step(seqs)
    want, got = plain.execute(chunks), graphs.execute(chunks)
    assert lp_diff(got, want) <= TOLERANCE
    assert graphs.padded_steps == (1 if len(lengths) <= 8 else 0)   # 9: past the largest size
    assert (plain.kv_cache.data - graphs.kv_cache.data).abs().max().item() < 1e-4


def test_steps_a_padded_decode_cannot_run_go_to_the_plain_runner(model):
    """A prefill chunk in the step, more sequences than the largest size, or a context past
    max_model_len: the step runs eagerly, unpadded, as before."""
    graphs, pool = padded(model, cache(model), max_batch=2, max_model_len=32), ShuffledBlockIds(NUM_BLOCKS)
    seqs = prefilled([graphs], (20, 9, 3), pool=pool)
    graphs.execute(decode_step(seqs))                    # three sequences: the largest size is 2
    assert graphs.padded_steps == 0
    more = Seq(random_tokens(8, seed=1) + [0] * 4, pool, BLOCK)
    graphs.execute([seqs[1].chunk(1, "last"), more.chunk(8, "last")])   # a decode beside a prefill
    assert graphs.padded_steps == 0
    graphs.execute([seqs[0].chunk(1, "last")])           # context 22 <= 32: padded
    assert graphs.padded_steps == 1
    seqs[0].computed = 40                                # context 41 > 32: eager
    graphs.execute([seqs[0].chunk(1, "last")])
    assert graphs.padded_steps == 1


def test_bad_ids_in_a_padded_step_are_refused_like_the_plain_runners(model):
    graphs = padded(model, cache(model))
    seqs = prefilled([graphs], (5,), seed=3)
    chunk = seqs[0].chunk(1, "last")
    with pytest.raises(ValueError, match="token id .* >= vocab_size"):
        graphs.execute([chunk.__class__([model.config.vocab_size], chunk.start_pos, chunk.block_table,
                                        chunk.logit_rows)])
    with pytest.raises(ValueError, match=f"block id {NUM_BLOCKS} >= num_blocks"):
        graphs.execute([chunk.__class__(chunk.token_ids, chunk.start_pos, [NUM_BLOCKS],
                                        chunk.logit_rows)])


def test_capturing_needs_the_triton_backend(model):
    with pytest.raises(ValueError, match="CUDA graphs need the triton attention backend"):
        DecodeGraphRunner(ModelRunner(model, cache(model)), DecodeGraphConfig(4, 64, capture=True))
