"""Chunked-prefill attention over the paged KV cache, the whole ragged batch in one launch.

    q             [T, heads, d]         rows query_start_loc[seq] .. query_start_loc[seq + 1] (strided ok)
    k_cache       [num_blocks, block_size, kv_heads, d]   already holds this chunk's K/V (store first)
    seqs          [S_p] int32           which sequences of the batch to run (those with q_len > 1)
    query_start_loc [S + 1] int32, seq_lens [S] int32, block_tables [S, max_blocks] int32
    out           [T, heads, d]         only the selected sequences' rows are written

A chunk of q_len queries ends the context: local query row r sits at position
ctx + r, ctx = seq_len - q_len, and sees keys 0 .. ctx + r (causal with the chunk's offset).
Grid (S_p, ceil(max_q_len * group / BLOCK_M), kv_heads), group = heads // kv_heads: a program's
BLOCK_M rows are (token, query head) pairs of one GQA group, row i = token i // group, head
kvh * group + i % group, so each K/V tile is read once for the whole group (packed GQA). Online
softmax over key tiles read through the block table; a program past its sequence's rows runs no
iterations and stores nothing.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.common import check_paged_attention, dot_dtype, next_pow2, to_dtype

LOG2E = 1.4426950408889634
BLOCK_M = 64
BLOCK_N = 64


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, seqs_ptr, query_start_loc_ptr, seq_lens_ptr,
                    block_tables_ptr, qk_scale, k_scale, v_scale,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    i, mb, kvh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq = tl.load(seqs_ptr + i).to(tl.int64)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len
    i_row, d = mb * BLOCK_M + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    r, h = i_row // GROUP, kvh * GROUP + i_row % GROUP                 # local token, query head
    r_mask, d_mask = r < q_len, d < HEAD_DIM
    q_rows = (q_start + r).to(tl.int64)
    q_off = q_rows[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=r_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # keys past the block's last query position are hidden from all its rows; none if the block is empty
    last_r = ((mb + 1) * BLOCK_M - 1) // GROUP
    hi = tl.where(mb * BLOCK_M < q_len * GROUP, tl.minimum(seq_len, ctx + last_r + 1), 0)
    for n0 in range(0, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        p_mask = pos < seq_len
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=p_mask, other=0)
        off = block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = p_mask[:, None] & d_mask[None, :]
        # load -> cast -> dot with nothing in between, so the loads can be pipelined; the fp8
        # scales act on the scores (q . k * k_scale) and the output (sum p * v * v_scale)
        k_t = tl.load(k_cache_ptr + off[None, :] + d[:, None], mask=tl.trans(kv_mask), other=0.0).to(DOT_DTYPE)
        scores = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale   # k_t: [BLOCK_D, BLOCK_N]
        visible = p_mask[None, :] & (pos[None, :] <= (ctx + r)[:, None])
        scores = tl.where(visible, scores, float("-inf"))               # [BLOCK_M, BLOCK_N], log2 units
        m_new = tl.maximum(m, tl.max(scores, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)             # rows with nothing visible yet
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(scores - m_use[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        m = m_new
    out = acc * (v_scale / tl.where(l > 0, l, 1.0))[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :],
             to_dtype(out, out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def chunked_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                              seqs: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                              block_tables: torch.Tensor, max_q_len: int, k_scale: float = 1.0,
                              v_scale: float = 1.0) -> torch.Tensor:
    """max_q_len: a host-side bound on the selected sequences' query lengths (sizes the grid)."""
    _check(q, k_cache, v_cache, out, seqs, query_start_loc, seq_lens, block_tables)
    (_, heads, d), (_, block_size, kv_heads, _) = q.shape, k_cache.shape
    if seqs.numel() == 0 or max_q_len == 0:
        return out
    group = heads // kv_heads
    grid = (seqs.numel(), triton.cdiv(max_q_len * group, BLOCK_M), kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, seqs, query_start_loc, seq_lens, block_tables,
        LOG2E / math.sqrt(d) * float(k_scale), float(k_scale), float(v_scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=d, BLOCK_D=next_pow2(d), BLOCK_SIZE=block_size,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DOT_DTYPE=dot_dtype(q.dtype),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, num_stages=2)
    return out


def _check(q, k_cache, v_cache, out, seqs, query_start_loc, seq_lens, block_tables) -> None:
    check_paged_attention(q, k_cache, v_cache, out, block_tables)
    for name, t in (("seqs", seqs), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        assert t.dtype == torch.int32 and t.is_contiguous(), f"{name}: {t.dtype}, contiguous {t.is_contiguous()}"
