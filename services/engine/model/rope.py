"""Rotary position embedding with optional Llama-3 frequency scaling.

inv_freq is computed with the same float32 ops as transformers' `_compute_llama3_parameters` /
`compute_default_rope_parameters`, so angles (position * inv_freq, float32) match it bit for bit.
cos/sin tables are cached for positions [0, capacity) and grown by doubling when a batch needs more.
"""
from __future__ import annotations

import math

import torch

from services.engine.model.config import ModelConfig
from services.engine.model.layers import fused_enabled


def compute_inv_freq(config: ModelConfig) -> torch.Tensor:
    """-> [head_dim // 2] float32."""
    dim = config.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    inv_freq = 1.0 / (config.rope_theta ** exponent)
    if config.rope_scaling is None:
        return inv_freq
    return _llama3_scale(inv_freq, config.rope_scaling)


def _llama3_scale(inv_freq: torch.Tensor, scaling) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin lookup: positions [T] -> cos, sin [T, head_dim // 2] in the compute dtype."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu", initial_capacity: int = 4096):
        self.inv_freq = compute_inv_freq(config).to(device)  # [head_dim // 2] float32
        self._build(initial_capacity)

    def _build(self, capacity: int) -> None:
        positions = torch.arange(capacity, dtype=torch.int64, device=self.inv_freq.device).float()
        freqs = positions[:, None] * self.inv_freq[None, :]  # same float32 product as transformers
        self._cos, self._sin = freqs.cos(), freqs.sin()  # [capacity, head_dim // 2] float32
        self.capacity = capacity

    def __call__(self, positions: torch.Tensor, max_position: int, dtype: torch.dtype):
        """max_position: a host-side bound (> every entry of positions), so there is no device sync."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
            self._build(self.capacity)
        if max_position > self.capacity:
            self._build(max(max_position, 2 * self.capacity))
        return self._cos[positions].to(dtype), self._sin[positions].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] (may be a strided view); cos, sin: [T, head_dim // 2].

    Same arithmetic as transformers' x * cat(cos, cos) + rotate_half(x) * cat(sin, sin); under
    layers.fused_kernels() one Triton kernel (kernels/rope.py) with the same rounding.
    """
    if fused_enabled():
        from kernels.rope import apply_rope as rope_kernel
        return rope_kernel(x, cos, sin)
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
