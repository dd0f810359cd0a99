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
            until measured)
  prefill   ceil(tokens / chunk_size) steps of the fitted cost:
            steps x prefill_step_s + tokens x prefill_s_per_token + pairs x prefill_s_per_pair
  transfer  prompt tokens x kv_bytes_per_token / kv_transfer_bytes_per_s
  decode    0 while the decode worker has the request's blocks free and unreserved, else the
            missing blocks / its kv_blocks_freed_per_s

A worker that publishes none of it (an older build) is predicted with the router's `Prior`,
never as 0: a cold fleet does not admit blindly.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.router import fair_order

# A decode worker that has freed nothing recently: how long a missing block is assumed to take.
UNKNOWN_DRAIN_S_PER_BLOCK = 1.0
# A request reaching a busy worker waits for the rest of the step in flight first: half a step
# were steps alike, more as they are not (a long step is likelier to be the one hit, and a
# document's steps grow as its chunks go deeper). One step: what the `mixed` load test measured
# (docs/benchmarks.md).
IN_FLIGHT_STEP = 1.0
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
    if not (w.prefill_s_per_token > 0 or w.prefill_step_s > 0):
        return tokens / prefill_rate(w, prior) + pairs * prior.attention_s_per_pair
    steps = math.ceil(tokens / w.chunk_size) if w.chunk_size else 1
    decodes = w.num_running if w.role == "mixed" else 0
    alone = (steps * (w.prefill_step_s + decodes * w.prefill_s_per_token)
             + tokens * w.prefill_s_per_token + pairs * w.prefill_s_per_pair)
    if not w.queued_prefill_tokens:
        return alone
    busy_step = w.prefill_recent_step_s or (
        min(w.token_budget or w.chunk_size or tokens, w.queued_prefill_tokens + tokens)
        / prefill_rate(w, prior))
    return max(alone, (steps + IN_FLIGHT_STEP) * busy_step)


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
        return 0.0
    if d.kv_blocks_freed_per_s > 0:
        return missing / d.kv_blocks_freed_per_s
    return missing * UNKNOWN_DRAIN_S_PER_BLOCK


def predict(w: pb.WorkerStats, prompt_tokens: int, *, cached_tokens: int = 0,
            kv_bytes: int = 0, decode_wait_s: float = 0.0, traffic_class: str = "",
            prior: Prior = Prior(), tenant: str = "",
            weights: Mapping[str, float] | None = None) -> Prediction:
    """TTFT of a prompt placed on prefill (or mixed) worker `w`; `kv_bytes` > 0 when its KV
    moves to a decode worker afterwards (`kv_bytes_of`), `decode_wait_s` from `decode_wait_s()`."""
    own = max(0, prompt_tokens - cached_tokens)
    return Prediction(wait_s=queued_ahead(w, traffic_class, tenant, weights)
                      / prefill_rate(w, prior),
                      prefill_s=own_prefill_s(w, own, cached_tokens, prior),
                      transfer_s=transfer_s(w, kv_bytes, prior),
                      decode_wait_s=max(0.0, decode_wait_s))
