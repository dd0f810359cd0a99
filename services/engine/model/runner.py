"""ModelRunner: SeqChunks in, logits out, one forward pass per scheduler iteration.

    execute(chunks)
      1. prepare_inputs      flat token rows, positions, slot mapping, block tables (numpy, on host)
      2. build_metadata      the attention backend's per-batch index and mask tensors
      3. model forward       writes this step's K/V into the cache, returns logits for logit_rows
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from services.engine.model.attention import AttentionBackend, TorchAttentionBackend
from services.engine.model.batch import BatchInputs, SeqChunk, prepare_inputs
from services.engine.model.kv_cache import KVCache
from services.engine.model.llama import LlamaForward


class ModelRunner:
    def __init__(self, model: LlamaForward, kv_cache: KVCache, backend: AttentionBackend | None = None):
        config = model.config
        if kv_cache.num_layers != config.num_layers:
            raise ValueError(f"KV cache has {kv_cache.num_layers} layers, model has {config.num_layers}")
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend or TorchAttentionBackend(config.num_heads)
        self.last_prepare_s = 0.0  # steps 1-2 of the last execute (host-side input preparation)

    def execute(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """-> float32 logits [sum(len(c.logit_rows)), vocab]: chunk order, then logit_rows order."""
        if not chunks:
            return torch.empty(0, self.model.config.vocab_size, device=self.model.device)
        with torch.inference_mode():
            t0 = time.perf_counter()
            batch = prepare_inputs(chunks, self.kv_cache.block_size)
            self._check_ranges(batch)
            batch = batch.to(self.model.device)
            meta = self.backend.build_metadata(batch, self.kv_cache.block_size, self.model.dtype)
            self.last_prepare_s = time.perf_counter() - t0
            return self.model(batch, self.kv_cache, self.backend, meta)

    def _check_ranges(self, batch: BatchInputs) -> None:
        """Out-of-range ids would be silent garbage (or a device assert) deeper down."""
        if batch.host.max_block_id >= self.kv_cache.num_blocks:
            raise ValueError(f"block id {batch.host.max_block_id} >= num_blocks {self.kv_cache.num_blocks}")
        if batch.host.max_token_id >= self.model.config.vocab_size:
            raise ValueError(f"token id {batch.host.max_token_id} >= vocab_size {self.model.config.vocab_size}")
