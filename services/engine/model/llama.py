"""The Llama forward pass over one flattened ragged batch.

    token_ids [T] -> embed -> L x [ RMSNorm -> qkv -> RoPE -> paged attention -> o_proj -> +residual
                                    RMSNorm -> SwiGLU MLP -> +residual ]
    (each "+residual" is taken inside the next RMSNorm: one fused kernel on the Triton path)
                  -> select logits_indices rows [R] -> final RMSNorm -> lm_head -> float32 [R, vocab]

Parameter layout differs from transformers in two fused projections (the loader builds them):
    self_attn.qkv_proj.weight  [(heads + 2 * kv_heads) * head_dim, hidden] = cat(q_proj, k_proj, v_proj)
    mlp.gate_up_proj.weight    [2 * intermediate, hidden]                   = cat(gate_proj, up_proj)
The model holds no parallelism; a tensor-parallel pass can later shard these modules in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.model.attention import AttentionBackend
from services.engine.model.batch import BatchInputs
from services.engine.model.config import ModelConfig
from services.engine.model.cpu_gemm import packed_linear
from services.engine.model.kv_cache import KVCache
from services.engine.model.layers import RMSNorm, SwiGLU, linear
from services.engine.model.rope import RotaryEmbedding, apply_rope


@dataclass(frozen=True)
class ForwardContext:
    """Per-batch state every layer reads; built once per iteration."""

    cos: torch.Tensor  # [T, head_dim // 2]
    sin: torch.Tensor  # [T, head_dim // 2]
    kv_cache: KVCache
    backend: AttentionBackend
    attn_meta: Any


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.qkv_proj = linear(config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim)
        self.o_proj = linear(self.num_heads * self.head_dim, config.hidden_size)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # x: [T, hidden]
        t, h, kv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(t, h + 2 * kv, self.head_dim)
        qk = apply_rope(qkv[:, :h + kv], ctx.cos, ctx.sin)       # [T, heads + kv_heads, d]
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + kv:]
        k_cache, v_cache = ctx.kv_cache.layer(self.layer_index)  # [num_blocks, block_size, kv_heads, d]
        out = ctx.backend.forward(q, k, v, k_cache, v_cache, ctx.attn_meta)  # [T, heads, d]
        return self.o_proj(out.reshape(t, h * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) [T, hidden] each -> the same for the next layer: the hidden state is
        x + residual, the sum taken inside the next RMSNorm (one fused kernel on the Triton path).
        The first layer gets residual None (x is the embedding)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForward(nn.Module):
    """Weights start on the meta device; load_model assigns them (lm_head is None when tied)."""

    def __init__(self, config: ModelConfig, tie_word_embeddings: bool):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device="meta")
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if tie_word_embeddings else linear(config.hidden_size, config.vocab_size)
        self.rotary = RotaryEmbedding(config)
        self.head_packed: torch.Tensor | None = None  # a tied head's oneDNN copy (cpu_gemm.prepack)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def forward(self, batch: BatchInputs, kv_cache: KVCache, backend: AttentionBackend,
                attn_meta: Any) -> torch.Tensor:
        """-> float32 logits [R, vocab] for batch.logits_indices, in that order."""
        cos, sin = self.rotary(batch.positions, batch.host.max_seq_len, self.dtype)
        ctx = ForwardContext(cos, sin, kv_cache, backend, attn_meta)
        x, residual = self.embed_tokens(batch.token_ids), None  # [T, hidden]
        for layer in self.layers:
            x, residual = layer(x, residual, ctx)
        rows = batch.logits_indices
        x, _ = self.norm(x[rows], residual[rows])  # [R, hidden]
        if self.lm_head is not None:
            return self.lm_head(x).float()
        if self.head_packed is not None:
            return packed_linear(x, self.head_packed).float()
        return F.linear(x, self.head_weight()).float()

    def head_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the logits' weight (the embedding's when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
