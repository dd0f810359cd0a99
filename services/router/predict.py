"""Predicted time to first token for a placement (DESIGN.md section 3, router):

    TTFT = path        the hops from the plan to the gateway's first token (PATH_S, a constant)
         + wait        prefill tokens queued ahead on the chosen prefill worker / its drain rate
         + prefill     this prompt's uncached tokens through the worker's fitted prefill cost model
         + transfer    the prompt's KV bytes / the KV path's measured bandwidth (disaggregated only)
         + decode wait  until the decode worker has a slot for it (0 while it has free KV)

Every term is in seconds and non-negative; the parts are kept so a refusal, a span and the
load-test summary can say which term broke the target. What the terms read from the worker's
heartbeat (services/worker/rates.py measures it):

  wait      `queued_prefill_tokens_ahead[class]` (the tokens a new request of its class waits
            behind, in the scheduler's order) when published, else every queued prompt token;
            of its own class only the part the engine's tenant-fair order serves first
            (fair_order.worker_tokens_ahead, from `prefill_queues`);
            over `prefill_drain_tokens_per_s` (prefill tokens per busy second, the prior's rate
            until measured); 0 when the prompts ahead leave room in the next step for its first
            chunk (`prefill_step_tokens_ahead[class]`: each takes at most its chunk)
  prefill   `prefill_steps` steps of the fitted cost:
            steps x step(0) + tokens x prefill_s_per_token + pairs x prefill_s_per_pair
  transfer  prompt tokens x kv_bytes_per_token / kv_transfer_bytes_per_s
  decode    0 while the decode worker has the request's blocks free and unreserved, else the
            missing blocks / its kv_blocks_freed_per_s

On a co-located (mixed) replica every step also carries its decode batch (Sarathi: decodes first,
then prefill chunks fill the budget), from `num_decoding` and `decode_context_tokens`:
  step(n)   prefill_step_s + prefill_s_per_token x (n + decodes)
            + prefill_s_per_pair x (n's pairs + decode context): the same fitted cost (a worker
            fits it on every step that prefilled, decodes in it), the capacity model's until then
  prefill   chunks of min(chunk_size, token_budget - decodes), and while it decodes chunks whose
            attention fits `max_prefill_attention` (about cap / position tokens deep in a long
            prompt); half a decode step in flight when nothing is queued
  wait      the tokens ahead in steps of what the decode batch and the lower classes queued
            there (their share while it waits) leave of the budget, each step priced as above
  decode    also the wait for a seat under `max_running`, behind those queued there, at
            `sequences_finished_per_s`; the queue's wait and the seat's overlap (the queued
            prompts start as seats free), so the wait term is what the queue adds beyond it

A worker that publishes none of it (an older build) is predicted with the router's `Prior`,
never as 0: a cold fleet does not admit blindly.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from services.engine.scheduler import MIN_CHUNK
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.router import fair_order

# A decode worker that has freed nothing recently: how long a missing block is assumed to take.
UNKNOWN_DRAIN_S_PER_BLOCK = 1.0
# A request reaching a busy worker waits for the rest of the step in flight first: half a step
# were steps alike, more as they are not (a long step is likelier to be the one hit, and a
# document's steps grow as its chunks go deeper). One step: what the `mixed` load test measured
# (docs/benchmarks.md).
IN_FLIGHT_STEP = 1.0
# A request reaching a co-located replica that runs only its decode batch waits, on average, for
# half of the step in flight.
DECODE_IN_FLIGHT_STEP = 0.5
# Prefill tokens a co-located step keeps for prompts however large its decode batch (the
# scheduler's budget must cover max_running decodes, so a full batch can leave none: then the
# prompt waits for a seat, which seat_wait_s counts).
MIN_PREFILL_SHARE = 16
# What the classes below a waiting request's take of a step's token budget while it waits (the
# engine's default `share_while_interactive_waits` of documents: services/engine/config.py).
LOWER_CLASS_SHARE = 0.5
# From the plan to the first token at the gateway, besides the engine's work: the Prefill call,
# the worker's IPC to its engine core and back, the first token's relay (docs/benchmarks.md: the
# hops of an idle fleet's TTFT, ~10 ms on the 2-core CPU machine).
PATH_S = 0.01



def free_unreserved_blocks(w: pb.WorkerStats) -> int:
    """KV blocks a worker could still reserve: free, less reserved, less held for late writes."""
    return max(0, w.kv_blocks_free - w.kv_blocks_reserved - w.kv_blocks_held)

@dataclass(frozen=True, slots=True)
class Prior:
    """What a worker that publishes no measurements is assumed to do."""

    prefill_tokens_per_s: float = 2000.0      # a conservative CPU figure (docs/benchmarks.md)
    attention_s_per_pair: float = 0.0         # the quadratic term: seconds per (query, key) pair
    kv_gbps: float = 8.0                      # loopback tcp (docs/benchmarks.md)


@dataclass(frozen=True, slots=True)
class Prediction:
    wait_s: float
    prefill_s: float
    transfer_s: float
    decode_wait_s: float

    @property
    def total_s(self) -> float:
        return PATH_S + self.wait_s + self.prefill_s + self.transfer_s + self.decode_wait_s

    def dominant(self) -> str:
        """The term that costs the most, for a refusal's message."""
        parts = {"queue": self.wait_s, "prefill": self.prefill_s, "kv transfer": self.transfer_s,
                 "decode slot": self.decode_wait_s}
        return max(parts, key=parts.get)

    def fill(self, plan: pb.Plan) -> pb.Plan:
        """Write the prediction and its terms into `plan`."""
        plan.predicted_ttft_s = self.total_s
        plan.predicted_wait_s = self.wait_s
        plan.predicted_prefill_s = self.prefill_s
        plan.predicted_transfer_s = self.transfer_s
        plan.predicted_decode_wait_s = self.decode_wait_s
        return plan


