"""RMSNorm (+ residual), RoPE (Llama-3 scaled tables) and SiLU-mul kernels against the torch layers,
and the layers' dispatch to them under fused_kernels()."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.rmsnorm import rmsnorm
from kernels.rope import apply_rope as rope_kernel
from kernels.silu_mul import silu_and_mul
from services.engine.model.config import ModelConfig
from services.engine.model.layers import RMSNorm, SwiGLU, fused_kernels
from services.engine.model.rope import RotaryEmbedding, apply_rope
from tests.kernels.helpers import generator

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# exact where the kernel rounds as torch does; fp32 sums differ in order (rsqrt, mean)
ULP = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _norm(hidden: int, dtype) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5)
    norm.weight = torch.nn.Parameter(torch.randn(hidden, generator=generator(1)).to(dtype),
                                     requires_grad=False)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_matches_layer(dtype):
    x = torch.randn(5, 96).to(dtype) * 3
    norm = _norm(96, dtype)
    torch.testing.assert_close(rmsnorm(x, norm.weight, norm.eps), norm(x), atol=ULP[dtype], rtol=ULP[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_fused_with_residual(dtype):
    x, residual = torch.randn(4, 64).to(dtype), torch.randn(4, 64).to(dtype)
    norm = _norm(64, dtype)
    out, h = rmsnorm(x, norm.weight, norm.eps, residual)
    assert torch.equal(h, x + residual)
    torch.testing.assert_close(out, norm(x + residual), atol=ULP[dtype], rtol=ULP[dtype])
    with fused_kernels():  # the layer's residual form dispatches to the same kernel
        fused_out, fused_h = norm(x, residual)
    assert torch.equal(fused_out, out) and torch.equal(fused_h, h)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_with_llama3_scaling_on_strided_heads(dtype):
    config = ModelConfig.from_dict({
        "model_type": "llama", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 40960, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    positions = torch.tensor([0, 1, 7, 300, 9000, 20000])       # both sides of the 8K original context
    cos, sin = RotaryEmbedding(config)(positions, 20001, dtype)
    qkv = torch.randn(6, 8, 16).to(dtype)
    x = qkv[:, :6]                                              # q and k heads: a strided view
    expected = apply_rope(x, cos, sin)
    torch.testing.assert_close(rope_kernel(x, cos, sin), expected, atol=ULP[dtype], rtol=ULP[dtype])
    with fused_kernels():
        torch.testing.assert_close(apply_rope(x, cos, sin), expected, atol=ULP[dtype], rtol=ULP[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    gate_up = (torch.randn(3, 2 * 80) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(gate_up), F.silu(gate) * up, atol=ULP[dtype], rtol=ULP[dtype])


def test_swiglu_dispatches_under_fused_kernels():
    mlp = SwiGLU(32, 48)
    gen = generator(2)
    mlp.gate_up_proj.weight = torch.nn.Parameter(torch.randn(96, 32, generator=gen), requires_grad=False)
    mlp.down_proj.weight = torch.nn.Parameter(torch.randn(32, 48, generator=gen), requires_grad=False)
    x = torch.randn(4, 32, generator=gen)
    with fused_kernels():
        fused = mlp(x)
    torch.testing.assert_close(fused, mlp(x), atol=1e-4, rtol=1e-5)


def test_fused_kernels_is_scoped():
    from services.engine.model.layers import fused_enabled
    with fused_kernels():
        assert fused_enabled()
        with fused_kernels(False):
            assert not fused_enabled()
        assert fused_enabled()
    assert not fused_enabled()
