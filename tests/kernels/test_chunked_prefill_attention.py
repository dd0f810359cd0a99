"""Chunked-prefill attention against the torch reference, on ragged batches that mix decode rows,
first chunks and later chunks (causal with the chunk's offset) of different lengths."""
from __future__ import annotations

import pytest
import torch

from services.engine.model.triton_backend import TritonAttentionBackend
from kernels.chunked_prefill_attention import chunked_prefill_attention
from tests.kernels.helpers import assert_close, make_case, reference_forward, triton_forward

# decode, first chunk, a chunk at offset 9 (mid-block), a 70-token chunk (two query tiles) at 30, decode
MIXED = [(12, 1), (0, 5), (9, 6), (30, 70), (2, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mixed_ragged_batch_matches_reference(dtype):
    case = make_case(MIXED, dtype=dtype)
    out, k_cache, v_cache = triton_forward(case)
    ref, ref_k, ref_v = reference_forward(case)
    assert_close(out, ref, dtype)
    if dtype == torch.float32:
        assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_gqa_group_of_four_and_contiguous_q():
    case = make_case([(0, 9), (17, 4), (5, 1)], heads=8, kv_heads=2, head_dim=16, block_size=8, strided_q=False)
    assert_close(triton_forward(case)[0], reference_forward(case)[0], torch.float32)


def test_causality_a_later_key_does_not_change_earlier_rows():
    """Rewriting the chunk's last K/V changes only the chunk's last query row."""
    case = make_case([(6, 5)])
    out, _, _ = triton_forward(case)
    case.k[-1] += 3.0
    case.v[-1] -= 3.0
    changed, _, _ = triton_forward(case)
    assert torch.equal(changed[:-1], out[:-1])
    assert not torch.allclose(changed[-1], out[-1])


def test_fp8_cache():
    case = make_case(MIXED, cache_dtype=torch.float8_e4m3fn)
    out, _, _ = triton_forward(case, k_scale=0.25, v_scale=0.5)
    assert_close(out, reference_forward(case, k_scale=0.25, v_scale=0.5)[0], torch.float32)


def test_only_the_selected_sequences_rows_are_written():
    case = make_case([(0, 3), (4, 1), (2, 2)])
    meta = TritonAttentionBackend().build_metadata(case.batch, case.block_size, torch.float32)
    out = torch.full(case.q.shape, 7.0)
    chunked_prefill_attention(case.q, case.k_cache, case.v_cache, out, meta.prefill_seqs[1:],
                              meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.max_prefill_q_len)
    assert torch.all(out[:4] == 7.0)                       # sequence 0 (not selected) and the decode row
    assert not torch.any(out[4:] == 7.0)
