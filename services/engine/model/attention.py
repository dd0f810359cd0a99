"""Paged attention backends: the interface, and the torch reference that runs anywhere.

A backend does two things per batch:
  build_metadata(batch, block_size, dtype, k_scale=1.0, v_scale=1.0)
                                            once per iteration: whatever index/mask tensors it needs
  forward(q, k, v, k_cache, v_cache, meta)  once per layer: write this step's K/V into the cache at
                                            slot_mapping, then attend over each sequence's paged context
Shapes: q [T, heads, d]; k, v [T, kv_heads, d]; k_cache, v_cache [num_blocks, block_size, kv_heads, d];
output [T, heads, d]. Query head h reads kv head h // (heads // kv_heads), as in transformers.

Cache dtype (kv_cache.py): the cache may be narrower than q (bfloat16, or fp8 = e4m3fn with the
per-tensor k_scale / v_scale): stored = clamp(k / k_scale, +-448).to(e4m3), read = stored.to(q.dtype) *
k_scale. Attention always sees K/V as read back from the cache, this step's own rows included (a first
chunk's K/V go through the same round trip), so a prompt gives the same logits however it is chunked
or prefix-cached, and the Triton kernels, which read everything from the cache, match.

TorchAttentionBackend splits the batch by query length:
  decodes (q_len == 1)  batched by context length: sequences whose contexts round up to the same
                        power-of-two number of blocks form a group, gathered through the block tables
                        into [S_g, kv_heads, max_ctx_g, d], padding masked, q viewed as
                        [S_g, kv_heads, group, d] so GQA needs no repeated K/V. Grouping bounds the
                        padding to 2x: one 8K-token document decoding beside 20 chats no longer pads
                        every chat to 8K (docs/benchmarks.md, "Where the figures in code went")
  prefills (q_len > 1)  one SDPA call per sequence (per query block for very long contexts) with an
                        additive mask built once per batch: query at position p sees keys 0..p
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from services.engine.model.batch import BatchInputs
from services.engine.model.kv_cache import FP8_MAX, byte_copyable, is_fp8

# Bounds heads * query_block * context, i.e. the score matrix if SDPA falls back to its math path.
MAX_SCORE_ELEMENTS = 1 << 26


class AttentionBackend(Protocol):
    def build_metadata(self, batch: BatchInputs, block_size: int, dtype: torch.dtype,
                       k_scale: float = 1.0, v_scale: float = 1.0) -> Any: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: Any) -> torch.Tensor: ...


@dataclass(frozen=True)
class PrefillSlice:
    rows: tuple[int, int]                  # [start, end) rows of the flat batch
    seq_len: int                           # context length including this chunk
    block_ids: torch.Tensor                # [ceil(seq_len / block_size)] int64
    mask: torch.Tensor | None              # [q_len, seq_len] additive: 0 where key <= query position;
                                           # None when the chunk is the whole context (plain causal)
    query_blocks: tuple[tuple[int, int], ...]  # [q0, q1) local row ranges, one SDPA call each


@dataclass(frozen=True)
class DecodeGroup:
    rows: torch.Tensor                 # [S_g] int64 rows of the flat batch
    block_tables: torch.Tensor         # [S_g, nb_g] int64, nb_g = ceil(max seq_len in group / block_size)
    # [S_g, 1, 1, nb_g * block_size]: additive in the model's dtype (0 = attend, -inf = padding),
    # made once per batch (SDPA turns a bool mask into this at every call, i.e. every layer); a
    # bool mask (True = attend, decode_graphs.py's static one) gives the same result
    mask: torch.Tensor


@dataclass(frozen=True)
class TorchAttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor         # [T] int64
    num_decodes: int                   # S_d
    decode_groups: tuple[DecodeGroup, ...]
    prefills: tuple[PrefillSlice, ...]
    k_scale: float = 1.0               # fp8 cache: stored = k / k_scale, read = stored * k_scale
    v_scale: float = 1.0
    # padded decode steps (decode_graphs.py): rows whose slot is < 0 write nothing; this [1] slot,
    # which no real row writes, is rewritten with what it holds in their place
    pad_slot: torch.Tensor | None = None

    @property
    def only_decodes(self) -> bool:
        return self.num_decodes == self.num_tokens


class TorchAttentionBackend:
    """Reuses two gather buffers (K and V contexts) across layers and batches: on CPU a fresh
    multi-MB tensor per layer costs more in page faults than the copy itself."""

    def __init__(self, num_heads: int, max_score_elements: int = MAX_SCORE_ELEMENTS):
        self.num_heads = num_heads  # sizes prefill query blocks
        self.max_score_elements = max_score_elements
        self._workspace: dict[str, torch.Tensor] = {}

    def build_metadata(self, batch: BatchInputs, block_size: int, dtype: torch.dtype,
                       k_scale: float = 1.0, v_scale: float = 1.0) -> TorchAttentionMetadata:
        host, device = batch.host, batch.token_ids.device
        return TorchAttentionMetadata(
            num_tokens=int(host.query_start_loc[-1]), slot_mapping=batch.slot_mapping,
            num_decodes=int(batch.decode_rows.numel()),
            decode_groups=self._decode_groups(batch, block_size, dtype, device),
            prefills=tuple(self._prefill_slice(host, int(i), block_size, dtype, device)
                           for i in host.prefill_seqs),
            k_scale=float(k_scale), v_scale=float(v_scale),
        )

    @staticmethod
    def _decode_groups(batch: BatchInputs, block_size: int, dtype: torch.dtype,
                       device) -> tuple[DecodeGroup, ...]:
        """Decodes grouped by ceil(log2(blocks of context)): a group's padding is under 2x."""
        host = batch.host
        ctx = host.seq_lens[host.decode_seqs]                       # [S_d]
        if ctx.size == 0:
            return ()
        nblocks = -(-ctx // block_size)
        bucket = np.ceil(np.log2(np.maximum(nblocks, 1))).astype(np.int64)
        groups = []
        for b in np.unique(bucket):
            members = np.flatnonzero(bucket == b)
            g_ctx = ctx[members]
            nb = -(-int(g_ctx.max()) // block_size)
            tables = torch.from_numpy(host.block_tables[host.decode_seqs[members], :nb].astype(np.int64))
            padding = torch.arange(nb * block_size)[None, :] >= torch.from_numpy(g_ctx)[:, None]
            mask = torch.zeros(padding.shape, dtype=dtype).masked_fill_(padding, float("-inf"))
            groups.append(DecodeGroup(batch.decode_rows[torch.from_numpy(members)].to(device),
                                      tables.to(device), mask[:, None, None, :].to(device)))
        return tuple(groups)

    def _prefill_slice(self, host, seq: int, block_size: int, dtype, device) -> PrefillSlice:
        start, end = int(host.query_start_loc[seq]), int(host.query_start_loc[seq + 1])
        seq_len, q_len = int(host.seq_lens[seq]), end - start
        block_ids = torch.from_numpy(host.block_tables[seq, :-(-seq_len // block_size)].astype(np.int64))
        if seq_len == q_len:  # first chunk: attend to this chunk's own K/V, causally, no gather
            return PrefillSlice((start, end), seq_len, block_ids.to(device), None, ((0, q_len),))
        # keys j > start_pos + r are hidden from local query row r
        mask = torch.full((q_len, seq_len), float("-inf"), dtype=dtype).triu_(seq_len - q_len + 1)
        step = max(1, self.max_score_elements // (seq_len * self.num_heads))
        blocks = tuple((q0, min(q0 + step, q_len)) for q0 in range(0, q_len, step))
        return PrefillSlice((start, end), seq_len, block_ids.to(device), mask.to(device), blocks)

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchAttentionMetadata) -> torch.Tensor:
        ks, vs = meta.k_scale, meta.v_scale
        if meta.pad_slot is None:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping, ks, vs)
        else:
            write_kv_padded(k, v, k_cache, v_cache, meta.slot_mapping, meta.pad_slot, ks, vs)
        if meta.only_decodes and len(meta.decode_groups) == 1:
            return self._decode(q, k_cache, v_cache, meta.decode_groups[0], ks, vs)
        out = torch.empty_like(q)  # [T, heads, d]
        for g in meta.decode_groups:
            out.index_copy_(0, g.rows, self._decode(q[g.rows], k_cache, v_cache, g, ks, vs))
        for p in meta.prefills:
            rows = slice(*p.rows)
            if p.mask is None:  # the chunk is the whole context: its own K/V as the cache holds them
                k_ctx = read_back(k[rows], k_cache.dtype, ks).transpose(0, 1)  # [kv_heads, q_len, d]
                v_ctx = read_back(v[rows], v_cache.dtype, vs).transpose(0, 1)
            else:
                k_ctx = self._gather("k", k_cache, p.block_ids, q.dtype, ks)[:, :p.seq_len]  # [kv_heads, seq_len, d]
                v_ctx = self._gather("v", v_cache, p.block_ids, q.dtype, vs)[:, :p.seq_len]
            out[rows] = prefill_attention(q[rows], k_ctx, v_ctx, p)
        return out

    def _decode(self, q, k_cache, v_cache, g: DecodeGroup, k_scale: float, v_scale: float) -> torch.Tensor:
        k_ctx = self._gather("k", k_cache, g.block_tables, q.dtype, k_scale)  # [S_g, kv_heads, L, d]
        v_ctx = self._gather("v", v_cache, g.block_tables, q.dtype, v_scale)
        return decode_attention(q, k_ctx, v_ctx, g.mask)

    def _gather(self, name: str, cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype,
                scale: float = 1.0) -> torch.Tensor:
        """cache [num_blocks, block_size, kv_heads, d], block_ids [..., nb] -> [..., kv_heads, nb * block_size, d],
        dequantized to `dtype`."""
        blocks = self._buffer(name, (block_ids.numel(), *cache.shape[1:]), cache)
        torch.index_select(cache, 0, block_ids.flatten(), out=blocks)  # ~10x faster than cache[block_ids] on CPU
        blocks = blocks.view(*block_ids.shape, *cache.shape[1:])      # [..., nb, block_size, kv_heads, d]
        return dequantize(blocks.flatten(-4, -3).transpose(-3, -2), dtype, scale)

    def _buffer(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A contiguous [shape] view of a workspace tensor that only ever grows."""
        numel = math.prod(shape)
        buf = self._workspace.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._workspace[name] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel].view(shape)


def write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v: [T, kv_heads, d] -> cache slots slot_mapping [T], quantized to the cache's dtype."""
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        rows = byte_copyable(quantize(x, cache.dtype, scale))
        byte_copyable(cache).view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, rows)


def write_kv_padded(k, v, k_cache, v_cache, slot_mapping, pad_slot, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> None:
    """write_kv where a slot < 0 writes nothing (a padded row): such rows write `pad_slot` [1] (a
    slot no other row writes) with the value it holds. Fixed shapes, no host sync."""
    valid = slot_mapping >= 0
    slots = torch.where(valid, slot_mapping, pad_slot)
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        flat = byte_copyable(cache).view(-1, *cache.shape[2:])
        rows = byte_copyable(quantize(x, cache.dtype, scale))
        flat.index_copy_(0, slots, torch.where(valid[:, None, None], rows, flat.index_select(0, slots)))


def quantize(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as a cache of `cache_dtype` stores it. fp8: clamped to +-448 first, in float32 (torch's
    casts of out-of-range values to e4m3fn saturate on this CPU build but are not promised to)."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    x = x.float() if scale == 1.0 else x.float() / scale   # (x itself when float32 and scale 1: no clamp_)
    return torch.clamp(x, -FP8_MAX, FP8_MAX).to(cache_dtype)


def dequantize(stored: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cache values -> `dtype` (fp8: times the scale)."""
    out = stored.to(dtype)
    if is_fp8(stored.dtype) and scale != 1.0:
        out = out.mul_(scale)  # .to() from fp8 always made a new tensor
    return out


def read_back(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as it reads back from a cache of `cache_dtype` (x itself when the cache keeps x's dtype)."""
    if cache_dtype == x.dtype:
        return x
    return dequantize(quantize(x, cache_dtype, scale), x.dtype, scale)


def decode_attention(q, k, v, mask) -> torch.Tensor:
    """q [S_d, heads, d] (one query per sequence); k, v [S_d, kv_heads, L, d]; mask [S_d, 1, 1, L]."""
    s, heads, d = q.shape
    kv_heads = k.shape[1]
    qg = q.reshape(s, kv_heads, heads // kv_heads, d)  # the group axis plays the query axis: no K/V repeat
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask).reshape(s, heads, d)


def prefill_attention(q, k, v, p: PrefillSlice) -> torch.Tensor:
    """q [q_len, heads, d] of one sequence; k, v [kv_heads, seq_len, d] -> [q_len, heads, d]."""
    qt, k, v = q.transpose(0, 1)[None], k[None], v[None]  # [1, heads, q_len, d], [1, kv_heads, seq_len, d]
    if p.mask is None:
        out = F.scaled_dot_product_attention(qt, k, v, is_causal=True, enable_gqa=True)
        return out[0].transpose(0, 1)
    if len(p.query_blocks) == 1:
        out = F.scaled_dot_product_attention(qt, k, v, attn_mask=p.mask, enable_gqa=True)
        return out[0].transpose(0, 1)
    out = torch.empty_like(q)
    for q0, q1 in p.query_blocks:
        blk = F.scaled_dot_product_attention(qt[:, :, q0:q1], k, v, attn_mask=p.mask[q0:q1], enable_gqa=True)
        out[q0:q1] = blk[0].transpose(0, 1)
    return out
