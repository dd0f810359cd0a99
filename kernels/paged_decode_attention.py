"""Paged decode attention: one query token per sequence, K/V read through the block table (no gather).

    q          [T, heads, d]                 rows[s] is sequence seqs[s]'s query row (strided view ok)
    k_cache    [num_blocks, block_size, kv_heads, d]   (fp8 e4m3 allowed: read as cache * k_scale)
    seq_lens   [S] int32, block_tables [S, max_blocks] int32 (the batch's; seqs[s] indexes them)
    out        [T, heads, d]                 only rows[s] are written

Grid (S_d, kv_heads, splits): a program takes one sequence's GQA group of query heads (padded to
16 rows for tl.dot) against one kv head over one partition of the context, so K/V are read once per
kv head. Token n of the context lives at block_tables[seq, n // block_size], offset n % block_size.
With splits > 1 (long contexts, few sequences: flash-decoding) each partition writes its normalised
output and log2-sum-exp, and `_reduce_kernel` combines them.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.common import check_paged_attention, dot_dtype, interpreted, next_pow2, to_dtype

LOG2E = 1.4426950408889634
BLOCK_N = 64               # context tokens per loop iteration
MIN_PARTITION = 512        # tokens: a split below this costs more in the reduction than it gains


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                   rows_ptr, seqs_ptr, seq_lens_ptr, block_tables_ptr,
                   qk_scale, k_scale, v_scale, partition,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
                   num_heads, max_splits,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    s, kvh, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = tl.load(rows_ptr + s).to(tl.int64)
    seq = tl.load(seqs_ptr + s).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * partition
    end = tl.minimum(start + partition, seq_len)
    g, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    g_mask, d_mask = g < GROUP, d < HEAD_DIM
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        p_mask = pos < end
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=p_mask, other=0)
        off = block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = p_mask[:, None] & d_mask[None, :]
        # load -> cast -> dot with nothing in between, so the loads can be pipelined; the fp8
        # scales act on the scores (q . k * k_scale) and the output (sum p * v * v_scale)
        k_t = tl.load(k_cache_ptr + off[None, :] + d[:, None], mask=tl.trans(kv_mask), other=0.0).to(DOT_DTYPE)
        scores = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale   # k_t: [BLOCK_D, BLOCK_N]
        scores = tl.where(p_mask[None, :], scores, float("-inf"))          # [BLOCK_G, BLOCK_N], log2 units
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        m = m_new
    l_safe = tl.where(l > 0, l, 1.0)
    out = acc * (v_scale / l_safe)[:, None]
    o_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:  # partials [S_d, heads, max_splits, (d)]
        ph = (s * num_heads + heads) * max_splits + part
        tl.store(part_out_ptr + ph[:, None] * HEAD_DIM + d[None, :], out, mask=o_mask)
        tl.store(part_lse_ptr + ph, tl.where(l > 0, m + tl.log2(l_safe), float("-inf")), mask=g_mask)
    else:
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 to_dtype(out, out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _reduce_kernel(out_ptr, part_out_ptr, part_lse_ptr, rows_ptr, stride_ot, stride_oh, num_splits,
                   num_heads, max_splits,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr):
    s, h = tl.program_id(0), tl.program_id(1)
    row = tl.load(rows_ptr + s).to(tl.int64)
    p, d = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_D)
    p_mask, d_mask = p < num_splits, d < HEAD_DIM
    base = (s * num_heads + h) * max_splits
    lse = tl.load(part_lse_ptr + base + p, mask=p_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))                                     # empty partitions weigh 0
    o = tl.load(part_out_ptr + (base + p)[:, None] * HEAD_DIM + d[None, :],
                mask=p_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + d, to_dtype(out, out_ptr.dtype.element_ty), mask=d_mask)


def num_splits_for(num_seqs: int, kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """About 8 programs per SM, each partition >= MIN_PARTITION tokens. The bf16 kernel compiles to
    80 registers x 128 threads and ~38 KB of shared memory for sm_90 (kernels/compile_check.py), so
    ~5 fit on an SM at once: 8 per SM is over a wave and a half, which keeps the last wave's tail
    short. A guess until gpu_check.sh's bandwidth figures say otherwise."""
    if interpreted() or device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = -(-8 * sms // max(1, num_seqs * kv_heads))
    return max(1, min(wanted, -(-max_seq_len // MIN_PARTITION)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                           rows: torch.Tensor, seqs: torch.Tensor, seq_lens: torch.Tensor,
                           block_tables: torch.Tensor, max_seq_len: int, k_scale: float = 1.0,
                           v_scale: float = 1.0, num_splits: int | None = None) -> torch.Tensor:
    """Writes out[rows[s]] for each decode sequence s; max_seq_len: a host-side bound on seq_lens[seqs]."""
    _check(q, k_cache, v_cache, out, rows, seqs, seq_lens, block_tables)
    num_decodes, (_, heads, d), (_, block_size, kv_heads, _) = rows.numel(), q.shape, k_cache.shape
    if num_decodes == 0:
        return out
    splits = num_splits or num_splits_for(num_decodes, kv_heads, max_seq_len, q.device)
    partition = -(-max(1, -(-max_seq_len // splits)) // BLOCK_N) * BLOCK_N
    splits = max(1, -(-max_seq_len // partition))
    group = heads // kv_heads
    part_out = part_lse = out  # unused unless splits > 1
    if splits > 1:
        part_out = torch.empty(num_decodes, heads, splits, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_decodes, heads, splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(num_decodes, kv_heads, splits)](
        q, k_cache, v_cache, out, part_out, part_lse, rows, seqs, seq_lens, block_tables,
        LOG2E / math.sqrt(d) * float(k_scale), float(k_scale), float(v_scale), partition,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), heads, splits,
        GROUP=group, BLOCK_G=max(16, next_pow2(group)), HEAD_DIM=d, BLOCK_D=next_pow2(d),
        BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N, SPLIT=splits > 1, DOT_DTYPE=dot_dtype(q.dtype),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, num_stages=2)
    if splits > 1:
        _reduce_kernel[(num_decodes, heads)](out, part_out, part_lse, rows, out.stride(0), out.stride(1),
                                             splits, heads, splits, HEAD_DIM=d, BLOCK_D=next_pow2(d),
                                             BLOCK_P=next_pow2(splits))
    return out


def _check(q, k_cache, v_cache, out, rows, seqs, seq_lens, block_tables) -> None:
    check_paged_attention(q, k_cache, v_cache, out, block_tables)
    assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
    assert rows.shape == seqs.shape and rows.is_contiguous() and seqs.is_contiguous()
