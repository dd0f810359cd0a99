"""A worker's frozen config: who it is, its role, its KV backend, and the fleet's timeouts."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.protocol.timeouts import Timeouts

ROLES = ("prefill", "decode", "mixed")
POOLS = ("primary", "fallback")        # the fallback pool serves a smaller or quantized model


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    role: str                          # prefill | decode | mixed
    kv_backend: str = "tcp"            # nixl | tcp | local
    timeouts: Timeouts = field(default_factory=Timeouts)
    tensor_parallel_size: int = 1      # the engine core is rank 0 and starts the other N - 1
    pool: str = "primary"              # primary | fallback (the router never mixes them in a plan)
    quality_version: str = ""          # services/engine/quality_version.py

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} is not one of {ROLES}")
        if self.pool not in POOLS:
            raise ValueError(f"pool {self.pool!r} is not one of {POOLS}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor parallel size must be >= 1, got {self.tensor_parallel_size}")
        self.timeouts.check()
