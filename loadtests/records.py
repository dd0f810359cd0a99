"""What one load-test run records: the typed boundary between the generator and the report.

The generator (`loadtests/runner.py`) fills one `RequestRecord` per planned request; the metrics and
the report (`loadtests/metrics.py`, `loadtests/report.py`) read a `RunResult` and nothing else, so a
run saved as JSON can be re-reported later (`RunResult.load`).

Times are seconds. `scheduled_s` and `send_s` count from the run's start (the moment the first
arrival is due); `ttft_s`, `itl_s` and `e2e_s` count from the request's own send.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ClassSLO:
    """A traffic class's targets. A request meets its SLO when it completed, its TTFT is at most
    `ttft_s` and the 99th percentile of its own inter-token gaps is at most `itl_s` (DESIGN.md
    section 2). `None` means no target on that axis (batch has no ITL target)."""
    name: str
    ttft_s: float | None
    itl_s: float | None


@dataclass
class RequestRecord:
    index: int                       # position in the planned request list (stable across seeded runs)
    traffic_class: str
    tenant: str
    scheduled_s: float               # planned arrival, from run start
    send_s: float | None = None      # when the request was actually sent, from run start
    prompt_tokens: int = 0           # as planned (the server's usage count when it reports one)
    max_tokens: int = 0
    ttft_s: float | None = None      # send -> first token event
    itl_s: list[float] = field(default_factory=list)   # every gap between successive token events
    e2e_s: float | None = None       # send -> end of stream
    output_tokens: int = 0           # token events received (the server's usage count if reported)
    status: int = 0                  # HTTP status; 0 = no response (connection failed, timeout)
    error: str | None = None         # None on success; else the reason: OpenAI error type/code,
                                     # "stream_error", "timeout", "connect", ...
    retry_after_s: float | None = None   # the Retry-After header of a 429/503, when sent
    detail: str | None = None        # the server's error message, cut to 300 characters
    finish_reason: str | None = None
    timing: dict[str, float] | None = None   # the server's per-request phase times, when it sends
                                             # them (kvfleet: queue_s prefill_s transfer_s decode_s
                                             # ttft_s e2e_s, wait_queue_s, in the final
                                             # chunk's `timing`)
    stage: str | None = None         # the overload stage the fleet decided it in (kvfleet's
                                     # x-kvfleet-stage header, refusals too); None: not said

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and self.ttft_s is not None


@dataclass
class RunResult:
    meta: dict                       # workload name, seed, endpoint, model, started_at, duration_s, ...
    classes: dict[str, ClassSLO]
    tenant_weights: dict[str, float]
    records: list[RequestRecord]

    def to_dict(self) -> dict:
        return {"meta": self.meta,
                "classes": {k: asdict(v) for k, v in self.classes.items()},
                "tenant_weights": self.tenant_weights,
                "records": [asdict(r) for r in self.records]}

    @classmethod
    def from_dict(cls, d: dict) -> "RunResult":
        return cls(meta=d["meta"],
                   classes={k: ClassSLO(**v) for k, v in d["classes"].items()},
                   tenant_weights=d["tenant_weights"],
                   records=[RequestRecord(**r) for r in d["records"]])

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "RunResult":
        return cls.from_dict(json.loads(Path(path).read_text()))
