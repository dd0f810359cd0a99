"""RoPE (rotate-half form, as transformers' Llama) from cos/sin tables.

    x         [T, heads, d]   may be a strided view (the q and k heads of the qkv output)
    cos, sin  [T, d // 2]     rows of RotaryEmbedding's tables: Llama-3 frequency scaling is already
                              in them (rope.compute_inv_freq), so one kernel serves both kinds
    out       [T, heads, d]   contiguous: (x1 * cos - x2 * sin, x2 * cos + x1 * sin), x = (x1, x2)
Each product is rounded to x's dtype before the sum, as torch computes it in that dtype.
BLOCK_T token rows per program (common.rows_per_program), all heads at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import COMPUTE_DTYPES, check_last_dim_contiguous, next_pow2, rows_per_program, to_dtype


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, num_rows, stride_xt, stride_xh, stride_ct, stride_st,
                 HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 BLOCK_T: tl.constexpr):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None, None]   # [BLOCK_T, 1, 1]
    h = tl.arange(0, BLOCK_H)[None, :, None]                                              # [1, BLOCK_H, 1]
    j = tl.arange(0, BLOCK_HALF)[None, None, :]                                           # [1, 1, BLOCK_HALF]
    t_mask = (t < num_rows) & (j < HALF)
    mask = t_mask & (h < HEADS)
    cos = tl.load(cos_ptr + t * stride_ct + j, mask=t_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_st + j, mask=t_mask, other=0.0).to(tl.float32)
    base = x_ptr + t * stride_xt + h * stride_xh + j
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    o1 = to_dtype(x1 * cos, dt).to(tl.float32) - to_dtype(x2 * sin, dt).to(tl.float32)
    o2 = to_dtype(x2 * cos, dt).to(tl.float32) + to_dtype(x1 * sin, dt).to(tl.float32)
    obase = out_ptr + t * (HEADS * 2 * HALF) + h * (2 * HALF) + j
    tl.store(obase, to_dtype(o1, dt), mask=mask)
    tl.store(obase + HALF, to_dtype(o2, dt), mask=mask)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    t, heads, d = x.shape
    assert d % 2 == 0 and cos.shape == (t, d // 2) and sin.shape == cos.shape, (x.shape, cos.shape, sin.shape)
    assert x.dtype in COMPUTE_DTYPES and cos.dtype == x.dtype and sin.dtype == x.dtype, (x.dtype, cos.dtype)
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("cos", cos)
    check_last_dim_contiguous("sin", sin)
    out = torch.empty((t, heads, d), dtype=x.dtype, device=x.device)
    if t:
        rows = rows_per_program(t)
        _rope_kernel[(triton.cdiv(t, rows),)](
            x, cos, sin, out, t, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
            HEADS=heads, HALF=d // 2, BLOCK_H=next_pow2(heads), BLOCK_HALF=next_pow2(d // 2), BLOCK_T=rows)
    return out
