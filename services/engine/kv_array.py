"""The KV cache's layout without torch, and the simulated core's cache over a numpy array.

The layout is KVCache's (services/engine/model/kv_cache.py):

    data: [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]

`ArrayKVCache` keeps KVCache's block API (read_blocks / write_blocks, the sizes, the dtype name a
KV transfer's layout carries) over a numpy array in host memory: the simulated engine core's
cache, which is a file in /dev/shm that the worker maps too (services/worker/engine_core.py,
SharedKV). The KV transports read and write either kind of pool through its bytes
(services/kv_transfer/base.py, byte_view), so a simulated core and its worker import no torch.
The model's cache stays a torch tensor (KVCache): bfloat16 and fp8 have no numpy dtype.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from services.engine.config import KV_CACHE_DTYPES

KV_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}   # bytes per element, by name


def kv_dtype_name(dtype) -> str:
    """The name a KV layout carries (kvfleet.v1.KVLayout.dtype) for a torch or numpy dtype or a
    dtype name: "fp8" for e4m3fn, else the name without "torch."."""
    name = str(dtype).removeprefix("torch.")
    return "fp8" if name == "float8_e4m3fn" else name


def check_write(block_ids: Sequence[int], data, cache_shape, cache_dtype) -> None:
    """What write_blocks refuses, for either kind of cache (a numpy or torch `data`): repeated ids,
    a shape other than [num_layers, 2, len(block_ids), block_size, kv_heads, head_dim], another
    dtype. ValueError saying which."""
    if len(set(block_ids)) != len(block_ids):
        raise ValueError("write_blocks: block ids must be distinct")
    expected = (*cache_shape[:2], len(block_ids), *cache_shape[3:])
    if tuple(data.shape) != expected:
        raise ValueError(f"write_blocks: data shape {tuple(data.shape)} != expected {expected}")
    if data.dtype != cache_dtype:
        raise ValueError(f"write_blocks: data dtype {data.dtype} != cache dtype {cache_dtype}")


def kv_itemsize(dtype) -> int:
    """Bytes per element of a KV cache of `dtype`: a torch or numpy dtype, or a name ("fp8",
    "float16", "torch.bfloat16", ...); ValueError for a name no KV cache has."""
    if not isinstance(dtype, str):
        return int(dtype.itemsize)
    if dtype == "auto":
        raise ValueError("kv cache dtype 'auto' needs the model's dtype")
    name = kv_dtype_name(dtype)
    if name not in KV_ITEMSIZE:
        raise ValueError(f"unsupported dtype {dtype!r} for a KV cache; expected one of {KV_CACHE_DTYPES}")
    return KV_ITEMSIZE[name]


def kv_bytes_per_token(model_config, dtype) -> int:
    """All layers, K and V, in a cache of `dtype` ("fp8": one byte per element)."""
    per_layer = 2 * model_config.num_kv_heads * model_config.head_dim
    return model_config.num_layers * per_layer * kv_itemsize(dtype)


def kv_cache_shape(model_config, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """The `data` layout: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""
    return (model_config.num_layers, 2, num_blocks, block_size, model_config.num_kv_heads,
            model_config.head_dim)


class ArrayKVCache:
    """KVCache's layout and block API over a numpy array (float16 or float32; host memory)."""

    tensor_parallel_size = 1
    k_scale = 1.0               # no fp8: the scales a KV layout carries are 1.0
    v_scale = 1.0
    device = "cpu"

    def __init__(self, model_config, num_blocks: int, block_size: int, dtype="float16",
                 data: np.ndarray | None = None) -> None:
        """`data`: optional memory to hold the cache (e.g. shared with another process), zeroed,
        of kv_cache_shape(...) and `dtype`; by default the cache allocates its own."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1 (got {num_blocks}, {block_size})")
        dtype = np.dtype(dtype)
        shape = kv_cache_shape(model_config, num_blocks, block_size)
        if data is None:
            data = np.zeros(shape, dtype)
        elif tuple(data.shape) != shape or data.dtype != dtype:
            raise ValueError(f"ArrayKVCache: data {tuple(data.shape)} {data.dtype} != {shape} {dtype}")
        self._set(data)

    @classmethod
    def over(cls, data: np.ndarray) -> ArrayKVCache:
        """A cache over existing memory of the layout above (another process's, shared)."""
        if data.ndim != 6 or data.shape[1] != 2:
            raise ValueError(f"ArrayKVCache.over: {tuple(data.shape)} is not "
                             "[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]")
        cache = cls.__new__(cls)
        cache._set(data)
        return cache

    def _set(self, data: np.ndarray) -> None:
        if not data.flags.c_contiguous:
            raise ValueError("ArrayKVCache: the cache's memory must be C-contiguous")
        self.data = data
        self.num_layers, _, self.num_blocks, self.block_size = data.shape[:4]
        self.dtype = data.dtype

    @property
    def dtype_name(self) -> str:
        return kv_dtype_name(self.dtype)

    @property
    def bytes_per_block(self) -> int:
        return self.data[:, :, 0].nbytes

    def read_blocks(self, block_ids: Sequence[int]) -> np.ndarray:
        """-> a copy [num_layers, 2, n, block_size, kv_heads, head_dim] of the blocks, in order."""
        return self.data[:, :, self._index(block_ids)]

    def write_blocks(self, block_ids: Sequence[int], data: np.ndarray) -> None:
        """Inverse of read_blocks: block_ids[i] gets data[:, :, i]. Ids must be distinct."""
        index = self._index(block_ids)
        check_write(block_ids, data, self.data.shape, self.dtype)
        self.data[:, :, index] = data

    def _index(self, block_ids: Sequence[int]) -> np.ndarray:
        index = np.asarray(list(block_ids), dtype=np.int64)
        if index.size and (int(index.min()) < 0 or int(index.max()) >= self.num_blocks):
            raise ValueError(f"block ids must lie in [0, {self.num_blocks})")
        return index
