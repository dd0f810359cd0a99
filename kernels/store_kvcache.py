"""KV store: this step's K/V rows into the paged cache at slot_mapping (replaces `write_kv`).

    k, v      [T, kv_heads, d]                  may be strided views (slices of the qkv output)
    k_cache   [num_blocks, block_size, kv_heads, d]   contiguous; slot s = block * block_size + offset
    stored    (k / k_scale).to(cache dtype)     scale 1.0 unless the cache is fp8 (e4m3): then clamped
                                                to +-448 first, as attention.quantize does
A program copies BLOCK_T token rows (common.rows_per_program) of kv_heads * d elements of K and
of V; a slot < 0 is skipped.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import CACHE_DTYPES, COMPUTE_DTYPES, check_last_dim_contiguous, interpreted, next_pow2, rows_per_program, to_dtype


@triton.jit
def _round_e4m3(x):
    """Round-to-nearest-even onto the e4m3 grid in float32 arithmetic (exponent read from the bits,
    3 mantissa bits; below 2^-6 the subnormal step 2^-9), saturating at 448. Only used under the
    interpreter, whose float32 -> fp8 cast drops the carry when rounding crosses a power of two
    (1.99 -> 1.0); on a GPU the hardware cast does this."""
    a = tl.abs(x)
    exp = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, -6)
    step = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)
    y = a / step
    r = tl.floor(y + 0.5)
    odd = (r.to(tl.int32) & 1) == 1
    r = tl.where((r - y == 0.5) & odd, r - 1.0, r)
    return tl.where(x < 0, -1.0, 1.0) * tl.minimum(r * step, 448.0)


@triton.jit
def _store_kvcache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale, v_scale, num_rows,
                          stride_kt, stride_kh, stride_vt, stride_vh,
                          HEAD_DIM: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
                          IS_FP8: tl.constexpr, ROUND_E4M3: tl.constexpr):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    slot = tl.load(slot_ptr + t, mask=t < num_rows, other=-1).to(tl.int64)[:, None]   # [BLOCK_T, 1]
    t = t[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    mask = offs + tl.where(slot >= 0, 0, ROW) < ROW                   # nothing for slot < 0
    head, dim = offs // HEAD_DIM, offs % HEAD_DIM
    k = tl.load(k_ptr + t * stride_kt + head * stride_kh + dim, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + t * stride_vt + head * stride_vh + dim, mask=mask, other=0.0).to(tl.float32)
    k, v = k / k_scale, v / v_scale
    if IS_FP8:
        k = tl.minimum(tl.maximum(k, -448.0), 448.0)
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    if ROUND_E4M3:
        k, v = _round_e4m3(k), _round_e4m3(v)
    tl.store(k_cache_ptr + slot * ROW + offs, to_dtype(k, k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, to_dtype(v, v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    t, kv_heads, d = k.shape
    assert v.shape == k.shape and k_cache.shape == v_cache.shape, (k.shape, v.shape, k_cache.shape)
    assert k_cache.shape[2:] == (kv_heads, d), f"cache {tuple(k_cache.shape)} vs k {tuple(k.shape)}"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV cache layers must be contiguous"
    assert k.dtype in COMPUTE_DTYPES and v.dtype == k.dtype, (k.dtype, v.dtype)
    assert k_cache.dtype in CACHE_DTYPES and v_cache.dtype == k_cache.dtype, k_cache.dtype
    assert slot_mapping.shape == (t,) and slot_mapping.dtype in (torch.int32, torch.int64)
    check_last_dim_contiguous("k", k)
    check_last_dim_contiguous("v", v)
    if t == 0:
        return
    row = kv_heads * d
    rows = rows_per_program(t)
    _store_kvcache_kernel[(triton.cdiv(t, rows),)](
                                k, v, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale), t,
                                k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                HEAD_DIM=d, ROW=row, BLOCK=next_pow2(row), BLOCK_T=rows,
                                IS_FP8=k_cache.dtype == torch.float8_e4m3fn,
                                ROUND_E4M3=interpreted() and k_cache.dtype == torch.float8_e4m3fn)
