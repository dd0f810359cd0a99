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
DEVICES = ("auto", "cpu", "cuda")                                        # --device
CPU_GEMMS = ("auto", "onednn", "torch")                                 # EngineConfig.cpu_gemm
CUDA_GRAPHS = ("auto", "on", "off")                                      # --cuda-graphs (auto: on CUDA)
# A worker's KV cache when nothing names one (--kv-cache-mib of kvfleet serve / up, the benches,
# the simulator): the one default, defined here.
KV_CACHE_MIB = 256


def parse_kv_cache_scales(text: str) -> tuple[float, float]:
    """--kv-cache-scales: "K,V" (k_scale, v_scale) or one number for both."""
    parts = [float(x) for x in text.split(",")]
    if len(parts) not in (1, 2):
        raise ValueError(f"--kv-cache-scales takes K,V or one number, got {text!r}")
    return (parts[0], parts[-1])


def add_device_arg(p: argparse.ArgumentParser, whose: str = "the engine's") -> None:
    """--device and --cuda-graphs: the one definition (add_engine_args, and the benches that take
    only these)."""
    p.add_argument("--device", default=None, choices=list(DEVICES),
                   help=f"where {whose} model, KV cache and sampling live: auto (default: cuda when "
                        "torch sees a GPU, else cpu) | cpu | cuda (refused at start without CUDA)")
    p.add_argument("--cuda-graphs", default=None, choices=["on", "off"],
                   help=f"{whose} decode steps padded to fixed batch sizes (1, 2, 4, ...) and "
                        "replayed as CUDA graphs (vLLM's pattern; off = its --enforce-eager). "
                        "Default: on when the device is CUDA, off otherwise; on off CUDA runs the "
                        "same padded steps eagerly")


def add_engine_args(p: argparse.ArgumentParser, whose: str = "the engine's") -> None:
    """--device, --attention-backend, --kv-cache-dtype, --kv-cache-scales, --logprobs-mode: one
    definition for `kvfleet generate`, `kvfleet serve` and `kvfleet up` (which passes them to its
    workers). Unset: the engine config's value."""
    add_device_arg(p, whose)
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
ENGINES = ("real", "sim")                                               # --engine


def add_sim_args(p: argparse.ArgumentParser) -> None:
    """--engine real|sim and the simulated core's --sim-* flags (docs/engine.md, "Simulated
    engine"): one definition for `kvfleet serve`, `kvfleet up` and the worker entry points."""
    g = p.add_argument_group("simulated engine core (--engine sim)")
    g.add_argument("--engine", default="real", choices=list(ENGINES),
                   help="real: the model runs (default); sim: the real scheduler and KV block pool "
                        "with deterministic tokens and step times of a target (no weights loaded)")
    g.add_argument("--sim-model", default=None, help="the target model of the cost model "
                   f"(default {SimConfig.target_model})")
    g.add_argument("--sim-gpu", default=None, help=f"the target GPU (default {SimConfig.gpu})")
    g.add_argument("--sim-tp", type=int, default=None,
                   help=f"the target's tensor-parallel degree (default {SimConfig.tp})")
    g.add_argument("--sim-dtype", default=None, help=f"the target's weights (default {SimConfig.dtype})")
    g.add_argument("--sim-kv-dtype", default=None, help="the target's KV cache (default: its dtype)")
    g.add_argument("--sim-profile", default=None, metavar="FILE",
                   help="step times from a measured profile (kvfleet sim calibrate) instead of "
                        "the target's cost model")
    g.add_argument("--sim-network-gbps", type=float, default=None, metavar="G",
                   help=f"KV transfer bandwidth, Gbit/s (default {SimConfig.network_gbps:g})")
    g.add_argument("--sim-output-len", default=None, metavar="SPEC",
                   help="output lengths without ignore_eos: lognormal:mean=M,sigma=S | "
                        f"geometric:mean=M | fixed:N (default {SimConfig.output_len})")
    g.add_argument("--sim-kv-tokens", type=int, default=None, metavar="N",
                   help="KV capacity in tokens (default: the target's, from the cost model)")
    g.add_argument("--sim-step-ms", type=float, default=None, metavar="MS",
                   help="every step takes MS (a fixed step time: no target, no profile)")