def prefill_rate(w: pb.WorkerStats, prior: Prior) -> float:
    """Prefill tokens/s a queue on `w` drains at: measured, else the worker's prior, else ours."""
    for rate in (w.prefill_drain_tokens_per_s, w.prefill_tokens_per_s):
        if rate > 0:
            return rate
    return prior.prefill_tokens_per_s


def attention_pairs(cached: int, tokens: int) -> int:
    """(query, key) pairs of prefilling `tokens` new tokens after `cached` ones."""
    return tokens * cached + tokens * (tokens + 1) // 2


def fits_next_step(w: pb.WorkerStats, traffic_class: str, tokens: int) -> bool:
    """Whether the prompts ahead of a new request of `traffic_class` leave room in the next step
    for its first chunk (each takes at most its chunk: one long prompt ahead does not make a
    short one wait for all of it). False when `w` does not say."""
    step = w.prefill_step_tokens_ahead
    if not (traffic_class in step and w.token_budget):
        return False
    first = min(tokens, w.chunk_size or tokens)
    return step[traffic_class] + first <= w.token_budget - decode_batch(w)[0]


def queued_ahead(w: pb.WorkerStats, traffic_class: str = "", tenant: str = "",
                 weights: Mapping[str, float] | None = None) -> int:
    """Prefill tokens a new request of `traffic_class` (from `tenant`, when named) would wait
    behind on `w`: in the engine's tenant-fair order when the worker publishes its queues."""
    ahead = w.queued_prefill_tokens_ahead
    if traffic_class and traffic_class in ahead:
        if tenant and w.prefill_queues:
            return fair_order.worker_tokens_ahead(w, traffic_class, tenant, weights or {})
        return ahead[traffic_class]
    return w.queued_prefill_tokens


