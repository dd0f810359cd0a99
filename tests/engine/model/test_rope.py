"""RoPE frequencies are transformers' own, bit for bit, with and without Llama-3 scaling."""
from __future__ import annotations

import pytest
import torch

from services.engine.model import ModelConfig
from services.engine.model.rope import RotaryEmbedding, compute_inv_freq
from tests.engine.model import helpers
from tests.engine.model.helpers import CONFIG_A, CONFIG_B


@pytest.mark.parametrize("overrides", [CONFIG_A, CONFIG_B], ids=["llama3", "default"])
def test_inv_freq_and_angles_match_transformers(overrides):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_config = helpers.hf_config(**overrides)
    ours = ModelConfig.from_dict(hf_config.to_dict())
    hf_rope = LlamaRotaryEmbedding(hf_config)
    assert torch.equal(compute_inv_freq(ours), hf_rope.inv_freq)

    positions = torch.tensor([0, 1, 8191, 8192, 9000, 40000])
    hf_cos, hf_sin = hf_rope(torch.zeros(1, dtype=torch.float32), positions[None])
    half = ours.head_dim // 2
    cos, sin = RotaryEmbedding(ours, initial_capacity=16)(positions, 40001, torch.float32)  # grows lazily
    assert torch.equal(cos, hf_cos[0, :, :half]) and torch.equal(sin, hf_sin[0, :, :half])
