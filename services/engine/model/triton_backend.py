"""TritonAttentionBackend: the AttentionBackend protocol (services/engine/model/attention.py) on
Triton kernels. Per layer: store_kvcache, then paged decode attention over the q_len == 1 rows and
chunked-prefill attention over the others, each one launch for the whole ragged batch.

`fused_layers = True` tells the ModelRunner to run RMSNorm, RoPE and SiLU-mul on Triton kernels too
(services/engine/model/layers.py: fused_kernels()).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.chunked_prefill_attention import chunked_prefill_attention
from kernels.paged_decode_attention import paged_decode_attention
from kernels.store_kvcache import store_kvcache
from services.engine.model.batch import BatchInputs


@dataclass(frozen=True)
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor       # [T] int64
    query_start_loc: torch.Tensor    # [S + 1] int32
    seq_lens: torch.Tensor           # [S] int32
    block_tables: torch.Tensor       # [S, max_blocks] int32
    decode_rows: torch.Tensor        # [S_d] int32  row of each decoding sequence's query
    decode_seqs: torch.Tensor        # [S_d] int32  its index in the batch
    max_decode_len: int              # host-side bounds: size grids and splits without a device sync
    prefill_seqs: torch.Tensor       # [S_p] int32
    max_prefill_q_len: int
    k_scale: float = 1.0             # fp8 cache: stored = k / k_scale, read = stored * k_scale
    v_scale: float = 1.0


class TritonAttentionBackend:
    fused_layers = True

    def __init__(self, num_heads: int | None = None):
        self.num_heads = num_heads  # kept for the same constructor shape as TorchAttentionBackend

    def build_metadata(self, batch: BatchInputs, block_size: int, dtype: torch.dtype,
                       k_scale: float = 1.0, v_scale: float = 1.0) -> TritonAttentionMetadata:
        host, device = batch.host, batch.token_ids.device
        q_lens = np.diff(host.query_start_loc)
        prefill_q = q_lens[host.prefill_seqs]
        return TritonAttentionMetadata(
            slot_mapping=batch.slot_mapping, query_start_loc=_int32(batch.query_start_loc),
            seq_lens=_int32(batch.seq_lens), block_tables=_int32(batch.block_tables).contiguous(),
            decode_rows=_int32(batch.decode_rows),
            decode_seqs=torch.from_numpy(host.decode_seqs.astype(np.int32)).to(device),
            max_decode_len=int(host.seq_lens[host.decode_seqs].max(initial=0)),
            prefill_seqs=torch.from_numpy(host.prefill_seqs.astype(np.int32)).to(device),
            max_prefill_q_len=int(prefill_q.max(initial=0)), k_scale=float(k_scale), v_scale=float(v_scale))

    def forward(self, q, k, v, k_cache, v_cache, meta: TritonAttentionMetadata) -> torch.Tensor:
        """q [T, heads, d]; k, v [T, kv_heads, d]; k_cache, v_cache [num_blocks, block_size, kv_heads, d]."""
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, meta.k_scale, meta.v_scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        paged_decode_attention(q, k_cache, v_cache, out, meta.decode_rows, meta.decode_seqs, meta.seq_lens,
                               meta.block_tables, meta.max_decode_len, meta.k_scale, meta.v_scale)
        chunked_prefill_attention(q, k_cache, v_cache, out, meta.prefill_seqs, meta.query_start_loc,
                                  meta.seq_lens, meta.block_tables, meta.max_prefill_q_len,
                                  meta.k_scale, meta.v_scale)
        return out


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)
