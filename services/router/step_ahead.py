"""A prefill worker's scheduler stepped forward from what it publishes, to price a new prompt's
wait and prefill as the engine will run them (services/engine/scheduler.py, steps 2-3).

Each step the prefill part of the token budget goes to the classes by priority (a capped class
takes at most its share while interactive work waits), to the tenants of a class by weighted
deficit round-robin (services/engine/fairness.py, the engine's own code), and within a tenant
first come first served, each prompt at most `chunk_size` tokens a step. So a prompt of 512-2,047
tokens behind other tenants' work takes more steps than its chunks, and every step carries the
chunks of the prompts beside it, each step priced through the worker's fitted cost.

What it reads: `prefill_queues[].prompts` (each queued prompt's tokens not yet computed, in its
tenant's order), `token_budget`, `chunk_size`, the fitted step cost, and the prompts expected to
arrive meanwhile (`prefill_tokens_per_wall_s`): while the step in flight ends, `joining` of them
(the caller's share), and during each later step all of them, as one more tenant of the new
prompt's class. What it cannot know: the DRR ring's position and deficits (taken as fresh, in the
published order), other prompts' cached positions (their chunks attend from their computed part
as stepped here), the classes' aging. A co-located replica's steps (decodes first, the attention
cap) are not modelled here.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from services.engine.config import BATCH, DOCUMENT, INTERACTIVE, SchedulerConfig, TrafficClass
from services.engine.fairness import DeficitRoundRobin, capped_base, class_budget
from services.engine.scheduler import attention_pairs
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb

CLASSES = (INTERACTIVE, DOCUMENT, BATCH)
# The engine's DRR quantum (it does not publish it): tokens a tenant of weight 1 takes a turn.
DRR_QUANTUM = SchedulerConfig().drr_quantum
# Steps stepped one by one; past them the new prompt's remaining tokens go at the last step's pace
# (a long document's hundreds of steps alike).
MAX_STEPS = 64
ARRIVING = "\x00arriving"     # the tenant the expected arrivals are queued as (no real name)


@dataclass(frozen=True, slots=True)
class Ahead:
    """The new prompt's time on the worker, from the end of the step in flight."""

    wait_s: float       # until the step that takes its first chunk begins
    prefill_s: float    # that step's start to the end of the step that takes its last token


@dataclass(slots=True)
class _Prompt:
    left: int           # tokens not yet computed
    done: int = 0       # tokens computed (as stepped here; the new prompt starts at its cache)


def published_queues(w: pb.WorkerStats) -> dict[str, dict[str, deque[_Prompt]]] | None:
    """class -> tenant -> queued prompts, from `w`; None when `w` lists no prompts for a tenant
    with queued tokens or not all its queued tokens by tenant (an older build): it cannot be
    stepped."""
    if sum(q.tokens for q in w.prefill_queues) < w.queued_prefill_tokens:
        return None
    queues: dict[str, dict[str, deque[_Prompt]]] = {}
    for q in w.prefill_queues:
        if q.tokens and not q.prompts:
            return None
        prompts = deque(_Prompt(int(n)) for n in q.prompts if n > 0)
        unlisted = int(q.tokens) - sum(q.prompts)          # past the published ones
        if unlisted > 0:
            prompts.append(_Prompt(unlisted))
        queues.setdefault(q.traffic_class, {})[q.tenant] = prompts
    return queues


