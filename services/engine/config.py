"""Typed, frozen configuration for the engine: traffic classes, tenants, scheduler, engine.

One frozen dataclass per component (STYLE 9). Defaults follow ../shared/DESIGN.md section 2;
everything is overridable. Derived values are properties, never written back.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Literal

AdmissionPolicy = Literal["reserve", "predict"]
WorkerRole = Literal["mixed", "prefill", "decode"]
KV_CACHE_DTYPES = ("auto", "fp8", "bfloat16", "float16", "float32")   # --kv-cache-dtype


def parse_kv_cache_scales(text: str) -> tuple[float, float]:
    """--kv-cache-scales: "K,V" (k_scale, v_scale) or one number for both."""
    parts = [float(x) for x in text.split(",")]
    if len(parts) not in (1, 2):
        raise ValueError(f"--kv-cache-scales takes K,V or one number, got {text!r}")
    return (parts[0], parts[-1])


def add_engine_args(p: argparse.ArgumentParser, whose: str = "the engine's") -> None:
    """--attention-backend, --kv-cache-dtype, --kv-cache-scales, --logprobs-mode: one definition
    for `kvfleet generate`, `kvfleet serve` and `kvfleet up` (which passes them to its workers).
    Unset: the engine config's value."""
    p.add_argument("--attention-backend", default=None, choices=["auto", "torch", "triton"],
                   help=f"{whose} paged attention (and fused layer) kernels; auto (default): "
                        "triton on CUDA, torch otherwise")
    p.add_argument("--kv-cache-dtype", default=None, choices=list(KV_CACHE_DTYPES),
                   help=f"{whose} KV cache element type: auto (the model's, default) | fp8 (e4m3, "
                        "per-tensor scales: half of bf16's bytes) | a float dtype; prefill and "
                        "decode workers must agree")
    p.add_argument("--kv-cache-scales", default=None, type=parse_kv_cache_scales, metavar="K,V",
                   help="fp8 KV cache: k_scale,v_scale (stored = k / k_scale; default 1.0,1.0), "
                        "the same on every worker")
    p.add_argument("--logprobs-mode", default=None, choices=["raw_logprobs", "processed_logprobs"],
                   help="vLLM's flag: logprobs of the model's distribution (raw_logprobs, default) "
                        "or of the one sampled from (after penalties, temperature, top-k/p)")


LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]


@dataclass(frozen=True)
class TrafficClass:
    """A traffic class and its service-level targets (DESIGN.md section 2)."""

    name: str
    priority: int                 # larger is served first
    ttft_target_s: float          # p99 TTFT target; a queued request predicted past it is rejected
    itl_target_s: float           # p99 inter-token latency target
    max_prompt_tokens: int
    output_cap: int               # reservation bound: min(max_tokens, output_cap)
    predicted_output_tokens: int  # initial reservation under the `predict` policy
    aging_s: float                # waiting this long raises effective priority by one level
    share_while_interactive_waits: float = 1.0  # max fraction of the token budget while interactive work waits
    degradable: bool = True       # stages S2/S3 may cap its output or send it to a fallback pool


INTERACTIVE = TrafficClass("interactive", priority=2, ttft_target_s=1.0, itl_target_s=0.1,
                           max_prompt_tokens=8192, output_cap=2048, predicted_output_tokens=256,
                           aging_s=10.0)
DOCUMENT = TrafficClass("document", priority=1, ttft_target_s=10.0, itl_target_s=0.1,
                        max_prompt_tokens=131072, output_cap=1024, predicted_output_tokens=256,
                        aging_s=10.0, share_while_interactive_waits=0.5, degradable=False)
BATCH = TrafficClass("batch", priority=0, ttft_target_s=600.0, itl_target_s=float("inf"),
                     max_prompt_tokens=131072, output_cap=4096, predicted_output_tokens=512,
                     aging_s=30.0, share_while_interactive_waits=0.25)


