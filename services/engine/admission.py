"""Admission arithmetic: how many KV blocks a request reserves, whether its tenant may take them,
and whether its predicted start already breaks its class TTFT target (DESIGN.md section 5).
Pure helpers, no state changes."""
from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from services.engine.config import SchedulerConfig, Tenant
from services.engine.fairness import drr_others_ahead, effective_priority
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
    context limit, where the request finishes anyway), for each sample it will fork into."""
    tokens = min(req.num_tokens + bounded_output(req, config), max_model_len)
    return blocks_for_samples(req.num_prompt_tokens, tokens, samples_to_fork(req, config),
                              block_size)


def samples_to_fork(req: Request, config: SchedulerConfig) -> int:
    """n while the request has not sampled its first token (it forks then), else 1. A prefill
    worker never forks: the n first tokens travel with the KV and the decode worker forks."""
    if config.role == "prefill" or req.num_output_tokens > 0:
        return 1
    return max(1, req.params.n)


def blocks_for_samples(prompt_tokens: int, tokens_per_sample: int, n: int, block_size: int) -> int:
    """KV blocks for n samples of one prompt, each holding up to tokens_per_sample tokens: the
    prompt's full blocks once (shared, ref-counted), and per sample its own blocks (a copy of the
    partial last prompt block, and its output). n = 1: cdiv(tokens_per_sample, block_size).

        = prompt blocks + n x output blocks + (n - 1) copies of a partial last prompt block"""
    shared = prompt_tokens // block_size
    return shared + n * (cdiv(tokens_per_sample, block_size) - shared)


def sample_blocks(req: Request, config: SchedulerConfig, block_size: int,
                  max_model_len: int) -> int:
    """The blocks one forked sample takes of its request's reservation (before its first token):
    what blocks_for_samples counts per sample."""
    tokens = min(req.num_tokens + bounded_output(req, config), max_model_len)
    return cdiv(tokens, block_size) - req.num_prompt_tokens // block_size


def tenant_allows(tenant: Tenant, active_seqs: int, committed_blocks: int, new_blocks: int) -> bool:
    """Per-tenant caps on active sequences and reserved KV blocks (None = uncapped)."""
    if tenant.max_active_seqs is not None and active_seqs + 1 > tenant.max_active_seqs:
        return False
    if tenant.max_reserved_blocks is not None:
        return committed_blocks + new_blocks <= tenant.max_reserved_blocks
    return True


RECENT_STEPS = 32


@dataclass
class RateEstimator:
    """Tokens per second of engine time: an exponential moving average (`rate`, what stats and
    heartbeats report) and the best of the last RECENT_STEPS samples (`optimistic`, what late
    rejection uses: a step slowed by a neighbour on a shared core, a cold start or a small batch
    must not make a request look late that the engine would serve in time)."""

    alpha: float = 0.2
    min_samples: int = 3
    rate: float | None = None
    samples: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        r = tokens / seconds
        self.rate = r if self.rate is None else (1 - self.alpha) * self.rate + self.alpha * r
        self.samples += 1
        self.recent.append(r)

    @property
    def optimistic(self) -> float | None:
        return max(self.recent) if self.recent else None

    @property
    def ready(self) -> bool:
        return self.rate is not None and self.samples >= self.min_samples


@dataclass(frozen=True)
class LateRequest:
    """A queued request refused because it would clearly miss its TTFT target."""

    request: Request
    reason: str
    retry_after_s: float   # when the backlog ahead of it will have drained enough to meet it


def late_requests(queued: Iterable[Request], in_progress: Iterable[Request], rate: float,
                  now: float, weights: Mapping[str, float],
                  factor: float = 2.0,
                  interactive_class: str = "interactive") -> list[LateRequest]:
    """Queued requests that would clearly miss their class TTFT target: predicted TTFT over
    `factor` times the target. Conservative on purpose (docs/engine.md, "Late rejection"): the
    target is a p99 and the prediction is rough, so a request is refused only when even an
    optimistic `rate` (the best recent one) puts it far past the target, never on a near miss.

    Predicted TTFT = time waited + (prefill tokens ahead + its own) / rate, where "ahead" follows
    the scheduler's own order:
      - the uncomputed prompt tokens of admitted requests of the same or a higher class priority
        (prefill goes by priority, so a chat never waits behind an admitted document's prefill);
      - queued requests of other classes that sort before this one by (effective priority desc,
        arrival asc), except, for an interactive request, those of a capped class
        (`share_while_interactive_waits` < 1: an aged document): while interactive work waits they
        take at most their share of each step, the rest is the interactive class's;
      - within its class, weighted DRR: its own tenant's earlier requests, and of each other
        tenant u at most weight_u / weight_own times that (u's queue if smaller). A quiet
        tenant's first request is next in line however long a flooding tenant's queue is.
    Requests rejected in this pass no longer count. Requests that already produced tokens
    (preempted) are never rejected here.
    """
    def key(r: Request) -> tuple[float, float]:
        return (-effective_priority(r.traffic_class, now - r.arrival_time), r.arrival_time)

    order = sorted(queued, key=key)
    admitted: dict[int, int] = defaultdict(int)          # class priority -> uncomputed prompt tokens
    for r in in_progress:
        admitted[r.traffic_class.priority] += r.num_uncomputed_tokens
    queue: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))  # class -> tenant -> tokens
    for r in order:
        queue[r.traffic_class.name][r.tenant] += r.num_uncomputed_tokens
    own_before: dict[tuple[str, str], int] = defaultdict(int)     # accepted earlier, same tenant
    class_before: dict[str, int] = defaultdict(int)               # accepted earlier, per class
    capped = {r.traffic_class.name for r in order
              if r.traffic_class.share_while_interactive_waits < 1}
    late: list[LateRequest] = []
    for req in order:
        cls, tenant = req.traffic_class.name, req.tenant
        own = own_before[cls, tenant]
        others = drr_others_ahead(own, tenant, queue[cls], weights)
        ahead = (sum(n for p, n in admitted.items() if p >= req.traffic_class.priority)
                 + sum(n for c, n in class_before.items()
                      if c != cls and not (cls == interactive_class and c in capped))
                + own + int(others))
        waited = now - req.arrival_time
        ttft = waited + (ahead + req.num_uncomputed_tokens) / rate
        target = req.traffic_class.ttft_target_s
        if ttft > factor * target and req.num_output_tokens == 0:
            late.append(LateRequest(req, (
                f"predicted time to first token {ttft:.2f}s is over {factor:g}x the "
                f"{req.traffic_class.name} class target {target:.2f}s ({waited:.2f}s waited, "
                f"{ahead} prefill tokens queued ahead at up to {rate:.0f} tokens/s)"),
                retry_after_s=max(0.0, ahead / rate - target)))
            queue[cls][tenant] -= req.num_uncomputed_tokens
            continue
        own_before[cls, tenant] += req.num_uncomputed_tokens
        class_before[cls] += req.num_uncomputed_tokens
    return late
