"""Helpers every launcher shares: interpreter detection, dtype mapping, the dot operand dtype.

Triton decides at `@triton.jit` time whether a kernel is interpreted (TRITON_INTERPRET=1, read
when the kernel module is imported), so set the variable before importing any kernels.* module.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# torch dtype -> Triton dtype, for casts written as constexprs (store / dot dtypes)
TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
            torch.float8_e4m3fn: tl.float8e4nv}
COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CACHE_DTYPES = (*COMPUTE_DTYPES, torch.float8_e4m3fn)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_dtype(dtype: torch.dtype):
    """tl.dot operand dtype for a model dtype: fp16/bf16 on a GPU (tensor cores); fp32 under the
    interpreter (its bf16 arithmetic works on raw bits, triton-lang/triton#11584) and for fp32."""
    if interpreted() or dtype == torch.float32:
        return tl.float32
    return TL_DTYPE[dtype]


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    assert t.stride(-1) == 1, f"{name}: last dim must be contiguous, strides {t.stride()}"


def check_paged_attention(q, k_cache, v_cache, out, block_tables) -> None:
    """What both attention launchers need of their tensors: q, out [T, heads, d] of one compute
    dtype; k_cache, v_cache [num_blocks, block_size, kv_heads, d], contiguous, of one cache dtype;
    heads a multiple of kv_heads; block_tables [S, max_blocks] int32, rows contiguous."""
    _, heads, d = q.shape
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.shape[3] == d, k_cache.shape
    assert heads % k_cache.shape[2] == 0, f"{heads} query heads over {k_cache.shape[2]} kv heads"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.stride() == v_cache.stride()
    assert q.dtype in COMPUTE_DTYPES and out.dtype == q.dtype and out.shape == q.shape, (q.dtype, out.dtype)
    assert k_cache.dtype in CACHE_DTYPES and v_cache.dtype == k_cache.dtype, k_cache.dtype
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("out", out)
    assert block_tables.dim() == 2 and block_tables.stride(1) == 1 and block_tables.dtype == torch.int32


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(n)


@triton.jit
def to_dtype(x, dtype: tl.constexpr):
    """float32 -> dtype. bf16 is rounded to nearest-even on the bits first: the interpreter's own
    float32 -> bf16 cast truncates (1 bf16 ulp off); on a GPU this equals the hardware cast."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


def rows_per_program(num_rows: int) -> int:
    """Row-wise kernels (norm, RoPE, SiLU-mul, KV store) take this many rows per program: one on a
    GPU (each row is hidden-sized); up to 64 under the interpreter, whose cost is per program and
    op, not per element."""
    return min(next_pow2(max(num_rows, 1)), 64) if interpreted() else 1
