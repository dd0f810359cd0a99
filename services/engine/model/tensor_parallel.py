"""Tensor parallelism as a pass over a loaded LlamaForward (gpt-fast's apply_tp): llama.py holds no
parallelism; shard_model() replaces or re-slices its modules in place for rank r of N.

    embed_tokens   vocab-parallel: rank r holds rows [r * V_r, (r + 1) * V_r) (V_r = ceil(V / N), the
                   last shard zero-padded); ids outside them embed to 0; all-reduce (sum) the rows
    qkv_proj       column-parallel: rank r keeps its h / N query heads and kv / N KV heads, so
                   attention and the KV cache see only this rank's heads (no communication)
    o_proj         row-parallel: the input columns of rank r's heads; all-reduce the output
    gate_up_proj   column-parallel: rank r's I / N rows of gate and of up
    down_proj      row-parallel: the matching I / N input columns; all-reduce the output
    lm_head        vocab-parallel like embed_tokens (a tied head reads the embedding's shard), the
                   [R, V_r] logits of every rank all-gathered into [R, V] by TensorParallelLlama

GQA stays aligned: rank r's query heads [r h/N, (r+1) h/N) read KV heads [r kv/N, (r+1) kv/N), the
same heads they read unsharded (query head i reads KV head i // (h / kv)). The returned model's
`config` is the rank's (num_heads, num_kv_heads, intermediate_size divided by N; vocab whole), so
KVCache(model.config, ...) allocates this rank's KV heads only.

Each rank reads only its shard from the checkpoint (loader.load_model(..., tp=...) reads the row or
column ranges `shard_ranges` names with safetensors' get_slice, then `assemble_shard` wraps the
rank-shaped model); shard_model() is the same cut made from a full model already in memory.

Sums run in float32 (a bf16 model's partial sums are reduced in fp32, then cast back). Processes,
rendezvous and who drives whom: services/engine/tp_ranks.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from services.engine.model.config import ModelConfig
from services.engine.model.llama import LlamaAttention, LlamaForward
from services.engine.model.layers import SwiGLU


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group (group None: the default, world group)."""

    rank: int
    world_size: int
    group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.world_size})")


def check_shardable(config: ModelConfig, world_size: int) -> None:
    """ValueError naming what does not divide: every rank needs whole query and KV heads."""
    if world_size < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {world_size}")
    bad = [f"{name} {value}" for name, value in (("num_heads", config.num_heads),
                                                  ("num_kv_heads", config.num_kv_heads),
                                                  ("intermediate_size", config.intermediate_size))
           if value % world_size]
    if bad:
        raise ValueError(f"tensor parallel size {world_size} must divide num_heads and num_kv_heads "
                         f"(and intermediate_size); this model has num_heads {config.num_heads}, "
                         f"num_kv_heads {config.num_kv_heads}, intermediate_size "
                         f"{config.intermediate_size}: {', '.join(bad)} not divisible by {world_size}")


