"""Property: on any small ragged batch, TritonAttentionBackend gives the torch reference's output."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.kernels.helpers import assert_close, make_case, reference_forward, triton_forward

seq_spec = st.tuples(st.integers(0, 40), st.integers(1, 12))            # (start_pos, q_len)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(seq_spec, min_size=1, max_size=4), block_size=st.sampled_from([1, 4, 16]),
       gqa=st.sampled_from([(2, 2), (4, 2), (4, 1)]), seed=st.integers(0, 2**16))
def test_random_batches_match_reference(specs, block_size, gqa, seed):
    heads, kv_heads = gqa
    case = make_case(specs, heads=heads, kv_heads=kv_heads, head_dim=16, block_size=block_size, seed=seed)
    out, k_cache, _ = triton_forward(case)
    ref, ref_k, _ = reference_forward(case)
    assert_close(out, ref, torch.float32)
    assert torch.equal(k_cache, ref_k)
