"""A prefill worker's scheduler stepped forward from what it publishes, to price a new prompt's
wait and prefill as the engine will run them (services/engine/scheduler.py, steps 2-3).

Each step the prefill part of the token budget goes to the classes by priority (a capped class
takes at most its share while interactive work waits), to the tenants of a class by weighted
deficit round-robin (services/engine/fairness.py, the engine's own code), and within a tenant
first come first served, each prompt at most `chunk_size` tokens a step. So a prompt of 512-2,047
tokens behind other tenants' work takes more steps than its chunks, and every step carries the
chunks of the prompts beside it, each step priced through the worker's fitted cost.

What it reads: `prefill_queues[].prompts` (each queued prompt's tokens not yet computed, in its
tenant's order) and `.computed` (where each one's next chunk starts: a document half prefilled
attends deep, which the attention cap and the step's cost count; 0 from an older build),
`token_budget`, `chunk_size`, the fitted step cost, and the prompts expected to arrive meanwhile
(`prefill_tokens_per_wall_s`): while the step in flight ends, `joining` of them (the caller's
share), and during each later step all of them, as one more tenant of the new prompt's class.
What it cannot know: the DRR ring's position and deficits (taken as fresh, in the published
order), the classes' aging.

A prompt of a class below the top one (a document) is stepped with the prompts of the classes
above it expected to arrive during it, when the worker publishes its throughput by class
(`prefill_tokens_per_wall_s_by_class`): `joining` of those arriving while the step in flight
ends, then all of those arriving during each step (a document's prefill spans hundreds of steps:
the mean arrival is what they add up to), queued as one more tenant of their class, so they go
first in every step they wait in and the document keeps only its class's share while they wait
(its own class's arrivals queue behind it or share its class's turns; they are not counted),
as whole prompts of their class's mean length (`prefill_prompts_per_wall_s_by_class`: a chat
every few steps leaves the steps between to the document, where a trickle of a few tokens in
every step would cap it in all of them). It is stepped for up to LONG_MAX_STEPS steps or
`LONG_HORIZON` of its class's target; past them the tokens of its class still ahead of it and
its own go at the pace its class had over the last steps stepped. Without the throughput by
class (an older worker), as a chat: the expected arrivals join as its own class.

On a co-located (mixed) replica every step first decodes its batch (`num_decoding` sequences
over `decode_context_tokens`, taken as published: the sequences that finish or join meanwhile
are not stepped): the prompts share what the batch leaves of the budget, their chunks attend over
at most `max_prefill_attention` pairs while it decodes (a capped class at its share of them; the
class's first chunk at least MIN_CHUNK tokens, a prompt that fits less waits whole, as the
engine's `_take`), and each step's cost carries the batch (its tokens, its context as pairs).
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from services.engine.config import BATCH, DOCUMENT, INTERACTIVE, SchedulerConfig, TrafficClass
from services.engine.fairness import DeficitRoundRobin, capped_base, class_budget
from services.engine.scheduler import MIN_CHUNK, attention_pairs
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb

CLASSES = (INTERACTIVE, DOCUMENT, BATCH)
# The engine's DRR quantum (it does not publish it): tokens a tenant of weight 1 takes a turn.
DRR_QUANTUM = SchedulerConfig().drr_quantum
# Steps stepped one by one; past them the new prompt's remaining tokens go at the last step's pace
# (a long document's hundreds of steps alike).
MAX_STEPS = 64
# A lower class (a document) is stepped further: its prefill spans hundreds of steps, and so
# may the documents ahead of it. At most this many steps, or this many of its class's TTFT
# target of stepped time (past it the prediction only has to say it misses).
LONG_MAX_STEPS = 2048
LONG_HORIZON = 1.5
# The steps whose class progress paces the rest, past the stepped ones.
PACE_STEPS = 32
# The wait and prefill of a prompt whose class got nothing in those steps (starved by the
# classes above it): never, as a number any stepped or paced prediction stays under.
STARVED_S = 1e9
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
        done = list(q.computed) if len(q.computed) == len(q.prompts) else [0] * len(q.prompts)
        prompts = deque(_Prompt(int(n), int(d)) for n, d in zip(q.prompts, done) if n > 0)
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
    `prefill_tokens_per_wall_s`) join each step: those arriving while the step before it runs
    (for a lower class, the higher classes' arrivals: the module docstring).
    None when `w` cannot be stepped (no prompts published, no token budget, an unknown class)."""
    run = _Run()
    steps = stepped(w, tokens, cached, traffic_class, tenant, weights, in_flight_s, joining,
                    classes, run)
    if steps is None:
        return None
    t, started, own, seconds = 0.0, None, 0, 0.0
    for own, seconds, left in steps:
        if own and started is None:
            started = t
        t += seconds
        if left <= 0:
            return Ahead(started, t - started)
    if run.paced:
        return _paced(run, t, started, left)
    # past MAX_STEPS: the rest in steps like the last one (a full one if it has not started),
    # the others' part of it alike in each, its own chunks each at their depth (a long
    # document's later chunks attend over more: priced at the last one's, it came out short)
    done = cached + tokens - left
    if own:
        others = seconds - _own_s(w, done - own, own)
    else:
        own = min(left, w.chunk_size or w.token_budget)
        others = _cost(w, w.token_budget - own, decode_batch(w)[1])
    started = t if started is None else started
    return Ahead(started, t - started + -(-left // own) * others + _own_s(w, done, left))


@dataclass(slots=True)
class _Run:
    """What a lower class's stepping leaves for the rest past its last step: its class's tokens
    and seconds over the last PACE_STEPS steps, and its tokens still queued ahead of the prompt."""

    paced: bool = False
    recent: deque | None = None     # (class tokens, seconds) of the last steps
    ahead: int = 0                  # its class's tokens still ahead of the new prompt

    def pace(self) -> float:
        """Tokens of the class a second over the recent steps (0 when it got none)."""
        tokens = sum(n for n, _ in self.recent)
        seconds = sum(s for _, s in self.recent)
        return tokens / seconds if seconds > 0 else 0.0


def _paced(run: _Run, t: float, started: float | None, left: int) -> Ahead:
    """Past a lower class's stepping: what is still ahead of the prompt in its class, then its
    own tokens left, at the pace its class had over the last steps (a class starved by those
    above it: STARVED_S, never)."""
    pace = run.pace()
    if pace <= 0:
        return Ahead(STARVED_S, STARVED_S)
    if started is None:
        return Ahead(t + run.ahead / pace, left / pace)
    return Ahead(started, t - started + left / pace)


def _own_s(w: pb.WorkerStats, start: int, tokens: int) -> float:
    """The part of steps' cost that `tokens` of one prompt from position `start` make."""
    return w.prefill_s_per_token * tokens + w.prefill_s_per_pair * attention_pairs(start, tokens)


def stepped(w: pb.WorkerStats, tokens: int, cached: int, traffic_class: str, tenant: str,
            weights: Mapping[str, float], in_flight_s: float, joining: float,
            classes: Sequence[TrafficClass] = CLASSES,
            run: _Run | None = None) -> Iterator[tuple[int, float, int]] | None:
    """The steps `step_ahead` takes, at most MAX_STEPS (a lower class's: LONG_MAX_STEPS or its
    horizon, noting in `run` what paces the rest), each as (the new prompt's tokens in it, the
    step's seconds, the new prompt's tokens left after it), up to the one that ends it; None
    when `w` cannot be stepped."""
    by_name = {c.name: c for c in classes}
    queues = published_queues(w)
    if queues is None or traffic_class not in by_name or tokens <= 0:
        return None
    if w.token_budget - decode_batch(w)[0] <= 0:      # no budget, or a full batch: not stepped
        return None
    if any(c not in by_name for c in queues):
        return None
    mine = _Prompt(tokens, cached)
    queues.setdefault(traffic_class, {}).setdefault(tenant, deque()).append(mine)
    return _steps(w, queues, mine, traffic_class, by_name, {**weights, ARRIVING: 1.0},
                  in_flight_s, joining, run if run is not None else _Run())


def arrival_rates(w: pb.WorkerStats, traffic_class: str,
                  by_name: Mapping[str, TrafficClass]) -> tuple[dict[str, float], bool]:
    """The prompt tokens a second expected to arrive on `w` that a new prompt of
    `traffic_class` meets, by the class they join, and whether they are the higher classes'
    (a lower class's prompt on a worker that publishes its throughput by class): else all of
    them, as its own class."""
    by_class = w.prefill_tokens_per_wall_s_by_class
    mine = by_name[traffic_class]
    if by_class and any(c.priority > mine.priority for c in by_name.values()):
        return {c: r for c, r in by_class.items()
                if c in by_name and by_name[c].priority > mine.priority and r > 0}, True
    return {traffic_class: w.prefill_tokens_per_wall_s}, False


def mean_prompt(w: pb.WorkerStats, traffic_class: str) -> int:
    """A class's mean prompt tokens as `w` prefilled them recently (its tokens over its prompts a
    second); 0 when it does not say."""
    prompts = w.prefill_prompts_per_wall_s_by_class.get(traffic_class, 0.0)
    tokens = w.prefill_tokens_per_wall_s_by_class.get(traffic_class, 0.0)
    return max(1, round(tokens / prompts)) if prompts > 0 and tokens > 0 else 0


class _Arrivals:
    """The higher classes' prompts expected to arrive, each class at its rate: whole prompts of
    its mean length, one as soon as that many tokens are due (a class whose mean is unknown:
    what is due each step, in chunks)."""

    def __init__(self, w: pb.WorkerStats, rates: Mapping[str, float], chunk: int) -> None:
        self.rates, self.chunk = rates, chunk
        self.size = {c: mean_prompt(w, c) for c in rates}
        self.due = dict.fromkeys(rates, 0.0)

    def add(self, queues, seconds: float, factor: float) -> None:
        for name, rate in self.rates.items():
            line = queues.setdefault(name, {}).setdefault(ARRIVING, deque())
            size = self.size[name]
            if not size:
                _arrive(queues[name], round(factor * rate * seconds), self.chunk)
                continue
            self.due[name] += factor * rate * seconds
            while self.due[name] >= size:
                line.append(_Prompt(size))
                self.due[name] -= size


def _steps(w, queues, mine, traffic_class, by_name, weights, in_flight_s, joining, run):
    drr = {c: DeficitRoundRobin(DRR_QUANTUM) for c in by_name}
    chunk = w.chunk_size or w.token_budget
    rates, above = arrival_rates(w, traffic_class, by_name)
    decodes, context = decode_batch(w)
    shape = _Shape(w.token_budget - decodes, chunk,
                   capped_base(w.role, w.token_budget, chunk),
                   w.max_prefill_attention if decodes else 0)
    lower = any(c.priority > by_name[traffic_class].priority for c in by_name.values())
    most, horizon = MAX_STEPS, math.inf
    if lower and above:
        most, horizon = LONG_MAX_STEPS, LONG_HORIZON * by_name[traffic_class].ttft_target_s
        run.recent = deque(maxlen=PACE_STEPS)
    arrivals = _Arrivals(w, rates if above else {}, chunk)
    factor, span, t = joining, max(0.0, in_flight_s), 0.0
    for _ in range(most):
        if above:
            arrivals.add(queues, span, factor)
        else:
            _arrive(queues[traffic_class], round(factor * rates[traffic_class] * span), chunk)
        before = _class_left(queues[traffic_class]) if run.recent is not None else 0
        chunks = _step(queues, by_name, drr, weights, shape)
        seconds = _cost(w, sum(n for n, _ in chunks.values()) + decodes,
                        sum(p for _, p in chunks.values()) + context)
        yield chunks.get(id(mine), (0, 0))[0], seconds, mine.left
        if mine.left <= 0:
            return
        t += seconds
        if run.recent is not None:
            run.recent.append((before - _class_left(queues[traffic_class]), seconds))
            if t > horizon:
                break
        factor, span = (1.0 if above else joining), seconds
    if run.recent is not None:
        run.paced = True
        run.ahead = _ahead_of(queues[traffic_class], mine)


def _class_left(tenants: Mapping[str, deque[_Prompt]]) -> int:
    """Tokens not yet computed of a class's queued prompts."""
    return sum(p.left for q in tenants.values() for p in q)


def _ahead_of(tenants: Mapping[str, deque[_Prompt]], mine: _Prompt) -> int:
    """A class's tokens the scheduler serves before `mine` has begun: those ahead of it in its
    tenant's queue, and the other tenants' (their DRR turns interleave; taken whole)."""
    out = 0
    for q in tenants.values():
        for p in q:
            if p is mine:
                break
            out += p.left
    return out


def decode_batch(w: pb.WorkerStats) -> tuple[int, int]:
    """(sequences, context tokens) a co-located (mixed) replica decodes in every step, before its
    prefill chunks (decodes first): its published decode batch, taken as it is; none elsewhere."""
    if w.role != "mixed":
        return 0, 0
    return w.num_decoding, w.decode_context_tokens


@dataclass(frozen=True, slots=True)
class _Shape:
    """What one step of the worker's scheduler gives to prefill."""

    budget: int         # prefill tokens: the token budget less the decode batch
    chunk: int          # at most this many tokens of one prompt
    capped_base: int    # the tokens a capped class's share is of (fairness.capped_base)
    attention: int      # while it decodes, the prefill chunks' (query, key) pairs (0: no cap)


def _arrive(queues: dict[str, deque[_Prompt]], tokens: int, chunk_size: int) -> None:
    """`tokens` expected to arrive join as prompts of a chunk each (their lengths unknown: a
    flood of them fills the budget)."""
    line = queues.setdefault(ARRIVING, deque())
    while tokens > 0:
        line.append(_Prompt(min(tokens, chunk_size)))
        tokens -= chunk_size


def _cost(w: pb.WorkerStats, tokens: int, pairs: int) -> float:
    return w.prefill_step_s + w.prefill_s_per_token * tokens + w.prefill_s_per_pair * pairs


def _step(queues, by_name, drr, weights, shape: _Shape) -> dict[int, tuple[int, int]]:
    """One step of the scheduler's prefill part: id(prompt) -> (tokens, attention pairs) of its
    chunk; the prompts advance and finished ones leave their queues."""
    chunks: dict[int, tuple[int, int]] = {}
    given: dict[int, tuple[_Prompt, int]] = {}
    budget = shape.budget
    pairs = _Pairs(shape.attention or math.inf)
    interactive_waits = any(queues.get(INTERACTIVE.name, {}).values())
    order = sorted((c for c in queues if any(queues[c].values())),
                   key=lambda c: -by_name[c].priority)
    for name in order:
        if budget <= 0:
            break
        cls = by_name[name]
        capped = interactive_waits and name != INTERACTIVE.name
        allowed = class_budget(cls, budget, shape.capped_base, capped)
        with_work = {t: weights.get(t, 1.0) for t, q in queues[name].items() if q}
        share = cls.share_while_interactive_waits if capped else 1.0
        pairs.share(share * shape.attention if shape.attention else math.inf)
        first = [True]       # the class's first chunk this step gets MIN_CHUNK at least

        def take(tenant: str, n: int, q=queues[name], first=first) -> int:
            return _take(q[tenant], n, shape.chunk, given, pairs, first)

        budget -= drr[name].serve(with_work, allowed, take)
        pairs.unshare()
    for prompt, n in given.values():
        chunks[id(prompt)] = (n, attention_pairs(prompt.done, n))
        prompt.done += n
        prompt.left -= n
    for qs in queues.values():
        for q in qs.values():
            while q and q[0].left <= 0:
                q.popleft()
    return chunks


class _Pairs:
    """The attention pairs a step's prefill chunks may still spend (the scheduler's
    `attention_left`), and a capped class's share of them (`_attention_share`)."""

    def __init__(self, left: float) -> None:
        self.left = left
        self._whole: float | None = None
        self._mine = 0.0

    def share(self, most: float) -> None:
        self._whole, self._mine = self.left, min(self.left, most)
        self.left = self._mine

    def unshare(self) -> None:
        if math.isinf(self._whole):          # no cap: nothing was counted
            self.left = self._whole
        else:
            self.left = self._whole - (self._mine - self.left)

    def fit(self, start: int, floor: bool) -> int:
        """The most tokens from position `start` whose attention fits (the engine's
        `_attention_fit`)."""
        if math.isinf(self.left):
            return 1 << 62
        b = start + 0.5
        n = int(math.sqrt(b * b + 2 * max(0.0, self.left)) - b)
        return max(n, MIN_CHUNK if floor else 0)


def _take(queue: deque[_Prompt], max_tokens: int, chunk_size: int,
          given: dict[int, tuple[_Prompt, int]], pairs: _Pairs, first: list[bool]) -> int:
    """The engine's `_take` without KV limits: FCFS, a prompt given a chunk in an earlier turn
    of this step has it extended, each at most `chunk_size` and within the attention pairs left
    (the class's first chunk at least MIN_CHUNK; a prompt that fits less waits whole)."""
    used = 0
    for prompt in queue:
        if used >= max_tokens:
            break
        have = given.get(id(prompt), (prompt, 0))[1]
        floor = not have and first[0]
        if not have and pairs.fit(prompt.done, floor) < min(prompt.left, MIN_CHUNK):
            break
        n = min(prompt.left - have, chunk_size - have, max_tokens - used)
        n = min(n, pairs.fit(prompt.done + have, floor))
        if n <= 0:
            continue
        pairs.left -= attention_pairs(prompt.done + have, n)
        given[id(prompt)] = (prompt, have + n)
        first[0] = False
        used += n
    return used
