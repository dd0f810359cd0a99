"""Small building blocks of a Llama layer, each the same arithmetic as transformers' Llama modules."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Normalise in float32, cast back, then scale (LlamaRMSNorm's order of operations)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, device="meta"), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden]
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def linear(in_features: int, out_features: int) -> nn.Linear:
    """A bias-free projection whose weight the loader assigns (created on the meta device)."""
    layer = nn.Linear(in_features, out_features, bias=False, device="meta")
    layer.weight.requires_grad_(False)
    return layer


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul.

    gate_up_proj.weight: [2 * intermediate, hidden] = cat(gate_proj.weight, up_proj.weight)
    """

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = linear(hidden_size, 2 * intermediate_size)
        self.down_proj = linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, intermediate] each
        return self.down_proj(F.silu(gate) * up)
