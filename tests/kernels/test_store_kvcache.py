"""store_kvcache writes exactly what the torch reference's write_kv writes, and nothing else."""
from __future__ import annotations

import pytest
import torch

from kernels.store_kvcache import store_kvcache
from services.engine.model.attention import write_kv
from tests.kernels.helpers import make_case


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_matches_write_kv_from_strided_views(dtype):
    case = make_case([(5, 1), (0, 7), (9, 3)], dtype=dtype)
    assert not case.k.is_contiguous()  # the model hands over slices of the qkv output
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    store_kvcache(case.k, case.v, k_cache, v_cache, case.batch.slot_mapping)
    ref_k, ref_v = case.k_cache.clone(), case.v_cache.clone()
    write_kv(case.k, case.v, ref_k, ref_v, case.batch.slot_mapping)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert not torch.equal(k_cache, case.k_cache)  # it did write


def test_negative_slots_are_skipped():
    case = make_case([(0, 4)])
    slots = case.batch.slot_mapping.clone()
    slots[1] = -1
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    store_kvcache(case.k, case.v, k_cache, v_cache, slots)
    flat_before, flat_after = case.k_cache.flatten(0, 1), k_cache.flatten(0, 1)
    untouched = int(case.batch.slot_mapping[1])
    assert torch.equal(flat_after[untouched], flat_before[untouched])
    assert torch.equal(flat_after[slots[0]], case.k[0]) and torch.equal(flat_after[slots[2]], case.k[2])


def test_fp8_cache_stores_scaled_e4m3():
    """The agreed fp8 interface: stored = (k / k_scale).to(float8_e4m3fn), read as stored * k_scale."""
    case = make_case([(3, 1), (0, 6)], cache_dtype=torch.float8_e4m3fn)
    k_scale, v_scale = 0.5, 2.0
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    store_kvcache(case.k, case.v, k_cache, v_cache, case.batch.slot_mapping, k_scale, v_scale)
    slots = case.batch.slot_mapping
    stored_k, stored_v = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]
    assert stored_k.dtype == torch.float8_e4m3fn
    assert torch.equal(stored_k.float(), (case.k / k_scale).to(torch.float8_e4m3fn).float())
    assert torch.equal(stored_v.float(), (case.v / v_scale).to(torch.float8_e4m3fn).float())
    # e4m3 keeps 3 mantissa bits: within 1/16 relative of the value after dequantization
    torch.testing.assert_close(stored_k.float() * k_scale, case.k, rtol=0.0625, atol=1e-2)


def test_launcher_rejects_a_mismatched_cache():
    case = make_case([(0, 2)])
    with pytest.raises(AssertionError):
        store_kvcache(case.k, case.v, case.k_cache[..., :16].contiguous(), case.v_cache[..., :16].contiguous(),
                      case.batch.slot_mapping)


def test_fp8_rounding_at_ties_subnormals_and_powers_of_two():
    """Values that round up across a power of two, ties (to even) and e4m3 subnormals (step 2^-9)."""
    values = torch.tensor([1.99, -3.99, 1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10, 0.0, -0.3, 440.0, 1e-4,
                           1000.0, -5e4])                            # the last two clamp to +-448
    k = values.repeat(2, 1).view(2, 1, -1)                      # [T=2, kv_heads=1, d=12]
    k_cache = torch.zeros(1, 2, 1, 12, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    store_kvcache(k, k, k_cache, v_cache, torch.tensor([0, 1]))
    assert torch.equal(k_cache.flatten().float(), k.flatten().clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert k_cache.flatten()[-2:].float().tolist() == [448.0, -448.0]
