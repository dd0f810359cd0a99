"""RMSNorm, optionally fused with the residual add before it (LlamaRMSNorm's order of operations).

    x, residual  [T, hidden]   (residual: optional)
    h = x + residual                       rounded to x's dtype (what `x + residual` gives in torch)
    out = weight * (h_f32 * rsqrt(mean(h_f32^2) + eps)).to(dtype)
    -> out [T, hidden], and h when residual was given (the next residual)
BLOCK_T rows per program (common.rows_per_program); hidden fits one block (<= 64K elements).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import COMPUTE_DTYPES, next_pow2, rows_per_program, to_dtype


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, eps, num_rows, stride_x, stride_r, stride_o, stride_h,
                    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]   # [BLOCK_T, 1]
    offs = tl.arange(0, BLOCK)[None, :]                                               # [1, BLOCK]
    mask = (t < num_rows) & (offs < HIDDEN)
    x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        x = to_dtype(x + r, h_ptr.dtype.element_ty)
        tl.store(h_ptr + t * stride_h + offs, x, mask=mask)
        x = x.to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, 1) / HIDDEN + eps)[:, None]
    normed = to_dtype(normed, out_ptr.dtype.element_ty).to(tl.float32)  # cast back, then scale
    w = tl.load(w_ptr + offs, mask=offs < HIDDEN, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, to_dtype(w * normed, out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """-> out, or (out, x + residual) when residual is given."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.dtype in COMPUTE_DTYPES, (x.shape, x.stride(), x.dtype)
    t, hidden = x.shape
    assert weight.shape == (hidden,) and weight.is_contiguous() and weight.dtype == x.dtype, weight.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    h = out if residual is None else torch.empty_like(out)
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1 and residual.dtype == x.dtype
    res = x if residual is None else residual
    if t:
        rows = rows_per_program(t)
        _rmsnorm_kernel[(triton.cdiv(t, rows),)](
                              x, res, weight, out, h, float(eps), t, x.stride(0), res.stride(0), out.stride(0),
                              h.stride(0), HIDDEN=hidden, BLOCK=next_pow2(hidden), BLOCK_T=rows,
                              HAS_RESIDUAL=residual is not None, num_warps=4 if hidden <= 2048 else 8)
    return out if residual is None else (out, h)