def step_ahead(w: pb.WorkerStats, tokens: int, cached: int, traffic_class: str, tenant: str,
               weights: Mapping[str, float], in_flight_s: float, joining: float,
               classes: Sequence[TrafficClass] = CLASSES) -> Ahead | None:
    """Step `w`'s scheduler forward with a new prompt of `tokens` uncached tokens (after
    `cached`) queued last in `tenant`'s queue of `traffic_class`, from the end of the step in
    flight (`in_flight_s` from now); `joining` of the prompt tokens expected to arrive (at
    `prefill_tokens_per_wall_s`) join each step: those arriving while the step before it runs.
    None when `w` cannot be stepped (no prompts published, no token budget, an unknown class)."""
    steps = stepped(w, tokens, cached, traffic_class, tenant, weights, in_flight_s, joining,
                    classes)
    if steps is None:
        return None
    t, started, own, seconds = 0.0, None, 0, 0.0
    for own, seconds, left in steps:
        if own and started is None:
            started = t
        t += seconds
        if left <= 0:
            return Ahead(started, t - started)
    # past MAX_STEPS: the rest in steps like the last one (a full one if it has not started)
    chunk = w.chunk_size or w.token_budget
    if not own:
        own, seconds = min(left, chunk), _cost(w, w.token_budget, 0)
    started = t if started is None else started
    return Ahead(started, t - started + -(-left // own) * seconds)


def stepped(w: pb.WorkerStats, tokens: int, cached: int, traffic_class: str, tenant: str,
            weights: Mapping[str, float], in_flight_s: float, joining: float,
            classes: Sequence[TrafficClass] = CLASSES) -> Iterator[tuple[int, float, int]] | None:
    """The steps `step_ahead` takes, at most MAX_STEPS, each as (the new prompt's tokens in it,
    the step's seconds, the new prompt's tokens left after it), up to the one that ends it; None
    when `w` cannot be stepped."""
    by_name = {c.name: c for c in classes}
    queues = published_queues(w)
    if queues is None or not w.token_budget or traffic_class not in by_name or tokens <= 0:
        return None
    if any(c not in by_name for c in queues):
        return None
    mine = _Prompt(tokens, cached)
    queues.setdefault(traffic_class, {}).setdefault(tenant, deque()).append(mine)
    return _steps(w, queues, mine, traffic_class, by_name, {**weights, ARRIVING: 1.0},
                  in_flight_s, joining)


def _steps(w, queues, mine, traffic_class, by_name, weights, in_flight_s, joining):
    drr = {c: DeficitRoundRobin(DRR_QUANTUM) for c in by_name}
    rate, chunk = w.prefill_tokens_per_wall_s, w.chunk_size or w.token_budget
    arriving = round(joining * rate * max(0.0, in_flight_s))
    for _ in range(MAX_STEPS):
        _arrive(queues[traffic_class], arriving, chunk)
        chunks = _step(queues, by_name, drr, weights, w.token_budget, chunk)
        seconds = _cost(w, sum(n for n, _ in chunks.values()),
                        sum(p for _, p in chunks.values()))
        yield chunks.get(id(mine), (0, 0))[0], seconds, mine.left
        if mine.left <= 0:
            return
        arriving = round(joining * rate * seconds)


def _arrive(queues: dict[str, deque[_Prompt]], tokens: int, chunk_size: int) -> None:
    """`tokens` expected to arrive join as prompts of a chunk each (their lengths unknown: a
    flood of them fills the budget)."""
    line = queues.setdefault(ARRIVING, deque())
    while tokens > 0:
        line.append(_Prompt(min(tokens, chunk_size)))
        tokens -= chunk_size


def _cost(w: pb.WorkerStats, tokens: int, pairs: int) -> float:
    return w.prefill_step_s + w.prefill_s_per_token * tokens + w.prefill_s_per_pair * pairs


def _step(queues, by_name, drr, weights, budget: int,
          chunk_size: int) -> dict[int, tuple[int, int]]:
    """One step of the scheduler's prefill part: id(prompt) -> (tokens, attention pairs) of its
    chunk; the prompts advance and finished ones leave their queues."""
    chunks: dict[int, tuple[int, int]] = {}
    given: dict[int, tuple[_Prompt, int]] = {}
    interactive_waits = any(queues.get(INTERACTIVE.name, {}).values())
    order = sorted((c for c in queues if any(queues[c].values())),
                   key=lambda c: -by_name[c].priority)
    total = capped_base("prefill", budget, chunk_size)      # the base of a capped class's share
    for name in order:
        if budget <= 0:
            break
        cls = by_name[name]
        capped = interactive_waits and name != INTERACTIVE.name
        allowed = class_budget(cls, budget, total, capped)
        with_work = {t: weights.get(t, 1.0) for t, q in queues[name].items() if q}

        def take(tenant: str, n: int, q=queues[name]) -> int:
            return _take(q[tenant], n, chunk_size, given)

        budget -= drr[name].serve(with_work, allowed, take)
    for prompt, n in given.values():
        chunks[id(prompt)] = (n, attention_pairs(prompt.done, n))
        prompt.done += n
        prompt.left -= n
    for qs in queues.values():
        for q in qs.values():
            while q and q[0].left <= 0:
                q.popleft()
    return chunks


def _take(queue: deque[_Prompt], max_tokens: int, chunk_size: int,
          given: dict[int, tuple[_Prompt, int]]) -> int:
    """The engine's `_take` without KV or attention limits: FCFS, a prompt given a chunk in an
    earlier turn of this step has it extended, each at most `chunk_size`."""
    used = 0
    for prompt in queue:
        if used >= max_tokens:
            break
        have = given.get(id(prompt), (prompt, 0))[1]
        n = min(prompt.left - have, chunk_size - have, max_tokens - used)
        if n <= 0:
            continue
        given[id(prompt)] = (prompt, have + n)
        used += n
    return used