def own_prefill_s(w: pb.WorkerStats, tokens: int, cached: int, prior: Prior) -> float:
    """Seconds to prefill `tokens` new tokens after `cached` ones on `w`: its chunks through the
    fitted cost (with a mixed worker's running decodes in every step), and at least, while other
    prompts are queued there, a busy step each (the others' chunks share its steps: the worker's
    recent prefill step time, else a step of min(budget, all queued) tokens at the drain rate)
    plus what is left of the step in flight when it arrives."""
    if tokens <= 0:
        return 0.0
    pairs = attention_pairs(cached, tokens)
    if not fitted(w):
        return tokens / prefill_rate(w, prior) + pairs * prior.attention_s_per_pair
    steps = prefill_steps(w, cached, tokens)
    alone = steps * step_s(w, 0, 0) + tokens * w.prefill_s_per_token + pairs * w.prefill_s_per_pair
    if not w.queued_prefill_tokens:
        # a co-located replica with a decode batch is always stepping: the step in flight first
        return alone + (DECODE_IN_FLIGHT_STEP * step_s(w, 0, 0) if decode_batch(w)[0] else 0.0)
    busy_step = w.prefill_recent_step_s or (
        min(w.token_budget or w.chunk_size or tokens, w.queued_prefill_tokens + tokens)
        / prefill_rate(w, prior))
    return max(alone, (steps + IN_FLIGHT_STEP) * busy_step)


def fitted(w: pb.WorkerStats) -> bool:
    """Whether `w` publishes its fitted step cost (a worker that prefills always does)."""
    return w.prefill_s_per_token > 0 or w.prefill_step_s > 0


def decode_batch(w: pb.WorkerStats) -> tuple[int, int]:
    """(sequences, context tokens) of the decode batch every step of `w` carries besides its
    prefill chunks: a co-located (mixed) replica's decoding sequences; none on a prefill worker."""
    if w.role != "mixed":
        return 0, 0
    return w.num_decoding, w.decode_context_tokens


def step_s(w: pb.WorkerStats, prefill_tokens: int, prefill_pairs: int) -> float:
    """One step of `w` through its fitted cost: `prefill_tokens` of prefill with their
    `prefill_pairs`, plus its decode batch (a decode token attends over its context: the fit counts
    each context token as a pair)."""
    decodes, context = decode_batch(w)
    return (w.prefill_step_s + w.prefill_s_per_token * (prefill_tokens + decodes)
            + w.prefill_s_per_pair * (prefill_pairs + context))


def chunk_share(w: pb.WorkerStats) -> int:
    """Prefill tokens one prompt gets a step: its chunk, within what the decode batch leaves of
    the token budget (decodes go first)."""
    chunk = w.chunk_size or w.token_budget or 1
    if w.token_budget:
        chunk = min(chunk, max(MIN_PREFILL_SHARE, w.token_budget - decode_batch(w)[0]))
    return max(1, chunk)


