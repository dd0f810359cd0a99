"""Small building blocks of a Llama layer, each the same arithmetic as transformers' Llama modules.

Inside `with fused_kernels():` (the ModelRunner enters it when its attention backend says
`fused_layers`, i.e. the Triton one) RMSNorm, SiLU-mul and rope.apply_rope run Triton kernels
(kernels/rmsnorm.py, silu_mul.py, rope.py) with the same signatures and rounding.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

_FUSED = ContextVar("kvfleet_fused_kernels", default=False)


@contextmanager
def fused_kernels(enabled: bool = True) -> Iterator[None]:
    """Run this block's layers on the Triton kernels (a per-thread switch: two runners in one
    process keep their own choice)."""
    token = _FUSED.set(enabled)
    try:
        yield
    finally:
        _FUSED.reset(token)


def fused_enabled() -> bool:
    return _FUSED.get()


class RMSNorm(nn.Module):
    """Normalise in float32, cast back, then scale (LlamaRMSNorm's order of operations)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, device="meta"), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [T, hidden] -> normed; with a residual: (norm(x + residual), x + residual), fused."""
        if _FUSED.get():
            from kernels.rmsnorm import rmsnorm
            return rmsnorm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            return self.forward(x), x
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class Linear(nn.Linear):
    """A bias-free projection; once cpu_gemm.prepack gives it a oneDNN-packed copy of its weight
    (`packed`), it multiplies through that copy (the plain weight stays, for every other reader)."""

    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            from services.engine.model.cpu_gemm import packed_linear
            return packed_linear(x, self.packed)
        return F.linear(x, self.weight)


def linear(in_features: int, out_features: int) -> Linear:
    """A bias-free projection whose weight the loader assigns (created on the meta device)."""
    layer = Linear(in_features, out_features, bias=False, device="meta")
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
        gate_up = self.gate_up_proj(x)                     # [T, 2 * intermediate]
        if _FUSED.get():
            from kernels.silu_mul import silu_and_mul
            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)                # [T, intermediate] each
        return self.down_proj(F.silu(gate) * up)