def rank_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The per-rank shape: heads, KV heads and MLP width divided by N (vocab and hidden whole)."""
    check_shardable(config, world_size)
    return replace(config, num_heads=config.num_heads // world_size,
                   num_kv_heads=config.num_kv_heads // world_size,
                   intermediate_size=config.intermediate_size // world_size)


def vocab_shard_size(vocab_size: int, world_size: int) -> int:
    return math.ceil(vocab_size / world_size)


def shard_model(model: LlamaForward, tp: TPGroup) -> TensorParallelLlama:
    """Shard a full model in place for tp.rank; -> the model wrapped to gather its logits.
    The full weights are dropped (each shard is a copy), so only ~1/N of them stays resident."""
    full = model.config
    check_shardable(full, tp.world_size)
    for layer in model.layers:
        _shard_attention(layer.self_attn, full, tp)
        _shard_mlp(layer.mlp, full, tp)
    vocab_rows = vocab_shard_size(full.vocab_size, tp.world_size)
    model.embed_tokens = VocabParallelEmbedding(vocab_shard(model.embed_tokens.weight, full.vocab_size, tp),
                                                full.vocab_size, tp)
    if model.lm_head is not None:
        model.lm_head = _linear(vocab_shard(model.lm_head.weight, full.vocab_size, tp), vocab_rows)
    model.config = rank_config(full, tp.world_size)
    return TensorParallelLlama(model, full.vocab_size, tp)


# ------------------------------------------------------------------- reading a shard from disk
@dataclass(frozen=True)
class ShardRange:
    """Rows (dim 0) or input columns (dim 1) [start, stop) of one checkpoint tensor; pad_to: the
    rows the shard must have (a vocab shard past V is zero-padded), 0 for none."""

    dim: int
    start: int
    stop: int
    pad_to: int = 0


def shard_ranges(config: ModelConfig, tp: TPGroup) -> dict[str, ShardRange]:
    """HF tensor name -> the part of it rank tp.rank keeps; names not listed (the norms) are
    read whole. The cuts are qkv_shard's, gate_up_shard's, column_shard's and vocab_shard's."""
    check_shardable(config, tp.world_size)
    n, r, d = tp.world_size, tp.rank, config.head_dim
    heads, kv, inter = config.num_heads // n * d, config.num_kv_heads // n * d, config.intermediate_size // n
    rows = vocab_shard_size(config.vocab_size, n)
    start = min(r * rows, config.vocab_size)
    vocab = ShardRange(0, start, min(start + rows, config.vocab_size), pad_to=rows)
    ranges = {"model.embed_tokens.weight": vocab, "lm_head.weight": vocab}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        ranges |= {p + "self_attn.q_proj.weight": ShardRange(0, r * heads, (r + 1) * heads),
                   p + "self_attn.k_proj.weight": ShardRange(0, r * kv, (r + 1) * kv),
                   p + "self_attn.v_proj.weight": ShardRange(0, r * kv, (r + 1) * kv),
                   p + "self_attn.o_proj.weight": ShardRange(1, r * heads, (r + 1) * heads),
                   p + "mlp.gate_proj.weight": ShardRange(0, r * inter, (r + 1) * inter),
                   p + "mlp.up_proj.weight": ShardRange(0, r * inter, (r + 1) * inter),
                   p + "mlp.down_proj.weight": ShardRange(1, r * inter, (r + 1) * inter)}
    return ranges


def shard_shape_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The shapes a rank's LlamaForward is built with before assemble_shard: the rank's heads and
    MLP width, and its vocab rows (V_r)."""
    return replace(rank_config(config, world_size),
                   vocab_size=vocab_shard_size(config.vocab_size, world_size))


def assemble_shard(model: LlamaForward, full: ModelConfig, tp: TPGroup) -> TensorParallelLlama:
    """A LlamaForward built with shard_shape_config and loaded with this rank's slices -> the
    rank's model: o_proj and down_proj reduce across ranks, the embedding is vocab-parallel."""
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj.weight, tp)
        layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj.weight, tp)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight, full.vocab_size, tp)
    model.config = rank_config(full, tp.world_size)
    return TensorParallelLlama(model, full.vocab_size, tp)


# ------------------------------------------------------------------------------ weight slicing
def qkv_shard(weight: torch.Tensor, config: ModelConfig, tp: TPGroup) -> torch.Tensor:
    """[(h + 2 kv) d, hidden] -> [(h + 2 kv) / N * d, hidden]: this rank's q, k and v rows."""
    d = config.head_dim
    q, k, v = weight.split([config.num_heads * d, config.num_kv_heads * d, config.num_kv_heads * d])
    return torch.cat([part.chunk(tp.world_size)[tp.rank] for part in (q, k, v)]).clone()


