"""A worker's frozen config: who it is, its role, its KV backend, the fleet's timeouts, its engine
and where it serves (build.py, build_worker)."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.config import EngineConfig
from services.protocol.timeouts import Timeouts

ROLES = ("prefill", "decode", "mixed")
POOLS = ("primary", "fallback")        # the fallback pool serves a smaller or quantized model
CPU_WARMUP_MARGIN = 2.0                # WorkerConfig.warmup_margin's default on the CPU


def warmup_margin(configured: float | None, kv_device: str) -> float:
    """The measured prior's margin (WorkerConfig.warmup_margin): as configured, else by where the
    engine computes."""
    if configured is not None:
        return configured
    return CPU_WARMUP_MARGIN if kv_device == "cpu" else 1.0


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    role: str                          # prefill | decode | mixed
    kv_backend: str = "tcp"            # nixl | tcp | local
    timeouts: Timeouts = field(default_factory=Timeouts)
    tensor_parallel_size: int = 1      # the engine core is rank 0 and starts the other N - 1
    pool: str = "primary"              # primary | fallback (the router never mixes them in a plan)
    quality_version: str = ""          # services/engine/quality_version.py
    # how the process serves (build.py); the defaults: loopback, free ports, no Redis, no /metrics
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    allow_external_bind: bool = False  # a non-loopback host (and /metrics beside it) only when opted in
    port: int = 0                      # gRPC; 0 picks a free port
    kv_port: int = 0                   # the tcp KV backend's receiver; 0 picks a free port
    redis_url: str | None = None       # heartbeat capacity here; None: not in a fleet's Redis
    metrics_port: int = -1             # Prometheus /metrics; 0 picks a free port, -1: none
    step_profile: str | None = None    # a measured step profile: the prefill cost prior (rates.py)
    torch_threads: int = 0             # the engine core's torch intra-op threads (0: torch's)
    # the real engine's warm-up profile at start (its measured cost prior, rates.py): at most
    # this long before the worker serves; past it the default prior. 0: no warm-up
    warmup_timeout_s: float = 30.0
    # the measured prior's times x this. None: CPU_WARMUP_MARGIN when the engine computes on the
    # CPU (a step measured alone at start ran ~2x slower in a burst on a host whose cores the
    # fleet's own processes share: docs/benchmarks.md, a11warm), 1 on an accelerator of its own
    warmup_margin: float | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} is not one of {ROLES}")
        if self.pool not in POOLS:
            raise ValueError(f"pool {self.pool!r} is not one of {POOLS}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor parallel size must be >= 1, got {self.tensor_parallel_size}")
        if not (0 <= self.port < 65536 and 0 <= self.kv_port < 65536
                and -1 <= self.metrics_port < 65536):
            raise ValueError(f"ports must be 0..65535 (metrics also -1: none); got port "
                             f"{self.port}, kv_port {self.kv_port}, metrics_port "
                             f"{self.metrics_port}")
        if not self.warmup_timeout_s >= 0:
            raise ValueError(f"warmup_timeout_s must be >= 0, got {self.warmup_timeout_s!r}")
        if self.warmup_margin is not None and not self.warmup_margin > 0:
            raise ValueError(f"warmup_margin must be > 0, got {self.warmup_margin!r}")
        self.timeouts.check()