SIM_FLAGS = {"sim_model": "target_model", "sim_gpu": "gpu", "sim_tp": "tp", "sim_dtype": "dtype",
             "sim_kv_dtype": "kv_dtype", "sim_profile": "profile",
             "sim_network_gbps": "network_gbps", "sim_output_len": "output_len",
             "sim_kv_tokens": "kv_tokens"}


def sim_config_from_args(args: argparse.Namespace) -> SimConfig | None:
    """The SimConfig the flags of add_sim_args name; None for --engine real (or no flags)."""
    if getattr(args, "engine", "real") != "sim":
        return None
    given = {field_: getattr(args, flag) for flag, field_ in SIM_FLAGS.items()
             if getattr(args, flag, None) is not None}
    if getattr(args, "sim_step_ms", None) is not None:
        given["step_s"] = args.sim_step_ms / 1000.0
    return SimConfig(**given)


def sim_args(args: argparse.Namespace) -> list[str]:
    """The flags of add_sim_args that `args` sets, as a command line (kvfleet up -> workers)."""
    if getattr(args, "engine", "real") != "sim":
        return []
    out = ["--engine", "sim"]
    for flag in [*SIM_FLAGS, "sim_step_ms"]:
        if getattr(args, flag, None) is not None:
            out += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return out


def parse_output_len(spec: str) -> tuple[str, dict[str, float]]:
    """"lognormal:mean=200,sigma=0.8" -> ("lognormal", {"mean": 200.0, "sigma": 0.8}); raises
    ValueError naming the accepted forms."""
    forms = "lognormal:mean=M,sigma=S | geometric:mean=M | fixed:N"
    kind, _, rest = spec.partition(":")
    try:
        if kind == "fixed":
            params = {"n": float(int(rest))}
        else:
            params = {k.strip(): float(v) for k, v in (kv.split("=") for kv in rest.split(","))}
    except ValueError:
        raise ValueError(f"bad output length spec {spec!r} ({forms})") from None
    need = {"lognormal": {"mean", "sigma"}, "geometric": {"mean"}, "fixed": {"n"}}.get(kind)
    if need is None or set(params) != need:
        raise ValueError(f"bad output length spec {spec!r} ({forms})")
    if params.get("mean", 1.0) < 1.0 or params.get("n", 1.0) < 1.0 or params.get("sigma", 0.0) < 0:
        raise ValueError(f"output length spec {spec!r}: mean and N must be >= 1, sigma >= 0")
    return kind, params


@dataclass(frozen=True)
class SimConfig:
    """The simulated engine core (services/engine/sim_engine.py; docs/engine.md, "Simulated
    engine"): the real scheduler and block pool with deterministic tokens, each step as long as
    a StepTimer says for its batch on the target.

    Step times: `step_s` (a fixed time per step) if set, else the measured profile `profile`,
    else the cost model of the target (target_model, gpu, tp, dtype, kv_dtype). KV capacity:
    `kv_tokens` if set, else the target's. `output_len`: the seeded distribution of a request's
    output length when it does not ignore EOS (parse_output_len). `network_gbps`: the KV
    transfer's modelled bandwidth (Gbit/s) for the target's real KV bytes."""

    target_model: str = "llama-3-70b"
    gpu: str = "h200"
    tp: int = 4
    dtype: str = "fp8"
    kv_dtype: str | None = None
    profile: str | None = None
    network_gbps: float = 400.0
    output_len: str = "lognormal:mean=200,sigma=0.8"
    kv_tokens: int | None = None
    step_s: float | None = None

    def __post_init__(self) -> None:
        parse_output_len(self.output_len)
        if self.tp < 1:
            raise ValueError(f"sim tp must be >= 1, got {self.tp}")
        if not self.network_gbps > 0:
            raise ValueError(f"sim network_gbps must be > 0, got {self.network_gbps}")
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ValueError(f"sim kv_tokens must be >= 1, got {self.kv_tokens}")
        if self.step_s is not None and not self.step_s >= 0:
            raise ValueError(f"sim step_s must be >= 0, got {self.step_s}")


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
    critical: bool = False        # never degraded (primary pool), admitted into the headroom kept at every stage
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
    # Decode protection (docs/engine.md): a sequence joins the decode batch only while the
    # predicted step time stays within itl_headroom x the tightest ITL target in the batch
    protect_itl: bool = True
    itl_headroom: float = 0.9
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
        if not 0.0 < self.itl_headroom <= 1.0:
            raise ValueError(f"itl_headroom must be in (0, 1], got {self.itl_headroom}")
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


