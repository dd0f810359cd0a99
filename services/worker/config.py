"""A worker's frozen config: who it is, its role, its KV backend, and the fleet's timeouts."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.protocol.timeouts import Timeouts

ROLES = ("prefill", "decode", "mixed")


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    role: str                          # prefill | decode | mixed
    kv_backend: str = "tcp"            # nixl | tcp | local
    timeouts: Timeouts = field(default_factory=Timeouts)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} is not one of {ROLES}")
        self.timeouts.check()
