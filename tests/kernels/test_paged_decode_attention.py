"""Paged decode attention against the torch reference: GQA groups, block tables with holes,
context lengths across block and loop-tile boundaries, split partitions, fp16 / bf16 / fp8 caches."""
from __future__ import annotations

import pytest
import torch

from kernels.paged_decode_attention import paged_decode_attention
from tests.kernels.helpers import assert_close, make_case, reference_forward, triton_forward

DECODES = [(0, 1), (3, 1), (4, 1), (63, 1), (64, 1), (90, 1)]  # contexts 1 .. 91 tokens, block_size 4


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_decode_batch_matches_reference(heads, kv_heads):
    case = make_case(DECODES, heads=heads, kv_heads=kv_heads)
    out, k_cache, _ = triton_forward(case)
    ref, ref_k, _ = reference_forward(case)
    assert_close(out, ref, torch.float32)
    assert torch.equal(k_cache, ref_k)  # this step's K landed where the reference put it


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half_precision(dtype):
    case = make_case(DECODES, dtype=dtype)
    out, _, _ = triton_forward(case)
    assert out.dtype == dtype
    assert_close(out, reference_forward(case)[0], dtype)


@pytest.mark.parametrize("splits", [2, 3])
def test_split_partitions_combine_to_the_unsplit_answer(splits):
    """Flash-decoding: partitions of 64 tokens, some empty for the short contexts."""
    case = make_case([(150, 1), (20, 1), (100, 1)], block_size=8)
    from services.engine.model.triton_backend import TritonAttentionBackend
    meta = TritonAttentionBackend().build_metadata(case.batch, case.block_size, torch.float32)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    from kernels.store_kvcache import store_kvcache
    store_kvcache(case.k, case.v, k_cache, v_cache, meta.slot_mapping)
    outs = []
    for n in (1, splits):
        out = torch.zeros(case.q.shape)
        paged_decode_attention(case.q, k_cache, v_cache, out, meta.decode_rows, meta.decode_seqs, meta.seq_lens,
                               meta.block_tables, meta.max_decode_len, num_splits=n)
        outs.append(out)
    assert_close(outs[1], outs[0], torch.float32)
    assert_close(outs[1], reference_forward(case)[0], torch.float32)


def test_fp8_cache_reads_scaled_values():
    case = make_case(DECODES, cache_dtype=torch.float8_e4m3fn)
    out, _, _ = triton_forward(case, k_scale=0.5, v_scale=2.0)
    assert_close(out, reference_forward(case, k_scale=0.5, v_scale=2.0)[0], torch.float32)
    # the scales matter: reading the same cache as if unscaled gives another answer
    assert not torch.allclose(out, reference_forward(case)[0], atol=1e-2)


def test_rows_of_other_sequences_are_left_alone():
    case = make_case([(5, 1), (0, 3), (7, 1)])
    from services.engine.model.triton_backend import TritonAttentionBackend
    meta = TritonAttentionBackend().build_metadata(case.batch, case.block_size, torch.float32)
    out = torch.full(case.q.shape, 7.0)
    paged_decode_attention(case.q, case.k_cache, case.v_cache, out, meta.decode_rows, meta.decode_seqs,
                           meta.seq_lens, meta.block_tables, meta.max_decode_len)
    assert torch.all(out[1:4] == 7.0)                        # the prefill chunk's rows
    assert not torch.any(out[0] == 7.0) and not torch.any(out[4] == 7.0)
