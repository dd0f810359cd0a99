"""The decode groups' mask is additive, made once per batch in the model's dtype: attention over it
gives the bits SDPA gives for the bool mask it would otherwise convert at every layer."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.model.attention import decode_attention


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([torch.float32, torch.bfloat16]), st.integers(1, 8), st.integers(1, 64),
       st.integers(0, 2**31 - 1))
def test_the_additive_mask_attends_as_the_bool_one(dtype, seqs, width, seed):
    gen = torch.Generator().manual_seed(seed)
    kv_heads, group, d = 2, 3, 16
    q = torch.randn(seqs, kv_heads * group, d, generator=gen).to(dtype)
    k, v = (torch.randn(seqs, kv_heads, width, d, generator=gen).to(dtype) for _ in range(2))
    lens = torch.randint(1, width + 1, (seqs,), generator=gen)
    attend = (torch.arange(width)[None, :] < lens[:, None])[:, None, None, :]
    additive = torch.zeros(attend.shape, dtype=dtype).masked_fill_(~attend, float("-inf"))
    assert torch.equal(decode_attention(q, k, v, additive), decode_attention(q, k, v, attend))
