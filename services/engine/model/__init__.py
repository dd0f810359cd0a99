"""The model executor: a Llama-family model over one flattened ragged batch on a paged KV cache.

Modules, in the order a batch flows through them:
    batch.py      SeqChunk -> BatchInputs (prepare_inputs)
    runner.py     ModelRunner.execute: prepare, build attention metadata, forward
    llama.py      LlamaForward (layers.py: RMSNorm, SwiGLU; rope.py: RoPE incl. Llama-3 scaling)
    attention.py  AttentionBackend interface and the torch reference backend
    kv_cache.py   KVCache: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
    config.py / loader.py   HF checkpoint dir -> ModelConfig, LlamaForward
"""
import importlib

# name -> the module that defines it; imported on first use, so that importing one torch-free
# module of this package (config.py: the simulated engine reads a checkpoint's config) does not
# import the model's torch modules
_EXPORTS = {
    "AttentionBackend": "attention", "TorchAttentionBackend": "attention",
    "BatchInputs": "batch", "SeqChunk": "batch", "prepare_inputs": "batch",
    "ModelConfig": "config",
    "KVCache": "kv_cache", "kv_bytes_per_token": "kv_cache",
    "LlamaForward": "llama",
    "load_model": "loader",
    "ModelRunner": "runner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
