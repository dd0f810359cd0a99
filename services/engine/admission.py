"""Admission arithmetic: how many KV blocks a request reserves, whether its tenant may take them,
and whether its predicted start already breaks its class TTFT target (DESIGN.md section 5).
Pure helpers, no state changes."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.engine.config import SchedulerConfig, Tenant
from services.engine.fairness import effective_priority
from services.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def bounded_output(req: Request, config: SchedulerConfig) -> int:
    """Output tokens the reservation must cover.

    reserve: min(max_tokens, class output cap), all of it up front, so decode never waits for pages.
    predict: the class's predicted length (at most that bound); grown on demand later.
    prefill role: 0, the first token needs no KV slot here; the decode worker reserves the rest.
    """
    if config.role == "prefill":
        return 0
    bound = min(req.params.max_tokens, req.traffic_class.output_cap)
    if config.admission == "predict":
        bound = min(bound, req.traffic_class.predicted_output_tokens)
    return max(bound - req.num_output_tokens, 0)


def blocks_to_reserve(req: Request, config: SchedulerConfig, block_size: int,
                      max_model_len: int) -> int:
    """Blocks covering every token the request holds plus its bounded output (never past the
    context limit, where the request finishes anyway)."""
    tokens = min(req.num_tokens + bounded_output(req, config), max_model_len)
    return cdiv(tokens, block_size)


def tenant_allows(tenant: Tenant, active_seqs: int, committed_blocks: int, new_blocks: int) -> bool:
    """Per-tenant caps on active sequences and reserved KV blocks (None = uncapped)."""
    if tenant.max_active_seqs is not None and active_seqs + 1 > tenant.max_active_seqs:
        return False
    if tenant.max_reserved_blocks is not None:
        return committed_blocks + new_blocks <= tenant.max_reserved_blocks
    return True


@dataclass
class RateEstimator:
    """Exponential moving average of prefill tokens per second of engine time."""

    alpha: float = 0.2
    min_samples: int = 3
    rate: float | None = None
    samples: int = 0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        r = tokens / seconds
        self.rate = r if self.rate is None else (1 - self.alpha) * self.rate + self.alpha * r
        self.samples += 1

    @property
    def ready(self) -> bool:
        return self.rate is not None and self.samples >= self.min_samples


def late_requests(queued: Iterable[Request], in_progress: Iterable[Request], rate: float,
                  now: float) -> list[tuple[Request, str]]:
    """Queued requests whose predicted start already breaks their class TTFT target.

    Predicted start = time waited + (prefill tokens ahead in scheduling order) / measured rate.
    "Ahead" = the uncomputed prompt tokens of admitted requests of the same or a higher class
    priority (prefill goes by priority, so a chat never waits behind an admitted document's
    prefill), plus queued requests that sort before this one by (effective priority desc, arrival
    asc). Requests that already produced tokens (preempted) are never rejected here.
    """
    def key(r: Request) -> tuple[float, float]:
        return (-effective_priority(r.traffic_class, now - r.arrival_time), r.arrival_time)

    admitted = [(r.traffic_class.priority, r.num_uncomputed_tokens) for r in in_progress]
    late: list[tuple[Request, str]] = []
    queued_ahead = 0
    for req in sorted(queued, key=key):
        ahead = queued_ahead + sum(n for p, n in admitted if p >= req.traffic_class.priority)
        waited = now - req.arrival_time
        start = waited + ahead / rate
        target = req.traffic_class.ttft_target_s
        if start > target and req.num_output_tokens == 0:
            late.append((req, (
                f"predicted time to first token start {start:.2f}s already exceeds the "
                f"{req.traffic_class.name} class target {target:.2f}s ({ahead} prefill tokens "
                f"queued ahead at {rate:.0f} tokens/s); retry later")))
            continue
        queued_ahead += req.num_uncomputed_tokens
    return late