@dataclass(frozen=True)
class Tenant:
    """A tenant: its fair-share weight, the classes it may use, and its KV caps (None = no cap)."""

    name: str
    weight: float = 1.0
    classes: tuple[str, ...] = ("interactive", "document", "batch")
    max_active_seqs: int | None = None
    max_reserved_blocks: int | None = None
    critical: bool = False        # the router admits it into the headroom kept at every stage
    min_kv_blocks: int = 0        # guaranteed decode KV, fleet-wide: under it, ahead of borrowers


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduling contract's knobs (DESIGN.md section 5)."""

    token_budget: int = 512       # tokens per iteration, decode + prefill
    chunk_size: int = 256         # max prefill tokens of one sequence per iteration
    # While sequences decode, prefill chunks of one iteration attend over at most this many
    # (query token, key token) pairs in all: a chunk deep in a long prompt costs its tokens times
    # the context, so a fixed token budget alone lets a 32K document's late chunks stretch every
    # decode step (ITL). 0 turns the cap off. Default: 256 tokens at 1K of context.
    max_prefill_attention: int = 256 * 1024
    max_running: int = 256        # max admitted sequences (the batch)
    admission: AdmissionPolicy = "reserve"
    role: WorkerRole = "mixed"
    drr_quantum: int = 128        # tokens credited per unit of tenant weight per DRR round
    reject_late: bool = True      # reject queued requests predicted to clearly miss their TTFT target
    reject_late_factor: float = 2.0   # ... clearly: predicted TTFT over this many times the target
    interactive_class: str = "interactive"
    classes: tuple[TrafficClass, ...] = (INTERACTIVE, DOCUMENT, BATCH)
    tenants: tuple[Tenant, ...] = (Tenant("default"),)
    default_tenant: str = "default"

    def __post_init__(self) -> None:
        if self.token_budget < self.max_running:
            raise ValueError(f"token_budget ({self.token_budget}) must be >= max_running "
                             f"({self.max_running}) so every running decode fits in one iteration")
        if self.chunk_size < 1 or self.max_running < 1:
            raise ValueError("chunk_size and max_running must be >= 1")
        if not self.reject_late_factor >= 1.0:
            raise ValueError(f"reject_late_factor must be >= 1, got {self.reject_late_factor}")
        if self.max_prefill_attention < 0:
            raise ValueError("max_prefill_attention must be >= 0 (0 = no cap)")
        if self.admission not in ("reserve", "predict"):
            raise ValueError(f"unknown admission policy {self.admission!r} (reserve|predict)")
        if self.role not in ("mixed", "prefill", "decode"):
            raise ValueError(f"unknown role {self.role!r} (mixed|prefill|decode)")

    def traffic_class(self, name: str) -> TrafficClass | None:
        return next((c for c in self.classes if c.name == name), None)

    def tenant(self, name: str) -> Tenant | None:
        return next((t for t in self.tenants if t.name == name), None)


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine process needs. `model` is a local HF checkpoint dir or "tiny"."""

    model: str = "tiny"
    dtype: str = "auto"                 # auto | float32 | bfloat16 | float16
    block_size: int = 16
    num_blocks: int | None = None       # None: derived from kv_cache_mib
    kv_cache_mib: int = 512
    # The KV cache's element type (docs/engine.md, "KV cache dtype"): auto (the model's) | fp8
    # (e4m3: half of bf16's bytes, so twice the blocks in kv_cache_mib) | bfloat16 | float16 | float32
    kv_cache_dtype: str = "auto"
    # fp8 only: (k_scale, v_scale), one pair for the whole cache: stored = k / k_scale. Fixed for
    # the process; both ends of a KV transfer must use the same. 1.0 = vLLM's uncalibrated default.
    kv_cache_scales: tuple[float, float] = (1.0, 1.0)
    max_model_len: int | None = None    # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    seed: int = 0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # auto | torch | triton (kernels/): auto picks triton when the model is on CUDA, torch otherwise
    attention_backend: str = "auto"
    # ranks the model is sharded over (services/engine/tp_ranks.py): this process is rank 0 and
    # starts the other N - 1; heads, KV heads and MLP width must divide by it
    tensor_parallel_size: int = 1
    # Generated-token logprobs: "raw_logprobs" (log_softmax of the model's logits; vLLM's
    # default) or "processed_logprobs" (of the distribution sampled from: after min_tokens,
    # logit_bias, penalties, temperature, min_p, top-k / top-p), as vLLM's --logprobs-mode.
    logprobs_mode: LogprobsMode = "raw_logprobs"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r} ({'|'.join(KV_CACHE_DTYPES)})")
        if len(self.kv_cache_scales) != 2 or not all(0 < float(x) < float("inf") for x in self.kv_cache_scales):
            raise ValueError(f"kv_cache_scales must be two finite numbers > 0, got {self.kv_cache_scales!r}")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"unknown logprobs_mode {self.logprobs_mode!r} "
                             "(raw_logprobs|processed_logprobs)")
