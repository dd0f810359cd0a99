"""The model executor: a Llama-family model over one flattened ragged batch on a paged KV cache.

Modules, in the order a batch flows through them:
    batch.py      SeqChunk -> BatchInputs (prepare_inputs)
    runner.py     ModelRunner.execute: prepare, build attention metadata, forward
    llama.py      LlamaForward (layers.py: RMSNorm, SwiGLU; rope.py: RoPE incl. Llama-3 scaling)
    attention.py  AttentionBackend interface and the torch reference backend
    kv_cache.py   KVCache: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
    config.py / loader.py   HF checkpoint dir -> ModelConfig, LlamaForward
"""
from services.engine.model.attention import AttentionBackend, TorchAttentionBackend
from services.engine.model.batch import BatchInputs, SeqChunk, prepare_inputs
from services.engine.model.config import ModelConfig
from services.engine.model.kv_cache import KVCache, kv_bytes_per_token
from services.engine.model.llama import LlamaForward
from services.engine.model.loader import load_model
from services.engine.model.runner import ModelRunner

__all__ = [
    "AttentionBackend", "BatchInputs", "KVCache", "LlamaForward", "ModelConfig", "ModelRunner", "SeqChunk",
    "TorchAttentionBackend", "kv_bytes_per_token", "load_model", "prepare_inputs",
]