def gate_up_shard(weight: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """[2 I, hidden] = cat(gate, up) -> [2 I / N, hidden] = cat(gate_r, up_r)."""
    gate, up = weight.chunk(2)
    return torch.cat([gate.chunk(tp.world_size)[tp.rank], up.chunk(tp.world_size)[tp.rank]]).clone()


def column_shard(weight: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """[out, in] -> [out, in / N]: the input columns of this rank (row-parallel layers)."""
    return weight.chunk(tp.world_size, dim=1)[tp.rank].contiguous().clone()


def vocab_shard(weight: torch.Tensor, vocab_size: int, tp: TPGroup) -> torch.Tensor:
    """[V, hidden] -> [V_r, hidden]: rows [r V_r, (r + 1) V_r), zero rows past V."""
    rows = vocab_shard_size(vocab_size, tp.world_size)
    start = min(tp.rank * rows, vocab_size)
    part = weight[start:min(start + rows, vocab_size)]
    out = torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    out[:part.shape[0]] = part
    return out


def _linear(weight: torch.Tensor, out_features: int) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], out_features, bias=False, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer


def _shard_attention(attn: LlamaAttention, config: ModelConfig, tp: TPGroup) -> None:
    weight = qkv_shard(attn.qkv_proj.weight, config, tp)
    attn.qkv_proj = _linear(weight, weight.shape[0])
    attn.o_proj = RowParallelLinear(column_shard(attn.o_proj.weight, tp), tp)
    attn.num_heads = config.num_heads // tp.world_size
    attn.num_kv_heads = config.num_kv_heads // tp.world_size


def _shard_mlp(mlp: SwiGLU, config: ModelConfig, tp: TPGroup) -> None:
    weight = gate_up_shard(mlp.gate_up_proj.weight, tp)
    mlp.gate_up_proj = _linear(weight, weight.shape[0])
    mlp.down_proj = RowParallelLinear(column_shard(mlp.down_proj.weight, tp), tp)


# ------------------------------------------------------------------------------------ modules
def all_reduce_sum(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sum over the ranks, in float32; -> x's dtype."""
    total = x.float() if x.dtype != torch.float32 else x
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=tp.group)
    return total.to(x.dtype)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r @ W_r^T): x_r [T, in / N] is this rank's slice of the input features."""

    def __init__(self, weight: torch.Tensor, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in / N]
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(F.linear(x, self.weight), self.tp)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + V_r) of the table; other ids embed to zero on this rank, and the
    all-reduce gives every rank the full [T, hidden]. `weight` [V_r, hidden] doubles as a tied
    LM head's shard (llama.py reads embed_tokens.weight for it)."""

    def __init__(self, shard: torch.Tensor, vocab_size: int, tp: TPGroup):
        """shard: this rank's rows, cut as vocab_shard cuts them ([V_r, hidden], zero past V)."""
        super().__init__()
        self.weight = nn.Parameter(shard, requires_grad=False)
        rows = vocab_shard_size(vocab_size, tp.world_size)
        self.start = tp.rank * rows
        self.num_real = max(0, min(rows, vocab_size - self.start))   # rows past V are padding
        self.tp = tp

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        local = token_ids - self.start
        outside = (local < 0) | (local >= self.num_real)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce_sum(x.masked_fill(outside[:, None], 0), self.tp)


class TensorParallelLlama(nn.Module):
    """One rank's sharded LlamaForward; forward gathers the vocab-parallel logits, so every rank
    returns the same float32 [R, vocab] as the unsharded model (ModelRunner needs no change)."""

    def __init__(self, model: LlamaForward, vocab_size: int, tp: TPGroup):
        super().__init__()
        self.model = model
        self.vocab_size = vocab_size
        self.tp = tp

    @property
    def config(self) -> ModelConfig:
        return self.model.config   # the rank's: its heads, its KV heads

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    def forward(self, batch, kv_cache, backend, attn_meta) -> torch.Tensor:
        local = self.model(batch, kv_cache, backend, attn_meta)   # [R, V_r] float32
        if local.shape[0] == 0:                                   # the same R on every rank
            return local.new_empty(0, self.vocab_size)
        parts = [torch.empty_like(local) for _ in range(self.tp.world_size)]
        dist.all_gather(parts, local.contiguous(), group=self.tp.group)
        return torch.cat(parts, dim=1)[:, :self.vocab_size]
