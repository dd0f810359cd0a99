"""Builders for scheduler tests: a scheduler over a real BlockPool, requests, and one iteration
driven with chosen sampled tokens (no model: the scheduler only ever sees token ids)."""
from __future__ import annotations

import itertools

from services.engine.block_pool import BlockPool
from services.engine.config import SchedulerConfig, Tenant
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler, SchedulerOutput

EOS = 2
_ids = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(num_blocks: int = 256, block_size: int = 4, max_model_len: int = 4096,
                   prefix_caching: bool = True, **overrides) -> tuple[Scheduler, Clock]:
    overrides.setdefault("tenants", (Tenant("a"), Tenant("b"), Tenant("c")))
    overrides.setdefault("default_tenant", "a")
    overrides.setdefault("token_budget", 64)
    overrides.setdefault("chunk_size", 32)
    overrides.setdefault("max_running", min(32, overrides["token_budget"]))
    clock = Clock()
    sched = Scheduler(SchedulerConfig(**overrides), BlockPool(num_blocks, block_size),
                      max_model_len=max_model_len, enable_prefix_caching=prefix_caching,
                      clock=clock)
    return sched, clock


def make_request(sched: Scheduler, prompt_len: int = 10, *, tenant: str = "a",
                 cls: str = "interactive", max_tokens: int = 8, prompt: list[int] | None = None,
                 clock: Clock | None = None, **params) -> Request:
    tc = sched.config.traffic_class(cls)
    ids = prompt if prompt is not None else [100 + (i % 50) for i in range(prompt_len)]
    req = Request(f"r{next(_ids)}", tenant, tc, SamplingParams(max_tokens=max_tokens, **params),
                  list(ids), clock() if clock else 0.0, eos_token_ids=frozenset({EOS}))
    return req


def add(sched: Scheduler, *args, **kwargs) -> Request:
    req = make_request(sched, *args, **kwargs)
    sched.add(req)
    return req


def step(sched: Scheduler, token: int = 7, eos_for: set[str] = frozenset()) -> SchedulerOutput:
    """One iteration: schedule, then feed `token` (EOS for ids in eos_for) to every sampler row."""
    out = sched.schedule()
    sampled = [EOS if c.request.request_id in eos_for else token for c in out.chunks if c.sample]
    sched.update(out, sampled)
    return out


def run_until_idle(sched: Scheduler, limit: int = 10_000) -> int:
    for i in range(limit):
        if not sched.has_work:
            return i
        step(sched)
    raise AssertionError("scheduler did not drain")
