"""What the cost model is told about the target: GPU specifications and model shapes.

GPUs (per GPU, dense tensor-core peaks, no sparsity; SXM parts):

| gpu  | bf16 TFLOP/s | fp8 TFLOP/s | HBM TB/s | HBM GB | NVLink GB/s per direction |
|------|--------------|-------------|----------|--------|---------------------------|
| h100 | 989          | 1979        | 3.35     | 80     | 450 (NVLink 4, 900 bidir.)|
| h200 | 989          | 1979        | 4.8      | 141    | 450 (NVLink 4, 900 bidir.)|
| b200 | 2250         | 4500        | 8.0      | 180    | 900 (NVLink 5, 1800 bidir.)|

B200: 180 GB is what a DGX/HGX B200 gives each GPU (1,440 GB over 8); the 192 GB package figure
counts memory the board does not expose. Its FLOP/s are NVIDIA's HGX B200 dense figures.
GB here is 1e9 bytes, TB/s 1e12 bytes/s.

Models: a built-in table of Llama shapes, or an HF checkpoint directory's config.json.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GB = 1e9
DTYPE_BYTES = {"bf16": 2, "fp8": 1}


@dataclass(frozen=True, slots=True)
class GPUSpec:
    name: str
    bf16_flops: float          # dense FLOP/s
    fp8_flops: float
    hbm_bytes_s: float         # HBM bandwidth, bytes/s
    hbm_bytes: float           # memory, bytes
    nvlink_bytes_s: float      # per GPU, one direction, bytes/s

    def peak_flops(self, dtype: str) -> float:
        return self.fp8_flops if dtype == "fp8" else self.bf16_flops


GPUS: dict[str, GPUSpec] = {
    "h100": GPUSpec("H100 SXM 80GB", 989e12, 1979e12, 3.35e12, 80 * GB, 450 * GB),
    "h200": GPUSpec("H200 SXM 141GB", 989e12, 1979e12, 4.8e12, 141 * GB, 450 * GB),
    "b200": GPUSpec("B200 180GB (HGX)", 2250e12, 4500e12, 8.0e12, 180 * GB, 900 * GB),
}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A Llama-family decoder's shape: all the cost model needs of a model."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False

    @property
    def layer_matmul_params(self) -> int:
        """q, k, v, o projections and the SwiGLU MLP (gate, up, down) of one layer."""
        h, dh = self.hidden, self.head_dim
        attention = h * self.heads * dh * 2 + h * self.kv_heads * dh * 2
        return attention + 3 * h * self.intermediate

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """The LM head's own weights (0 when it shares the embedding's)."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    @property
    def norm_params(self) -> int:
        return (2 * self.layers + 1) * self.hidden

    @property
    def params(self) -> int:
        return (self.layers * self.layer_matmul_params + self.embedding_params + self.head_params
                + self.norm_params)


MODELS: dict[str, ModelShape] = {
    "llama-3-70b": ModelShape("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
    "llama-3-8b": ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
}


def gpu_spec(name: str) -> GPUSpec:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown gpu {name!r}; expected one of {sorted(GPUS)}") from None


def model_shape(name_or_dir: str) -> ModelShape:
    """A built-in shape by name, or the shape of the HF checkpoint in that directory."""
    if name_or_dir.lower() in MODELS:
        return MODELS[name_or_dir.lower()]
    path = Path(name_or_dir)
    if not path.is_dir():
        raise ValueError(f"model {name_or_dir!r} is neither a built-in shape ({sorted(MODELS)}) "
                         "nor a checkpoint directory")
    from services.engine.model.config import ModelConfig  # noqa: PLC0415 (imports torch)
    c = ModelConfig.from_dir(path)
    return ModelShape(path.name, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads,
                      c.head_dim, c.intermediate_size, c.vocab_size, c.tie_word_embeddings)


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}") from None
