"""A real engine's step times, measured at start before it serves: the warm-up profile.

vLLM runs a dummy forward at start to size its KV cache, and vLLM and SGLang capture their graphs
with warm-up runs; this does the same for time. A few steps of chosen shapes (prefill chunks at
chosen token counts and depths, decode batches at chosen sizes and contexts) run on the model
through the engine's own executor, on dummy blocks, and their durations are returned for the
worker to fit its cost prior from (services/worker/rates.py, `prior_from_steps`): a cold fleet is
priced at the pace this box has now, not a constant measured once.

Each shape runs once untimed (the first runs pay the allocator's growth and oneDNN's first
primitives), then REPEATS times timed; its time is the median. A shape predicted past a quarter
of `max_step_s` runs once, timed (SmolLM2's larger shapes: the warm-up's cost, not its first
runs', dominates there). Shapes run cheapest
first, and a shape whose predicted time (`predicted_s`: the line through the two largest steps
measured so far) would pass `max_step_s` is skipped: a slow model (SmolLM2 on this CPU: ~4 ms a
token) measures its small shapes only, and the fit extrapolates in tokens.

What it leaves behind: nothing the engine's state shows. Its blocks are reserved and allocated
in the engine's pool under owner names no request can have (`OWNER`), and freed before it
returns, whatever happens: no owner, no reservation and no prefix-cache entry (nothing is hashed,
no KV event is logged); no request enters the scheduler, so the step counters, rate estimators
and the step model never see these steps; every sampled row draws from its own seeded generator
(the sampler's engine-wide one is not advanced). The blocks' KV memory holds garbage afterwards,
as a freed block's does.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from services.engine.admission import cdiv
from services.engine.config import INTERACTIVE
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import ScheduledChunk, SchedulerOutput, attention_pairs

OWNER = "\x00warmup"      # a pool owner prefix: request ids are validated strings, never this
REPEATS = 2               # timed runs of each shape, after one untimed
MAX_STEP_S = 1.0          # a shape predicted to take longer than this is skipped
CHAT_TOKENS = 200         # the chat prompts whose steps a cold burst is made of
DECODE_CONTEXT = 256      # the decoding sequences' context in the decode shapes


@dataclass(frozen=True, slots=True)
class Shape:
    """One step's work: prefill chunks as (tokens, start position), decodes as contexts."""

    prefill: tuple[tuple[int, int], ...] = ()
    decodes: tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        return sum(n for n, _ in self.prefill) + len(self.decodes)

    @property
    def pairs(self) -> int:
        """(query, key) pairs, counted as the engine's StepRecord counts them."""
        return (sum(attention_pairs(start, n) for n, start in self.prefill)
                + sum(self.decodes))

    @property
    def blocks(self) -> list[int]:
        """KV blocks each sequence needs (block_size 1; `blocks_for` scales)."""
        return [start + n for n, start in self.prefill] + list(self.decodes)


@dataclass(frozen=True, slots=True)
class MeasuredStep:
    prefill_tokens: int
    decode_tokens: int
    pairs: int
    seconds: float                # median of the timed runs


@dataclass(frozen=True)
class Profile:
    """What the warm-up measured (`steps`), how long it took in all, and why it stopped short:
    `error` is empty when every shape it ran was measured."""

    steps: list[MeasuredStep]
    elapsed_s: float
    skipped: int = 0              # shapes predicted past max_step_s, or that did not fit the pool
    error: str = ""


