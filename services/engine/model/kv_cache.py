"""The paged KV cache: one tensor holding every layer's K and V blocks.

    data: [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]
    layer(i) -> (k_cache, v_cache), each a contiguous view [num_blocks, block_size, kv_heads, head_dim]

Block b holds positions [j * block_size, (j + 1) * block_size) of any sequence whose block_table[j] == b;
which blocks belong to whom is the block pool's business, not this class's. The cache starts zeroed and
only ever holds finite values, so attention may read padded or stale slots and mask them out
(0 * finite == 0; a NaN there would leak through the masked softmax).

Cache dtype (`--kv-cache-dtype`, docs/engine.md "KV cache dtype"): "auto" is the model's dtype; any
float dtype works (a float32 model may keep a bfloat16 cache); "fp8" is float8_e4m3fn, one byte per
element, with one pair of per-tensor scales for the whole cache (every layer):
    stored = clamp(k / k_scale, -448, 448).to(e4m3)      read = stored.to(compute dtype) * k_scale
(v alike with v_scale). The scales are fixed when the cache is made (default 1.0, vLLM's default when
uncalibrated) and never change: blocks written under one scale are read under the same one, and a KV
transfer carries raw bytes, so both ends of a transfer must use the same scales.
"""
from __future__ import annotations

from typing import Sequence

import torch

from services.engine.config import KV_CACHE_DTYPES
# the layout's torch-free half (the simulated core's cache is a numpy array), re-exported
from services.engine.kv_array import check_write, kv_bytes_per_token, kv_cache_shape, kv_dtype_name  # noqa: F401
from services.engine.model.config import ModelConfig, resolve_dtype


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0           # largest finite e4m3fn; torch's casts past it differ by device and version


def resolve_kv_dtype(dtype: str | torch.dtype, model_dtype: str | torch.dtype | None = None) -> torch.dtype:
    """A KV cache dtype: "auto" (the model's, `model_dtype`), "fp8" (e4m3fn), a float dtype name, or a
    torch dtype."""
    if dtype == "auto":
        if model_dtype is None:
            raise ValueError("kv cache dtype 'auto' needs the model's dtype")
        return resolve_dtype(model_dtype)
    if dtype in ("fp8", "float8_e4m3fn", "torch.float8_e4m3fn", FP8):
        return FP8
    try:
        return resolve_dtype(dtype)
    except ValueError:
        raise ValueError(f"unsupported dtype {dtype!r} for a KV cache; expected one of {KV_CACHE_DTYPES}") from None


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8


class KVCache:
    def __init__(self, model_config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: str | torch.dtype, device: torch.device | str = "cpu",
                 data: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0):
        """`dtype`: a float dtype or "fp8" (not "auto": the engine resolves that). `data`: optional
        memory to hold the cache (e.g. shared with another process), zeroed, of kv_cache_shape(...)
        and `dtype`; by default the cache allocates its own. `k_scale`, `v_scale`: the fp8 per-tensor
        scales (module docstring); a cache of another dtype must keep 1.0."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1 (got {num_blocks}, {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_layers = model_config.num_layers
        self.dtype = resolve_kv_dtype(dtype)
        self.k_scale, self.v_scale = _check_scales(self.dtype, k_scale, v_scale)
        self._bytes_per_token = kv_bytes_per_token(model_config, self.dtype)
        shape = kv_cache_shape(model_config, num_blocks, block_size)
        if data is None:
            data = torch.zeros(shape, dtype=self.dtype, device=device)
        elif tuple(data.shape) != shape or data.dtype != self.dtype:
            raise ValueError(f"KVCache: data {tuple(data.shape)} {data.dtype} != {shape} {self.dtype}")
        self.data = data

    tensor_parallel_size = 1    # a whole worker's pool of N ranks' caches (over(), below)

    @classmethod
    def over(cls, data: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
             tensor_parallel_size: int = 1) -> KVCache:
        """A KVCache over existing memory of the layout above (another process's cache, shared):
        everything it needs is in the tensor's shape and dtype, and the fp8 scales.
        tensor_parallel_size N > 1: `data` is a worker's pool of all N ranks' caches, rank-major
        ([N * num_layers, ...], kv_heads a rank's); num_layers counts all N * num_layers rows, so
        reading and writing a block covers every rank's part of it (what a KV transfer ships)."""
        if tensor_parallel_size < 1 or data.shape[0] % tensor_parallel_size:
            raise ValueError(f"a pool of {data.shape[0]} layer rows cannot hold "
                             f"{tensor_parallel_size} tensor-parallel ranks' caches")
        cache = cls.__new__(cls)
        cache.tensor_parallel_size = tensor_parallel_size
        layers, _, cache.num_blocks, cache.block_size, kv_heads, head_dim = data.shape
        cache.num_layers, cache.dtype, cache.data = layers, data.dtype, data
        cache.k_scale, cache.v_scale = _check_scales(data.dtype, k_scale, v_scale)
        cache._bytes_per_token = layers * 2 * kv_heads * head_dim * data.dtype.itemsize
        return cache

    @property
    def dtype_name(self) -> str:
        """"fp8" | "bfloat16" | "float16" | "float32" (the KV transfer layout's dtype string)."""
        return kv_dtype_name(self.dtype)

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
        check_write(block_ids, data, self.data.shape, self.dtype)
        flat = byte_copyable(self.data).view(self.num_layers * 2, self.num_blocks, -1)
        rows = byte_copyable(data.to(self.device)).reshape(flat.shape[0], len(block_ids), -1)
        flat.index_copy_(1, index, rows)

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        index = torch.as_tensor(list(block_ids), dtype=torch.int64)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.num_blocks):
            raise ValueError(f"block ids must lie in [0, {self.num_blocks})")
        return index.to(self.device)


def byte_copyable(t: torch.Tensor) -> torch.Tensor:
    """index_copy_ has no float8 kernel on CPU (torch 2.13): an fp8 tensor is copied as its bytes."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def _check_scales(dtype: torch.dtype, k_scale: float, v_scale: float) -> tuple[float, float]:
    k_scale, v_scale = float(k_scale), float(v_scale)
    if not all(0.0 < s < float("inf") for s in (k_scale, v_scale)):
        raise ValueError(f"KV scales must be finite and > 0 (got {k_scale}, {v_scale})")
    if not is_fp8(dtype) and (k_scale, v_scale) != (1.0, 1.0):
        raise ValueError(f"KV scales apply to an fp8 cache only (dtype {dtype}, scales {k_scale}, {v_scale})")
    return k_scale, v_scale
