"""The capacity model: memory, KV capacity and iteration time of a (model, GPU, TP, dtype) target.

Memory (per replica of `tp` GPUs):
  weights        = layer matmuls x dtype bytes + (embedding + LM head + norms) x 2 bytes
  KV bytes/token = 2 . L . H_kv . d_h . kv bytes;  per rank: H_kv / tp heads (at least 1)
  KV tokens      = (GPU memory x mem_utilization - weights / tp - workspace) / KV bytes per rank

Iteration time of a batch (`step_s`), a roofline per GPU plus communication:
  compute  = linear FLOPs / (peak(dtype) x mfu) + attention FLOPs / (peak(bf16) x mfu)
  memory   = (weights read + KV read and written) / (HBM bandwidth x mbu)
  step     = max(compute, memory) + all-reduce + step_overhead_s
with
  linear FLOPs    = 2 . layer matmul params . tokens + 2 . V . h . sampled tokens   (over tp)
  attention FLOPs = 4 . L . H . d_h . (query, key) pairs; a chunk of n tokens after c cached
                    ones has n.c + n(n+1)/2 pairs (causal: the quadratic term)     (over tp)
  all-reduce      = 2 per layer; each 2(tp-1)/tp . tokens . h . activation bytes /
                    (NVLink x nvlink_efficiency) + 2(tp-1) . allreduce_hop_latency_s
Attention runs at the bf16 peak even for fp8 weights: the KV cache is dequantized into
bf16 attention kernels (vLLM's default path).

KV transfer: tokens x KV bytes/token / (Gb/s x 1e9/8 x network_efficiency).

The constants and where they come from: `services/planner/constants.py`; the published points
the defaults are checked against: `services/planner/published.py`; docs/capacity.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.planner.constants import Constants, load_constants
from services.planner.hardware import GB, GPUSpec, ModelShape, dtype_bytes, gpu_spec, model_shape
from services.planner.step_time import BatchShape

NORM_AND_EMBEDDING_BYTES = 2      # embedding, LM head and norms stay bf16 in fp8 checkpoints


@dataclass(frozen=True, slots=True)
class Target:
    model: ModelShape
    gpu: GPUSpec
    tp: int
    dtype: str                    # weights: bf16 | fp8
    kv_dtype: str                 # KV cache: bf16 | fp8

    def __post_init__(self) -> None:
        dtype_bytes(self.dtype)
        dtype_bytes(self.kv_dtype)
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp: expected an integer >= 1, got {self.tp!r}")
        if self.model.heads % self.tp:
            raise ValueError(f"tp {self.tp} does not divide {self.model.name}'s "
                             f"{self.model.heads} attention heads")

    @property
    def weights_bytes(self) -> float:
        m = self.model
        return (m.layers * m.layer_matmul_params * dtype_bytes(self.dtype)
                + (m.embedding_params + m.head_params + m.norm_params) * NORM_AND_EMBEDDING_BYTES)

    @property
    def weights_read_bytes(self) -> float:
        """Weights one iteration streams from HBM: all but the embedding (a row lookup)."""
        return self.weights_bytes - self.model.embedding_params * NORM_AND_EMBEDDING_BYTES * (
            0 if self.model.tied_embeddings else 1)

    @property
    def kv_bytes_per_token(self) -> int:
        m = self.model
        return 2 * m.layers * m.kv_heads * m.head_dim * dtype_bytes(self.kv_dtype)

    @property
    def kv_bytes_per_token_per_rank(self) -> int:
        """KV heads are split over the ranks; with fewer heads than ranks each rank holds one."""
        m = self.model
        heads = max(1, -(-m.kv_heads // self.tp))
        return 2 * m.layers * heads * m.head_dim * dtype_bytes(self.kv_dtype)


@dataclass(frozen=True, slots=True)
class CostModel:
    """A target's roofline. `step_s` is plain float arithmetic on coefficients fixed here."""

    target: Target
    constants: Constants
    _s_per_token: float           # linear-layer compute seconds per token through the layers
    _s_per_sample: float          # LM-head compute seconds per sampled token
    _s_per_pair: float            # attention compute seconds per (query, key) pair
    _weights_s: float             # seconds to stream the weights once
    _s_per_kv_token: float        # seconds to read or write one token's KV (this rank's share)
    _allreduce_s_per_token: float
    _fixed_s: float               # all-reduce latencies + step overhead

    @classmethod
    def for_target(cls, model: str = "llama-3-70b", gpu: str = "h200", tp: int = 4,
                   dtype: str = "fp8", kv_dtype: str | None = None,
                   constants_file: str | None = None,
                   constants: Constants | None = None) -> CostModel:
        target = Target(model_shape(model), gpu_spec(gpu), tp, dtype, kv_dtype or dtype)
        return cls.build(target, constants or load_constants(constants_file))

    @classmethod
    def build(cls, t: Target, c: Constants) -> CostModel:
        m, g, tp = t.model, t.gpu, t.tp
        linear_flops_s = g.peak_flops(t.dtype) * c.mfu
        bandwidth = g.hbm_bytes_s * c.mbu
        hops = 2 * (tp - 1)
        allreduces = 2 * m.layers if tp > 1 else 0
        return cls(
            target=t, constants=c,
            _s_per_token=2 * m.layer_matmul_params * m.layers / tp / linear_flops_s,
            _s_per_sample=2 * m.vocab * m.hidden / tp / linear_flops_s,
            _s_per_pair=4 * m.layers * m.heads * m.head_dim / tp / (g.bf16_flops * c.mfu),
            _weights_s=t.weights_read_bytes / tp / bandwidth,
            _s_per_kv_token=t.kv_bytes_per_token_per_rank / bandwidth,
            _allreduce_s_per_token=allreduces * hops / tp * m.hidden * c.activation_bytes
            / (g.nvlink_bytes_s * c.nvlink_efficiency),
            _fixed_s=allreduces * hops * c.allreduce_hop_latency_s + c.step_overhead_s,
        )

    def step_s(self, batch: BatchShape) -> float:
        """Seconds one iteration of `batch` takes (0 for an empty batch)."""
        if not batch.prefill_chunks and not batch.decode_contexts:
            return 0.0
        decode_context = sum(batch.decode_contexts)
        tokens = samples = len(batch.decode_contexts)
        pairs = kv_tokens = decode_context
        for n, cached in batch.prefill_chunks:
            tokens += n
            samples += 1
            pairs += n * cached + n * (n + 1) // 2
            kv_tokens += cached + n
        compute = tokens * self._s_per_token + samples * self._s_per_sample + pairs * self._s_per_pair
        memory = self._weights_s + kv_tokens * self._s_per_kv_token
        return (compute if compute > memory else memory) + tokens * self._allreduce_s_per_token \
            + self._fixed_s

    def transfer_s(self, num_tokens: int, gbps: float) -> float:
        """Seconds to move `num_tokens` tokens of KV over a `gbps` Gb/s path."""
        if gbps <= 0:
            raise ValueError(f"network bandwidth must be > 0 Gb/s, got {gbps!r}")
        bytes_s = gbps * 1e9 / 8 * self.constants.network_efficiency
        return num_tokens * self.target.kv_bytes_per_token / bytes_s

    def prefill_s(self, prompt_tokens: int, cached: int = 0) -> float:
        """One unchunked prefill of `prompt_tokens` (after `cached` tokens already in KV)."""
        return self.step_s(BatchShape(prefill_chunks=((prompt_tokens, cached),)))

    def decode_step_s(self, batch: int, context: int) -> float:
        """One decode iteration of `batch` sequences, each attending over `context` tokens."""
        return self.step_s(BatchShape(decode_contexts=(context,) * batch))

    @property
    def kv_tokens_per_replica(self) -> int:
        t, c = self.target, self.constants
        free = t.gpu.hbm_bytes * c.mem_utilization - t.weights_bytes / t.tp \
            - c.workspace_gb_per_gpu * GB
        return max(0, int(free // t.kv_bytes_per_token_per_rank))

    def concurrent_contexts(self, context_tokens: int) -> int:
        return self.kv_tokens_per_replica // context_tokens
