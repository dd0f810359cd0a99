"""KVCache: layout, sizes, and the block export/import used for KV transfer."""
from __future__ import annotations

import pytest
import torch

from services.engine.model import KVCache, ModelConfig, kv_bytes_per_token
from tests.engine.model.helpers import CONFIG_A


def small_config() -> ModelConfig:
    raw = {**CONFIG_A, "model_type": "llama", "num_hidden_layers": 3}
    return ModelConfig.from_dict(raw)


def test_sizes_follow_the_layout():
    config = small_config()  # 3 layers, 2 kv heads, head_dim 32
    assert kv_bytes_per_token(config, "bfloat16") == 3 * 2 * 2 * 32 * 2
    assert kv_bytes_per_token(config, torch.float32) == 3 * 2 * 2 * 32 * 4
    cache = KVCache(config, num_blocks=10, block_size=16, dtype="float16")
    assert cache.bytes_per_block == 16 * kv_bytes_per_token(config, "float16")
    k, v = cache.layer(1)
    assert k.shape == v.shape == (10, 16, 2, 32) and k.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_then_write_round_trips_bit_exact_for_scattered_blocks(dtype):
    config = small_config()
    src = KVCache(config, num_blocks=12, block_size=4, dtype=dtype)
    src.data.copy_(torch.randn(src.data.shape).to(dtype))
    exported = src.read_blocks([7, 2, 11, 0])
    assert exported.shape == (3, 2, 4, 4, 2, 32)

    dst = KVCache(config, num_blocks=20, block_size=4, dtype=dtype)
    dst.write_blocks([19, 3, 5, 8], exported)
    assert torch.equal(dst.read_blocks([19, 3, 5, 8]), exported)
    assert torch.equal(dst.layer(2)[1][3], src.layer(2)[1][2])  # layer 2, V, block 2 -> block 3
    untouched = [b for b in range(20) if b not in (19, 3, 5, 8)]
    assert not dst.read_blocks(untouched).any()

    exported.zero_()  # read_blocks returned a copy
    assert src.read_blocks([7]).any()


def test_write_blocks_rejects_bad_input():
    cache = KVCache(small_config(), num_blocks=4, block_size=2, dtype=torch.float32)
    good = cache.read_blocks([0, 1])
    with pytest.raises(ValueError, match="distinct"):
        cache.write_blocks([1, 1], good)
    with pytest.raises(ValueError, match="shape"):
        cache.write_blocks([1], good)
    with pytest.raises(ValueError, match="dtype"):
        cache.write_blocks([0, 1], good.half())
    with pytest.raises(ValueError, match="block ids"):
        cache.read_blocks([4])
