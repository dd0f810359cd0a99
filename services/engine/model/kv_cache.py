"""The paged KV cache: one tensor holding every layer's K and V blocks.

    data: [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]
    layer(i) -> (k_cache, v_cache), each a contiguous view [num_blocks, block_size, kv_heads, head_dim]

Block b holds positions [j * block_size, (j + 1) * block_size) of any sequence whose block_table[j] == b;
which blocks belong to whom is the block pool's business, not this class's. The cache starts zeroed and
only ever holds finite values, so attention may read padded or stale slots and mask them out
(0 * finite == 0; a NaN there would leak through the masked softmax).
"""
from __future__ import annotations

from typing import Sequence

import torch

from services.engine.model.config import ModelConfig, resolve_dtype


def kv_bytes_per_token(model_config: ModelConfig, dtype: str | torch.dtype) -> int:
    per_layer = 2 * model_config.num_kv_heads * model_config.head_dim
    return model_config.num_layers * per_layer * resolve_dtype(dtype).itemsize


def kv_cache_shape(model_config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """The `data` layout: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""
    return (model_config.num_layers, 2, num_blocks, block_size, model_config.num_kv_heads,
            model_config.head_dim)


class KVCache:
    def __init__(self, model_config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: str | torch.dtype, device: torch.device | str = "cpu",
                 data: torch.Tensor | None = None):
        """`data`: optional memory to hold the cache (e.g. shared with another process), zeroed,
        of kv_cache_shape(...) and `dtype`; by default the cache allocates its own."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1 (got {num_blocks}, {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_layers = model_config.num_layers
        self.dtype = resolve_dtype(dtype)
        self._bytes_per_token = kv_bytes_per_token(model_config, self.dtype)
        shape = kv_cache_shape(model_config, num_blocks, block_size)
        if data is None:
            data = torch.zeros(shape, dtype=self.dtype, device=device)
        elif tuple(data.shape) != shape or data.dtype != self.dtype:
            raise ValueError(f"KVCache: data {tuple(data.shape)} {data.dtype} != {shape} {self.dtype}")
        self.data = data

    @classmethod
    def over(cls, data: torch.Tensor) -> KVCache:
        """A KVCache over existing memory of the layout above (another process's cache, shared):
        everything it needs is in the tensor's shape and dtype."""
        cache = cls.__new__(cls)
        layers, _, cache.num_blocks, cache.block_size, kv_heads, head_dim = data.shape
        cache.num_layers, cache.dtype, cache.data = layers, data.dtype, data
        cache._bytes_per_token = layers * 2 * kv_heads * head_dim * data.dtype.itemsize
        return cache

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def bytes_per_block(self) -> int:
        return self._bytes_per_token * self.block_size

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index, 0], self.data[index, 1]

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """-> a copy [num_layers, 2, n, block_size, kv_heads, head_dim] of the blocks, in order."""
        # index_select on a [layers * 2, num_blocks, block_elems] view is ~25x faster on CPU than
        # selecting along dim 2 of the 6-D tensor
        flat = self.data.view(self.num_layers * 2, self.num_blocks, -1)
        return flat.index_select(1, self._index(block_ids)).view(
            *self.data.shape[:2], len(block_ids), *self.data.shape[3:])

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Inverse of read_blocks: block_ids[i] gets data[:, :, i]. Ids must be distinct."""
        index = self._index(block_ids)
        if len(set(block_ids)) != len(block_ids):
            raise ValueError("write_blocks: block ids must be distinct")
        expected = (*self.data.shape[:2], len(block_ids), *self.data.shape[3:])
        if tuple(data.shape) != expected:
            raise ValueError(f"write_blocks: data shape {tuple(data.shape)} != expected {expected}")
        if data.dtype != self.dtype:
            raise ValueError(f"write_blocks: data dtype {data.dtype} != cache dtype {self.dtype}")
        flat = self.data.view(self.num_layers * 2, self.num_blocks, -1)
        flat.index_copy_(1, index, data.to(self.device).reshape(flat.shape[0], len(block_ids), -1))

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        index = torch.as_tensor(list(block_ids), dtype=torch.int64)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.num_blocks):
            raise ValueError(f"block ids must lie in [0, {self.num_blocks})")
        return index.to(self.device)