# A prefill worker runs no decodes, so its iterations protect no inter-token latency: its scheduler
# defaults to larger ones (bigger GEMMs, fewer steps for a burst of prompts). A config file's own
# token_budget / chunk_size win; a worker logs the budget it runs at start.
PREFILL_ROLE_DEFAULTS = dict(token_budget=2048, chunk_size=512)


def role_scheduler(role: WorkerRole) -> SchedulerConfig:
    """The scheduler a worker of `role` runs for every knob its config file does not set."""
    return SchedulerConfig(role=role, **(PREFILL_ROLE_DEFAULTS if role == "prefill" else {}))


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine process needs. `model` is a local HF checkpoint dir or "tiny"."""

    model: str = "tiny"
    dtype: str = "auto"                 # auto | float32 | bfloat16 | float16
    block_size: int = 16
    num_blocks: int | None = None       # None: derived from kv_cache_mib
    kv_cache_mib: int = KV_CACHE_MIB
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
    # auto | cpu | cuda (services/engine/device.py): the model, its KV cache and the sampler's
    # tensors live there; auto is cuda when torch sees a GPU
    device: str = "auto"
    # auto | on | off (services/engine/model/decode_graphs.py): decode-only steps padded to a
    # captured batch size and replayed as CUDA graphs; auto is on when the device is CUDA
    cuda_graphs: str = "auto"
    # auto | onednn | torch (services/engine/model/cpu_gemm.py): a CPU model's projections through
    # oneDNN with weights packed at start-up (auto: for bfloat16 only, where the bits are F.linear's;
    # onednn: float32 too, whose log-probs then move by ~1e-4) or plain F.linear (torch)
    cpu_gemm: str = "auto"
    # torch intra-op (OpenMP) threads of a CPU engine (services/engine/model/threads.py), set when
    # the model loads: 0 is vLLM's rule (one per physical core this process may use, less one
    # reserved for the front end; at least one: 1 on a 2-core host); N > 0 is exactly N
    torch_threads: int = 0
    # ranks the model is sharded over (services/engine/tp_ranks.py): this process is rank 0 and
    # starts the other N - 1; heads, KV heads and MLP width must divide by it
    tensor_parallel_size: int = 1
    # Generated-token logprobs: "raw_logprobs" (log_softmax of the model's logits; vLLM's
    # default) or "processed_logprobs" (of the distribution sampled from: after min_tokens,
    # logit_bias, penalties, temperature, min_p, top-k / top-p), as vLLM's --logprobs-mode.
    logprobs_mode: LogprobsMode = "raw_logprobs"
    # None: the real engine (the model runs). Set: the simulated core (services/engine/
    # sim_engine.py): same scheduler and KV accounting, no weights, tokens and step times modelled
    sim: SimConfig | None = None
    # False: outputs carry token ids and logprobs only (new_text ""), and stop strings are not
    # matched: the fleet's engine cores, whose text the gateway makes once
    # (services/gateway/output_processor.py). The tokenizer still names the EOS ids.
    detokenize: bool = True

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"unknown device {self.device!r} ({'|'.join(DEVICES)})")
        if self.cuda_graphs not in CUDA_GRAPHS:
            raise ValueError(f"unknown cuda_graphs {self.cuda_graphs!r} ({'|'.join(CUDA_GRAPHS)})")
        if self.cpu_gemm not in CPU_GEMMS:
            raise ValueError(f"unknown cpu_gemm {self.cpu_gemm!r} ({'|'.join(CPU_GEMMS)})")
        if self.torch_threads < 0:
            raise ValueError(f"torch_threads must be >= 0 (0: vLLM's rule), got {self.torch_threads}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r} ({'|'.join(KV_CACHE_DTYPES)})")
        if len(self.kv_cache_scales) != 2 or not all(0 < float(x) < float("inf") for x in self.kv_cache_scales):
            raise ValueError(f"kv_cache_scales must be two finite numbers > 0, got {self.kv_cache_scales!r}")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"unknown logprobs_mode {self.logprobs_mode!r} "
                             "(raw_logprobs|processed_logprobs)")
