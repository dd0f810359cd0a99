"""What a worker measures of itself for the router's TTFT prediction (DESIGN.md section 3, router),
published in its stats heartbeat (WorkerStats):

  prefill cost    step seconds = step_s + s_per_token x tokens + s_per_pair x attention pairs,
                  fitted online (`CostFit`: least squares with a forgetting factor) on the
                  steps that ran prefill, started from a `Prior` whose pairs-to-token cost ratio
                  holds until deep steps pin the pair cost; tokens and pairs count the
                  step's decodes too (a decode token goes through the same layers and attends over
                  its context), so a mixed worker's fit prices its decode share
  drain rate      prefill tokens computed per busy second: the steps that ran prefill, whole
                  (decode share included), plus the gaps before them while work waited. It is how
                  fast a burst's queue really drains, which is what the wait term needs. Until
                  measured: the prior's rate at a full token budget
  recent step     the mean duration of its last RECENT_STEPS steps that ran prefill: what a
                  prompt's own step costs while others share it
  both at depth 0 a step's time in these two is what it would have taken had its prefill chunks
                  started at position 0 (`fresh_pairs`): its measured time x the fit's
                  step(tokens, fresh pairs) / step(tokens, pairs). A document's chunks 8K tokens
                  deep cost ~3x a chat's per token (attention); kept as measured, a document
                  burst's steps priced the next burst's chats 2-5x too slow (docs/benchmarks.md,
                  "the real CPU fleet's bursts"). The router adds a prompt's own depth through the
                  fit, where it knows it
  KV bandwidth    prefill: bytes / seconds of its recent KV writes
  decode drain    decode / mixed: sequences finished per second and the KV blocks they freed
  fit ratio       the fit's price of each of its last RECENT_STEPS prefill steps (before it
                  learnt from it) over its measured time, their mean: far above 1 while the fit
                  still prices as a pessimistic prior (the router probes such a worker)
  step in flight  when the last step ended and its length: the next began as it ended while work
                  waits (none is published while the engine is idle)
  throughput      prompt tokens prefilled per wall second over THROUGHPUT_SPAN_S: under a steady
                  load the rate they arrive, so the router expects some to join the next step;
                  and by class, when the caller of `on_step` says (a long prompt is priced with
                  the higher classes' arrivals during its prefill)

The rates are over a sliding window of recent events (`Window`), so they follow load changes and
forget an idle spell's last burst no faster than the window.

Priors (services/worker/build.py `_prior`), in order:
  1. a measured step profile file (`--step-profile`: services/planner/profile.py's StepProfile);
  2. a simulated engine core: its own step timer (the capacity model's roofline for its target,
     a profile, or a fixed step), which needs no warm-up;
  3. a real engine: the warm-up profile its core measured at start, before the worker serves
     (services/engine/warmup.py: a few prefill steps at chosen sizes and depths and decode
     batches on dummy blocks, within WorkerConfig.warmup_timeout_s), fitted by
     `prior_from_steps`, its times x WorkerConfig.warmup_margin (on the CPU 2: a burst's steps ran ~2x
     slower than the same steps alone at start on the 2-core CPU fleet, whose own processes
     then share the cores; 1 on an accelerator): source `measured-at-start: ...`. The box's pace now, under
     whatever load it has, not a constant measured once (docs/benchmarks.md, "a11warm");
  4. else (no warm-up, or it failed, timed out or measured too little; the worker logs why and
     the source says it) `default_prior` by model size: figures derived from docs/benchmarks.md's
     in-process engine measurements on this 2-core CPU, made ~1.5x slower so that a cold fleet
     errs towards refusing rather than admitting blindly.
`prior_for` gives 1, a capacity model's roofline, or 4, for a caller without an engine core.
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from services.engine.scheduler import attention_pairs


@dataclass(frozen=True, slots=True)
class Prior:
    """Step-time coefficients assumed before a worker has measured its own, and their source."""

    step_s: float
    s_per_token: float
    s_per_pair: float
    source: str

    def step_time(self, tokens: int, pairs: int) -> float:
        return self.step_s + self.s_per_token * tokens + self.s_per_pair * pairs

    def scaled(self, factor: float) -> Prior:
        """Every time x factor (a margin), the source unchanged."""
        return Prior(self.step_s * factor, self.s_per_token * factor, self.s_per_pair * factor,
                     self.source)

    def drain_rate(self, budget: int, chunk: int) -> float:
        """Prefill tokens/s of back-to-back full-budget steps, each of budget / chunk prompts'
        first chunks (a burst of short prompts)."""
        chunk = max(1, min(chunk, budget))
        pairs = budget // chunk * attention_pairs(0, chunk)
        return budget / self.step_time(budget, pairs)


# docs/benchmarks.md, "Engine, in process" (2-core CPU, fp32), made ~1.5x slower. The tiny model
# (2,048 KV bytes a token): batch-1 decode step 2.4 ms, +0.09 ms a token at batch 32, a 4,096-token
# prefill in 512-token chunks at 7,413 tok/s; the fleet achieved 3.7-4.1K tok/s in bursts. A pair
# costs 0.7-1.1e-3 of a token (loadtests/attention_ratio.py: 8K prompts' 512-token chunks and
# 200-token chats' steps, docs/benchmarks.md, "a9doc"); the prior takes the top of it, and the
# CostFit keeps that ratio until deep steps are measured. SmolLM2-135M (46,080 KV bytes a token): batch-1 step 78.5 ms, +4.1 ms a
# decode token, prefill 236 tok/s (4.2 ms a token).
TINY = Prior(3.6e-3, 1.5e-4, 1.6e-7, "default:torch-cpu tiny (docs/benchmarks.md, x1.5)")
SMOLLM2 = Prior(0.12, 6.3e-3, 1e-6, "default:torch-cpu smollm2-135m (docs/benchmarks.md, x1.5)")
SMOLLM2_KV_BYTES = 46080


def default_prior(kv_bytes_per_token: int) -> Prior:
    """The real engine on this CPU, by model size (its KV bytes a token stand for it): the tiny
    model's measured costs up to its size, past it SmolLM2's, scaled by KV bytes a token (never
    below the tiny model's)."""
    if kv_bytes_per_token <= 2 * 2048:
        return TINY
    f = kv_bytes_per_token / SMOLLM2_KV_BYTES
    return Prior(max(TINY.step_s, SMOLLM2.step_s * f), max(TINY.s_per_token, SMOLLM2.s_per_token * f),
                 max(TINY.s_per_pair, SMOLLM2.s_per_pair * f),
                 f"default:torch-cpu, SmolLM2-135M's costs x{f:.2g} (its KV bytes a token; "
                 "docs/benchmarks.md, x1.5)")


def prior_from_timer(timer, source: str, budget: int = 512) -> Prior:
    """A prior fitted to any step timer with `step_s(BatchShape)` (the capacity model's CostModel,
    a measured StepProfile) over a grid of prefill chunks, least squares on the three terms."""
    from services.planner.step_time import BatchShape  # noqa: PLC0415 - planner only when used
    rows, times = [], []
    for n in (budget // 8, budget // 4, budget // 2, budget):
        for cached in (0, budget, 4 * budget):
            rows.append((1.0, n, attention_pairs(cached, n)))
            times.append(timer.step_s(BatchShape(prefill_chunks=((n, cached),))))
    coef, *_ = np.linalg.lstsq(np.array(rows, float), np.array(times), rcond=None)
    a, b, c = (max(0.0, float(x)) for x in coef)
    return Prior(a, b, c, source)


MIN_MEASURED_STEPS = 3   # warm-up steps, of at least two token counts, a measured prior needs


def prior_from_steps(steps, source: str) -> Prior | None:
    """A prior fitted to steps the engine measured itself (services/engine/warmup.py: each with
    `prefill_tokens`, `decode_tokens`, `pairs` and `seconds`): step seconds on (1, tokens,
    pairs), the same three terms as `prior_from_timer`, over the steps that ran prefill (their
    decodes counted), as `CostFit` learns: a decode-only step's token costs ~5x a prefill
    token's on this CPU (tiny and SmolLM2 alike: per-sequence attention), and would price
    prompts by it. Least squares relative to each step's time (a 64-token step's error counts
    as much as a 2,048-token one's), each coefficient >= 0 (the best fit over the terms kept
    when a free fit would make one negative). None when the steps cannot tell the terms
    apart: fewer than MIN_MEASURED_STEPS, or one token count only."""
    steps = [s for s in steps if s.seconds > 0 and s.prefill_tokens > 0]
    rows = [(1.0, s.prefill_tokens + s.decode_tokens, s.pairs) for s in steps]
    times = [s.seconds for s in steps]
    if len(rows) < MIN_MEASURED_STEPS or len({r[1] for r in rows}) < 2:
        return None
    x = np.array(rows, float) / np.array(times)[:, None]      # relative: each row / its time
    scale = np.array([1.0, 1e-3, 1e-6])                       # terms of similar size
    x, y = x / scale, np.ones(len(rows))
    a, b, c = (float(v) for v in nonnegative_solve(x.T @ x, x.T @ y) / scale)
    return Prior(a, b, c, source)


def prior_for(kv_bytes_per_token: int, *, profile: str | None = None, cost_model=None,
              budget: int = 512) -> Prior:
    """The prior of a worker (module docstring: the order)."""
    if profile:
        from services.planner.profile import StepProfile  # noqa: PLC0415 - not in every build
        return prior_from_timer(StepProfile.load(profile), f"profile:{profile}", budget)
    if cost_model is not None:
        t = cost_model.target
        return prior_from_timer(cost_model, f"cost-model:{t.model.name}/{t.gpu.name}/tp{t.tp}",
                                budget)
    return default_prior(kv_bytes_per_token)


class CostFit:
    """Weighted least squares of step seconds on x = (1, tokens, pairs), with forgetting factor
    `forget` (the weight of a step `k` steps old is forget**k), started from `prior` with
    confidence `prior_weight` (in steps' worth of evidence, forgotten like a step). The features
    are scaled so that the three coefficients are of similar size. The coefficients are the best
    non-negative ones (`nonnegative_solve`: a time only adds up).

    The attention term also has a prior that is never forgotten, of weight `ratio_weight`: that a
    pair costs the prior's pairs-to-token ratio of a token (s_per_pair / s_per_token). Steps of
    short prompts barely tell a pair's cost from a token's (their pairs grow with their tokens):
    without it, once the starting prior was forgotten, the pair cost drifted wherever noise took
    it (5e-8 s on the CPU fleet's chat steps, 3-4e-7 once 8K-deep steps were seen), and an
    absolute value would not follow a loaded machine, whose token and pair costs grow together.
    Its weight, 0.3, is the pair evidence of ~8 chat steps (a 2,048-token step of 200-token
    chats: 0.04 in the scaled features, most of it the same as its tokens') and under a
    fiftieth of one 512-token chunk's at 8K deep (17): where the steps tell the pair cost the
    ratio gives way, where they cannot it holds."""

    def __init__(self, prior: Prior, forget: float = 0.98, prior_weight: float = 4.0,
                 scale: tuple[float, float, float] = (1.0, 1e-3, 1e-6),
                 ratio_weight: float = 0.3) -> None:
        if not 0 < forget <= 1:
            raise ValueError(f"forgetting factor must be in (0, 1], got {forget!r}")
        self.prior = prior
        self.forget = forget
        self._scale = np.array(scale, float)
        theta0 = np.array([prior.step_s, prior.s_per_token, prior.s_per_pair]) / self._scale
        # the forgotten evidence (normal equations), the prior's counting as prior_weight steps of
        # each feature's typical magnitude (1 after scaling)
        self._info = np.eye(3) * prior_weight
        self._moment = self._info @ theta0
        # the kept one: pair cost = ratio x token cost (scaled), or, for a prior without a token
        # cost, the prior's pair cost itself
        if prior.s_per_token > 0:
            v = np.array([0.0, -prior.s_per_pair / prior.s_per_token * scale[1] / scale[2], 1.0])
        else:
            v = np.array([0.0, 0.0, 1.0])
        self._ratio_info = ratio_weight * np.outer(v, v)
        self._ratio_moment = self._ratio_info @ theta0
        self._theta = theta0
        self.steps = 0

    def observe(self, tokens: int, pairs: int, seconds: float) -> None:
        if tokens <= 0 or not (seconds > 0 and math.isfinite(seconds)):
            return
        x = np.array([1.0, tokens, pairs], float) * self._scale
        self._info = self.forget * self._info + np.outer(x, x)
        self._moment = self.forget * self._moment + x * seconds
        # a direction no step has excited lately has no information left: the ridge keeps the
        # solve defined there without weighing on the rest
        info = self._info + self._ratio_info + 1e-9 * np.eye(3)
        self._theta = nonnegative_solve(info, self._moment + self._ratio_moment)
        self.steps += 1

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(step_s, s_per_token, s_per_pair), each >= 0."""
        a, b, c = (max(0.0, float(v)) for v in self._theta * self._scale)
        return a, b, c

    def step_time(self, tokens: int, pairs: int) -> float:
        a, b, c = self.coefficients
        return a + b * tokens + c * pairs


def nonnegative_solve(info: np.ndarray, moment: np.ndarray) -> np.ndarray:
    """argmin over theta >= 0 of theta' info theta - 2 moment' theta (least squares from its
    normal equations, every coefficient a time that only adds up): each set of free coefficients
    solved with the others held at 0, the best feasible one kept (3 coefficients: 7 sets). Used
    online by `CostFit` and once by `prior_from_steps`. The
    unconstrained solve clipped at 0 is not this: steps all of one size solve to a negative fixed
    cost and a per-token cost that makes up for it, and clipping the first kept the second, so the
    fit priced every step above what it took (a cold worker stayed at its prior)."""
    n = len(moment)
    best, best_value = np.zeros(n), 0.0
    for mask in range(1, 1 << n):
        free = [i for i in range(n) if mask >> i & 1]
        theta = np.zeros(n)
        sub = info[np.ix_(free, free)]
        try:
            theta[free] = np.linalg.solve(sub, moment[free])
        except np.linalg.LinAlgError:      # a term no step has (pairs of decode-free chunks: 0)
            theta[free] = np.linalg.lstsq(sub, moment[free], rcond=None)[0]
        if (theta < 0).any():
            continue
        value = -float(moment[free] @ theta[free])      # the objective at this set's optimum
        if value < best_value:
            best, best_value = theta, value
    return best


def fresh_pairs(chunks: Iterable[int], decode_context: int = 0) -> int:
    """(query, key) pairs of a step whose prefill chunks (`chunks`, tokens each) all start at
    position 0, its decodes attending over `decode_context` tokens in all: the step without its
    prompts' depth."""
    return sum(attention_pairs(0, n) for n in chunks) + decode_context


class Window:
    """Sums of (amount, seconds) over the events of the last `span_s` seconds (at most `cap`
    events): rate = sum amount / sum seconds, or over the window's wall time (`per_wall`)."""

    def __init__(self, span_s: float = 30.0, cap: int = 256, clock=time.monotonic) -> None:
        self.span_s, self.clock = span_s, clock
        self._events: deque[tuple[float, float, float]] = deque(maxlen=cap)   # (at, amount, s)

    def add(self, amount: float, seconds: float = 0.0) -> None:
        self._events.append((self.clock(), amount, seconds))

    def _live(self) -> list[tuple[float, float, float]]:
        horizon = self.clock() - self.span_s
        while self._events and self._events[0][0] < horizon:
            self._events.popleft()
        return list(self._events)

    def __len__(self) -> int:
        return len(self._live())

    def rate(self) -> float:
        """Sum of amounts over sum of seconds; 0 while there is none."""
        live = self._live()
        seconds = sum(s for _, _, s in live)
        return sum(a for _, a, _ in live) / seconds if seconds > 0 else 0.0

    def per_wall_s(self) -> float:
        """Sum of amounts per second of the window (events / span_s): 0 while there is none. A
        window holding `cap` events covers only the time since its oldest one (faster events than
        cap / span_s would otherwise read as cap / span_s)."""
        live = self._live()
        if not live:
            return 0.0
        span = self.span_s
        if len(live) == self._events.maxlen:
            span = min(span, max(self.clock() - live[0][0], 1e-6))
        return sum(a for _, a, _ in live) / span


MIN_DRAIN_STEPS = 4     # prefill steps in the window before the drain rate replaces the prior's
RECENT_STEPS = 8        # prefill steps the recent step time is the mean of
THROUGHPUT_SPAN_S = 5.0  # prefill tokens per wall second: over this much recent time


class WorkerRates:
    """Everything above for one worker; `on_step`, `kv_written` and `finished` feed it,
    `fields()` is what its heartbeat publishes."""

    def __init__(self, prior: Prior, token_budget: int = 512, chunk_size: int = 256,
                 kv_bytes_per_token: int = 0, clock=time.monotonic, wall=time.time) -> None:
        self.prior = prior
        self.token_budget = token_budget
        self.chunk_size = chunk_size
        self.kv_bytes_per_token = kv_bytes_per_token
        self.fit = CostFit(prior)
        self._drain = Window(clock=clock)
        self._kv = Window(clock=clock)
        self._finished = Window(clock=clock)
        self._freed = Window(clock=clock)
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self._ratios: deque[float] = deque(maxlen=RECENT_STEPS)   # fit's price / measured
        self._prefilled = Window(span_s=THROUGHPUT_SPAN_S, clock=clock)
        self._prefilled_by_class: dict[str, Window] = {}     # the same by the prompts' class
        self._prompts_by_class: dict[str, Window] = {}       # prompts (parts of) by class
        self._clock = clock
        self._wall = wall
        self._step: tuple[float, float] = (0.0, 0.0)      # (when the last step ended, its length)

    def on_step(self, prefill_tokens: int, decode_tokens: int, pairs: int, duration_s: float,
                gap_s: float, shallow_pairs: int | None = None,
                prefill_by_class: Mapping[str, int] | None = None,
                prompts_by_class: Mapping[str, float] | None = None) -> None:
        """One engine step, just ended; only steps that ran prefill feed the fit, the drain rate
        and the recent step, those two at depth 0 (module docstring) when `shallow_pairs` (the
        step's `fresh_pairs`) says what its pairs would have been there. `prefill_by_class`:
        its prefill tokens by the class of their prompts, when the caller knows them, and
        `prompts_by_class` the prompts they were, each as the part of it the step prefilled."""
        if duration_s > 0:
            self._step = (self._wall(), duration_s)
        if prefill_tokens <= 0 or duration_s <= 0:
            return
        self._prefilled.add(prefill_tokens)
        for name, n in (prefill_by_class or {}).items():
            self._prefilled_by_class.setdefault(
                name, Window(span_s=THROUGHPUT_SPAN_S, clock=self._clock)).add(n)
        for name, n in (prompts_by_class or {}).items():
            self._prompts_by_class.setdefault(
                name, Window(span_s=THROUGHPUT_SPAN_S, clock=self._clock)).add(n)
        tokens = prefill_tokens + decode_tokens
        self._ratios.append(self.fit.step_time(tokens, pairs) / duration_s)
        self.fit.observe(tokens, pairs, duration_s)
        shallow_s = duration_s * self._depth_factor(tokens, pairs, shallow_pairs)
        self._drain.add(prefill_tokens, shallow_s + max(0.0, gap_s))
        self._recent.append(shallow_s)

    def _depth_factor(self, tokens: int, pairs: int, shallow_pairs: int | None) -> float:
        """The fit's step(tokens, shallow pairs) / step(tokens, pairs): 1 for a step of fresh
        prompts (or one that does not say), below 1 for one deep in long prompts."""
        if shallow_pairs is None or shallow_pairs >= pairs:
            return 1.0
        deep = self.fit.step_time(tokens, pairs)
        return self.fit.step_time(tokens, shallow_pairs) / deep if deep > 0 else 1.0

    def kv_written(self, nbytes: int, seconds: float | None) -> None:
        if nbytes > 0 and seconds is not None and seconds > 0:
            self._kv.add(nbytes, seconds)

    def finished(self, blocks_freed: int) -> None:
        """A sequence finished here, freeing `blocks_freed` KV blocks."""
        self._finished.add(1)
        self._freed.add(max(0, blocks_freed))

    def drain_rate(self) -> float:
        if len(self._drain) >= MIN_DRAIN_STEPS:
            return self._drain.rate()
        return self.prior.drain_rate(self.token_budget, self.chunk_size)

    def fields(self, busy: bool = True) -> dict:
        """The WorkerStats fields this publishes; no step in flight unless the engine is `busy`
        (it has sequences running or queued)."""
        a, b, c = self.fit.coefficients
        p = self.prior
        return dict(prefill_step_s=a, prefill_s_per_token=b, prefill_s_per_pair=c,
                    prefill_fit_steps=self.fit.steps, prior_step_s=p.step_s,
                    prefill_fit_ratio=(sum(self._ratios) / len(self._ratios)
                                       if self._ratios else 0.0),
                    prior_s_per_token=p.s_per_token, prior_s_per_pair=p.s_per_pair,
                    prior_source=p.source, prefill_drain_tokens_per_s=self.drain_rate(),
                    prefill_recent_step_s=(sum(self._recent) / len(self._recent)
                                           if self._recent else 0.0),
                    token_budget=self.token_budget, chunk_size=self.chunk_size,
                    kv_bytes_per_token=self.kv_bytes_per_token,
                    kv_transfer_bytes_per_s=self._kv.rate(),
                    kv_blocks_freed_per_s=self._freed.per_wall_s(),
                    sequences_finished_per_s=self._finished.per_wall_s(),
                    prefill_tokens_per_wall_s=self._prefilled.per_wall_s(),
                    prefill_tokens_per_wall_s_by_class={
                        c: w.per_wall_s() for c, w in self._prefilled_by_class.items()},
                    prefill_prompts_per_wall_s_by_class={
                        c: w.per_wall_s() for c, w in self._prompts_by_class.items()},
                    # the step after the last began as it ended (back to back while work
                    # waits), as long as it: the router reads it only while that lasts
                    step_started_unix_s=self._step[0] if busy else 0.0,
                    step_predicted_s=self._step[1] if busy else 0.0)