def default_shapes(token_budget: int, chunk_size: int, max_running: int,
                   max_model_len: int) -> list[Shape]:
    """Shapes of the steps a worker with this budget runs, cheapest first: small, chat-sized
    and full chunks at position 0, a chat burst's packed step, short and full chunks deep in a
    prompt (they pin the attention pairs' cost), decode batches, and a chat's chunk beside
    decodes."""
    chunk = max(1, min(chunk_size, token_budget))
    chat = min(CHAT_TOKENS, chunk)
    packed = max(1, min(token_budget // chat, max_running))
    batch = max(1, min(16, max_running, token_budget))
    ctx = max(1, min(DECODE_CONTEXT, max_model_len - 1))
    deep = max(0, min(4 * chunk, max_model_len - chunk))
    shapes = [Shape(decodes=(ctx,)), Shape(prefill=((min(32, chunk), deep),)),
              Shape(prefill=((min(64, chunk), 0),)), Shape(decodes=(ctx,) * batch),
              Shape(prefill=((chat, 0),)),
              Shape(prefill=((chat, 0),), decodes=(ctx,) * min(8, batch)),
              Shape(prefill=((chunk, 0),)), Shape(prefill=((chunk, deep),)),
              Shape(prefill=((chat, 0),) * packed)]
    return sorted(shapes, key=lambda s: (s.tokens, s.pairs))


def profile(engine, shapes: list[Shape], timeout_s: float, max_step_s: float = MAX_STEP_S,
            clock=time.perf_counter) -> Profile:
    """Run `shapes` on `engine` (an LLMEngine with a model executor) as the module docstring
    says, until all ran or `timeout_s` passed (checked between runs: a step in progress is
    not interrupted). A step that raises ends the warm-up with `error` set; either way the
    pool is left as it was."""
    t0 = clock()
    steps: list[MeasuredStep] = []
    skipped = 0
    for shape in shapes:
        if clock() - t0 > timeout_s:
            return Profile(steps, clock() - t0, skipped, f"timed out after {timeout_s:g} s")
        if predicted_s(steps, shape.tokens) > max_step_s or not _fits(engine, shape):
            skipped += 1
            continue
        runs = REPEATS + 1 if predicted_s(steps, shape.tokens) <= max_step_s / 4 else 1
        try:
            seconds = _measure(engine, shape, t0 + timeout_s, clock, runs)
        except Exception as e:  # noqa: BLE001 - the worker falls back to its default prior
            return Profile(steps, clock() - t0, skipped, f"{type(e).__name__}: {e}")
        if seconds is None:
            return Profile(steps, clock() - t0, skipped, f"timed out after {timeout_s:g} s")
        steps.append(MeasuredStep(sum(n for n, _ in shape.prefill), len(shape.decodes),
                                  shape.pairs, seconds))
    return Profile(steps, clock() - t0, skipped)


def predicted_s(steps: list[MeasuredStep], tokens: int) -> float:
    """A step of `tokens` tokens, from the steps measured so far that ran prefill: seconds =
    a + b x tokens through the two of the most tokens (each term >= 0); 0 (unknown: run it)
    with fewer than two token counts measured. Decode-only steps are left out: their tokens
    cost ~5x a prefill token's on this CPU, and priced SmolLM2's prefill shapes past the cap."""
    by_tokens = {s.prefill_tokens + s.decode_tokens: s.seconds for s in steps
                 if s.prefill_tokens > 0}
    if len(by_tokens) < 2:
        return 0.0
    (n0, t0), (n1, t1) = sorted(by_tokens.items())[-2:]
    b = max(0.0, (t1 - t0) / (n1 - n0))
    return max(0.0, t1 - b * n1) + b * tokens


def _fits(engine, shape: Shape) -> bool:
    """The shape's blocks are free in the pool without evicting a cached one (fresh pages are
    taken first; counting every cached block as free errs towards skipping), and its positions
    inside the model's length."""
    pool = engine.pool
    need = sum(cdiv(n + 1, pool.block_size) for n in shape.blocks)
    return (need <= pool.num_available - pool.num_cached
            and max(shape.blocks) < engine.max_model_len)


def _measure(engine, shape: Shape, deadline: float, clock, runs: int) -> float | None:
    """The median of the timed runs of `runs` (all but the first, or the only one); None if
    the deadline passed first."""
    plan, drawers, generators = _dummy_step(engine, shape)
    try:
        times = []
        for i in range(runs):
            if clock() > deadline:
                return None
            start = clock()
            engine.executor.execute(plan, drawers, plan.chunks, generators)
            if i or runs == 1:
                times.append(clock() - start)
        return statistics.median(times)
    finally:
        for r in drawers:
            engine.pool.free(r.request_id)


def _dummy_step(engine, shape: Shape) -> tuple[SchedulerOutput, list[Request], list]:
    """The plan of one step of `shape` over dummy sequences, each holding its blocks in the
    pool under an OWNER name; every chunk samples (as a prompt's last chunk and a decode do)."""
    pool, plan = engine.pool, SchedulerOutput()
    drawers: list[Request] = []
    params = SamplingParams(max_tokens=1, seed=0)
    seqs = [(n, start, plan.prefills) for n, start in shape.prefill]
    seqs += [(1, ctx - 1, plan.decodes) for ctx in shape.decodes]
    for i, (n, start, chunks) in enumerate(seqs):
        owner = f"{OWNER}-{i}"
        blocks = cdiv(start + n + 1, pool.block_size)
        if not pool.reserve(owner, blocks):
            for r in drawers:
                pool.free(r.request_id)
            raise RuntimeError(f"warm-up: {blocks} blocks are not free for {shape}")
        pool.allocate(owner, blocks)
        tokens = [(7 * j + 1) % 97 + 1 for j in range(start + n)]
        req = Request(owner, "", INTERACTIVE, params, tokens, 0.0)   # never scheduled
        drawers.append(req)
        chunks.append(ScheduledChunk(req, start, n, sample=True, num_prompt_logprob_rows=0))
    # decodes first, as the scheduler plans them: chunks are decodes + prefills
    order = {id(c.request): k for k, c in enumerate(plan.chunks)}
    drawers.sort(key=lambda r: order[id(r)])
    return plan, drawers, [engine.executor.new_generator(0) for _ in drawers]