def prefill_steps(w: pb.WorkerStats, cached: int, tokens: int) -> int:
    """Steps to prefill positions [cached, cached + tokens) on `w`: chunks of `chunk_share`, and
    while a co-located replica decodes, chunks whose attention fits `max_prefill_attention`
    pairs (the scheduler's cap: n (pos + n/2) <= cap, so about cap / pos tokens deep in a prompt,
    never under its MIN_CHUNK)."""
    share = chunk_share(w)
    cap = w.max_prefill_attention if decode_batch(w)[0] else 0
    if not cap:
        return math.ceil(tokens / share)
    end = cached + tokens
    full = min(end, max(cached, cap // share))        # below it the share is the limit
    floor = max(full, min(end, cap // MIN_CHUNK))     # past it the scheduler's minimum chunk
    steps = math.ceil((full - cached) / share)
    steps += math.ceil((floor * floor - full * full) / (2 * cap))
    steps += math.ceil((end - floor) / MIN_CHUNK)
    return max(1, steps)


def colocated_wait_s(w: pb.WorkerStats, ahead: int) -> float:
    """Until `ahead` queued prompt tokens are prefilled on co-located replica `w`: steps of what
    the decode batch leaves of the budget, less what the lower classes queued there take of it
    (their share while a higher class waits), each step priced with the batch in it (prompts
    ahead taken as first chunks)."""
    if ahead <= 0:
        return 0.0
    budget = w.token_budget or ahead
    lower = min(max(0, w.queued_prefill_tokens - ahead), int(LOWER_CLASS_SHARE * budget))
    share = max(MIN_PREFILL_SHARE, budget - decode_batch(w)[0] - lower)
    per_step = min(share, ahead)
    chunk = min(per_step, w.chunk_size or per_step)
    pairs = per_step // chunk * attention_pairs(0, chunk) + attention_pairs(0, per_step % chunk)
    return ahead / per_step * step_s(w, per_step, pairs)


def seat_wait_s(d: pb.WorkerStats) -> float:
    """Co-located replica `d` admits a sequence only under its `max_running`: until a seat frees
    for a newcomer behind those already queued there, at the rate its sequences finish."""
    if d.role != "mixed" or not d.max_running:
        return 0.0
    missing = d.num_queued + 1 - max(0, d.max_running - d.num_running)
    if missing <= 0:
        return 0.0
    if d.sequences_finished_per_s > 0:
        return missing / d.sequences_finished_per_s
    return missing * UNKNOWN_DRAIN_S_PER_BLOCK


def kv_bytes_of(w: pb.WorkerStats, prompt_tokens: int) -> int:
    """The prompt's KV as the worker lays it out (0 when it does not say)."""
    return prompt_tokens * w.kv_bytes_per_token


def transfer_s(w: pb.WorkerStats, kv_bytes: int, prior: Prior) -> float:
    if kv_bytes <= 0:
        return 0.0
    bytes_s = w.kv_transfer_bytes_per_s or prior.kv_gbps * 1e9 / 8
    return kv_bytes / bytes_s


def decode_wait_s(d: pb.WorkerStats, blocks_needed: int) -> float:
    """Until decode (or mixed) worker `d` has `blocks_needed` free unreserved KV blocks: 0 while it
    has them, else the missing blocks at the rate its finishing sequences free them."""
    missing = blocks_needed - free_unreserved_blocks(d)
    if missing <= 0:
        kv = 0.0
    elif d.kv_blocks_freed_per_s > 0:
        kv = missing / d.kv_blocks_freed_per_s
    else:
        kv = missing * UNKNOWN_DRAIN_S_PER_BLOCK
    return max(kv, seat_wait_s(d))


def predict(w: pb.WorkerStats, prompt_tokens: int, *, cached_tokens: int = 0,
            kv_bytes: int = 0, decode_wait_s: float = 0.0, traffic_class: str = "",
            prior: Prior = Prior(), tenant: str = "",
            weights: Mapping[str, float] | None = None) -> Prediction:
    """TTFT of a prompt placed on prefill (or mixed) worker `w`; `kv_bytes` > 0 when its KV
    moves to a decode worker afterwards (`kv_bytes_of`), `decode_wait_s` from `decode_wait_s()`."""
    own = max(0, prompt_tokens - cached_tokens)
    ahead = queued_ahead(w, traffic_class, tenant, weights)
    decode_wait_s = max(0.0, decode_wait_s)
    if fits_next_step(w, traffic_class, own):
        wait = 0.0
    elif w.role == "mixed" and fitted(w):
        # the prompts ahead start as seats free: the two waits overlap, the longer one counts
        wait = max(0.0, colocated_wait_s(w, ahead) - decode_wait_s)
    else:
        wait = ahead / prefill_rate(w, prior)
    return Prediction(wait_s=wait, prefill_s=own_prefill_s(w, own, cached_tokens, prior),
                      transfer_s=transfer_s(w, kv_bytes, prior), decode_wait_s=decode_wait_s)
