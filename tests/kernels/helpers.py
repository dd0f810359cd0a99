"""Random paged batches and the torch reference to hold the Triton kernels against.

A case is a list of (start_pos, q_len) per sequence: q_len == 1 rows decode, the others are
prefill chunks (start_pos 0: a first chunk). Block tables are drawn without replacement from a
shuffled pool that leaves holes (block ids in no table, filled with random K/V like the used
ones), so a kernel that reads a wrong block or an unmasked slot gives a different answer.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from services.engine.model.attention import TorchAttentionBackend
from services.engine.model.batch import BatchInputs, SeqChunk, prepare_inputs

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
ON_GPU = os.environ.get("KVFLEET_KERNELS_ON_GPU") == "1"   # kernels/gpu_check.sh
DEVICE = "cuda" if ON_GPU else "cpu"


def generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


@dataclass
class Case:
    batch: BatchInputs
    block_size: int
    q: torch.Tensor                 # [T, heads, d]
    k: torch.Tensor                 # [T, kv_heads, d]
    v: torch.Tensor
    k_cache: torch.Tensor           # [num_blocks, block_size, kv_heads, d]
    v_cache: torch.Tensor


def make_case(specs: list[tuple[int, int]], heads: int = 4, kv_heads: int = 2, head_dim: int = 32,
              block_size: int = 4, dtype: torch.dtype = torch.float32, cache_dtype: torch.dtype | None = None,
              seed: int = 0, strided_q: bool = True) -> Case:
    gen = generator(seed)
    blocks_needed = [-(-(start + q_len) // block_size) for start, q_len in specs]
    num_blocks = 2 * sum(blocks_needed) + 2
    pool = (torch.randperm(num_blocks - 1, generator=gen, device=DEVICE) + 1).tolist()  # block 0: padding only
    chunks = []
    for (start, q_len), nb in zip(specs, blocks_needed):
        table, pool = pool[:nb], pool[nb + 1:]                            # skip one id: a hole
        chunks.append(SeqChunk([1] * q_len, start, table, (q_len - 1,)))
    batch = prepare_inputs(chunks, block_size).to(DEVICE)
    t = batch.token_ids.numel()
    qkv = torch.randn(t, heads + 2 * kv_heads, head_dim, generator=gen, device=DEVICE).to(dtype)
    # q, k, v as the model passes them: strided views of one [T, heads + 2 * kv_heads, d] tensor
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    if not strided_q:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=DEVICE).to(cache_dtype or dtype)
    v_cache = torch.randn(shape, generator=gen, device=DEVICE).to(cache_dtype or dtype)
    return Case(batch, block_size, q, k, v, k_cache, v_cache)


def triton_forward(case: Case, k_scale: float = 1.0, v_scale: float = 1.0):
    """-> (out, k_cache, v_cache) after TritonAttentionBackend.forward on copies of the case's caches."""
    from services.engine.model.triton_backend import TritonAttentionBackend
    backend = TritonAttentionBackend(case.q.shape[1])
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    meta = backend.build_metadata(case.batch, case.block_size, case.q.dtype, k_scale=k_scale, v_scale=v_scale)
    return backend.forward(case.q, case.k, case.v, k_cache, v_cache, meta), k_cache, v_cache


def reference_forward(case: Case, k_scale: float = 1.0, v_scale: float = 1.0):
    """TorchAttentionBackend in float32 over the values the kernels see: the cache dequantized
    (cache * scale) and this step's K/V as they will read back from it ((k / scale) -> cache dtype)."""
    def seen(x, scale):
        return (x.float() / scale).to(case.k_cache.dtype).float() * scale
    k_cache, v_cache = case.k_cache.float() * k_scale, case.v_cache.float() * v_scale
    backend = TorchAttentionBackend(case.q.shape[1])
    meta = backend.build_metadata(case.batch, case.block_size, torch.float32)
    out = backend.forward(case.q.float(), seen(case.k, k_scale), seen(case.v, v_scale), k_cache, v_cache, meta)
    return out, k_cache, v_cache


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)
