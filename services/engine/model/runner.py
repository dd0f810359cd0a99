"""ModelRunner: SeqChunks in, logits out, one forward pass per scheduler iteration.

    execute(chunks)
      1. prepare_inputs      flat token rows, positions, slot mapping, block tables (numpy, on host)
      2. build_metadata      the attention backend's per-batch index and mask tensors
      3. model forward       writes this step's K/V into the cache, returns logits for logit_rows
The backend: TorchAttentionBackend (anywhere), or triton_backend.TritonAttentionBackend (CUDA; it
also switches RMSNorm, RoPE and SiLU-mul to Triton kernels); "auto" picks Triton on CUDA.
"""
from __future__ import annotations

import importlib.util
import time
from typing import Sequence

import torch

from services.engine.model.attention import AttentionBackend, TorchAttentionBackend
from services.engine.model.batch import BatchInputs, SeqChunk, prepare_inputs
from services.engine.model.cpu_gemm import prepack
from services.engine.model.kv_cache import KVCache
from services.engine.model.layers import fused_kernels
from services.engine.model.llama import LlamaForward
from services.protocol import env

ATTENTION_BACKENDS = ("auto", "torch", "triton")


def make_attention_backend(name: str, num_heads: int, device: torch.device) -> AttentionBackend:
    """auto: triton on CUDA (when it imports), torch elsewhere. triton off CUDA runs only under
    TRITON_INTERPRET=1 (tests: ~10 ms per kernel program)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and importlib.util.find_spec("triton") else "torch"
    if name == "torch":
        return TorchAttentionBackend(num_heads)
    if name != "triton":
        raise ValueError(f"unknown attention backend {name!r} ({'|'.join(ATTENTION_BACKENDS)})")
    if device.type != "cuda" and env.TRITON_INTERPRET.get() != "1":
        raise ValueError(f"the triton attention backend needs CUDA (model on {device}), or "
                         "TRITON_INTERPRET=1 set before start (the interpreter: tests only)")
    from services.engine.model.triton_backend import TritonAttentionBackend  # noqa: PLC0415 (imports triton)
    return TritonAttentionBackend(num_heads)


class ModelRunner:
    def __init__(self, model: LlamaForward, kv_cache: KVCache, backend: AttentionBackend | str | None = None,
                 cpu_gemm: str = "auto"):
        """backend: an AttentionBackend, or a name in ATTENTION_BACKENDS (None: auto). cpu_gemm:
        EngineConfig.cpu_gemm (cpu_gemm.MODES)."""
        config = model.config
        if kv_cache.num_layers != config.num_layers:
            raise ValueError(f"KV cache has {kv_cache.num_layers} layers, model has {config.num_layers}")
        self.model = model
        self.kv_cache = kv_cache
        if backend is None or isinstance(backend, str):
            backend = make_attention_backend(backend or "auto", config.num_heads, model.device)
        self.backend = backend
        # the Triton backend brings RMSNorm / RoPE / SiLU-mul kernels along (layers.fused_kernels)
        self.fused_layers = bool(getattr(backend, "fused_layers", False))
        if not self.fused_layers:   # on a CPU: oneDNN matmuls through weights packed once
            prepack(model, cpu_gemm)
        self.last_prepare_s = 0.0  # steps 1-2 of the last execute (host-side input preparation)

    def execute(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """-> float32 logits [sum(len(c.logit_rows)), vocab]: chunk order, then logit_rows order."""
        if not chunks:
            return torch.empty(0, self.model.config.vocab_size, device=self.model.device)
        with torch.inference_mode():
            t0 = time.perf_counter()
            batch = prepare_inputs(chunks, self.kv_cache.block_size)
            self.check_ranges(batch)
            batch = batch.to(self.model.device)
            kv = self.kv_cache
            meta = self.backend.build_metadata(batch, kv.block_size, self.model.dtype,
                                               k_scale=kv.k_scale, v_scale=kv.v_scale)
            self.last_prepare_s = time.perf_counter() - t0
            with fused_kernels(self.fused_layers):
                return self.model(batch, self.kv_cache, self.backend, meta)

    def check_ranges(self, batch: BatchInputs) -> None:
        """Out-of-range ids would be silent garbage (or a device assert) deeper down."""
        if batch.host.max_block_id >= self.kv_cache.num_blocks:
            raise ValueError(f"block id {batch.host.max_block_id} >= num_blocks {self.kv_cache.num_blocks}")
        if batch.host.max_token_id >= self.model.config.vocab_size:
            raise ValueError(f"token id {batch.host.max_token_id} >= vocab_size {self.model.config.vocab_size}")
