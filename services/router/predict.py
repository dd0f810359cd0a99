"""Predicted time to first token for a placement (DESIGN.md section 3, router):

    TTFT = path        the hops from the plan to the gateway's first token (PATH_S, a constant)
         + in flight   what is left of the step the prefill worker is running
         + wait        prefill tokens queued ahead on the chosen prefill worker / its drain rate
         + prefill     this prompt's uncached tokens through the worker's fitted prefill cost model
         + decode wait  until the decode worker has a slot for it (0 while it has free KV)
    then   transfer    the prompt's KV bytes / the KV path's measured bandwidth (disaggregated
                       only): not part of the TTFT. The prefill worker sends the first token to
                       the gateway as it samples it, before any KV moves (services/prefill/
                       handler.py; the simulator likewise), so the transfer is what the second
                       token waits for (the first decode step's gap, counted in ITL), and what the
                       decode reservation must outlive (`kv_landed_s`; the router refuses a
                       prompt whose KV could not land in time: admission.kv_write_limit_s).

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

The step in flight, from `step_started_unix_s` and `step_predicted_s` (when the worker publishes
them; `in_flight_s`), while the published step still runs (the beat is younger than a step, so
its queue is the one a new prompt meets: the simulator's fresh stats, a slow worker's long steps;
a step past its predicted end by less than another of its lengths overran the fit and still
runs, `step_current`):
  in flight the published step's start + its predicted length - now (0 once past it)
  prefill   priced as the steps it shares: each carries, besides its own chunk, the chunks
            of the other queued prompts that fit beside it (`prefill_step_tokens_ahead`, else
            all queued, within the budget) and of those expected to arrive before it starts
            (`prefill_tokens_per_wall_s`), each step through the fitted cost (`shared_prefill_s`)
  wait, prefill  when the worker lists each queued prompt's tokens (`prefill_queues[].prompts`):
            its scheduler stepped forward (step_ahead.py: classes, the tenants' DRR turns, each
            prompt at most its chunk a step, the arrivals as above), from the end of the step in
            flight to the step that takes the prompt's last token, each step through the fitted cost;
            on a co-located replica each step with its decode batch first (the prompts share what
            it leaves of the budget, within the attention cap while it decodes) and in its cost;
            a document (a class below the top one) with the higher classes' prompts expected to
            arrive during it, at their measured rate (`prefill_tokens_per_wall_s_by_class`),
            going first in every step they wait in, stepped to its last token or its horizon
The same stepping on a worker at rest at its beat (`at_rest`: nothing running or queued there,
so it publishes no step): what is queued there now is only what routers placed since; the step
in flight is the one it began on the first of them (`rested_in_flight_s`; none while nothing is
placed there).
In both, the prompts this router placed on the worker since its beat are in its published queues
(placements.with_placed_prompts: each at the back of its tenant's queue of its class, where the
engine puts it), so a burst's k-th document is stepped beside the k - 1 placed before it (on a
prefill worker each takes a chunk of every step while the budget lasts: they share the steps, and
each step costs their chunks together), and a chat ahead of the documents (its class goes first;
the documents only fill what the chats leave of a step, at most their share while chats wait)
keeps its own tokens of every step, slowed only by the documents' chunks in what it leaves.
Otherwise (a step published and ended: a beat older than a step, whose queue has moved on and
whose current step's phase is unknown) the older rules above: on a prefill worker a whole busy
step in flight inside `prefill`, on a co-located replica its decode-batch rule.

A worker that publishes none of it (an older build) is predicted with the router's `Prior`,
never as 0: a cold fleet does not admit blindly.
"""
from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.engine.config import INTERACTIVE, TrafficClass
from services.engine.scheduler import MIN_CHUNK
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.router import fair_order
from services.router.step_ahead import CLASSES, step_ahead

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
# Of the prompt tokens expected to arrive (at the worker's recent prefill throughput) while the
# step in flight ends, the part counted into the step a new prompt starts in: arrivals in a window
# of a few ms are mostly none and sometimes a burst, so the typical step sees fewer than the mean
# (the simulator's `mixed` and `azure-conv` at the 70B pace: 0.5 beside 0 and 1;
# docs/benchmarks.md).
ARRIVALS_JOINING = 0.5
# A published step begun this many of its predicted lengths ago has ended (not overrun).
OVERRUN_STEPS = 2.0



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
    in_flight_s: float = 0.0      # what is left of the step in flight (part of the queue)

    @property
    def total_s(self) -> float:
        """The predicted TTFT: the KV transfer is not in it (the first token leaves first)."""
        return PATH_S + self.in_flight_s + self.wait_s + self.prefill_s + self.decode_wait_s

    @property
    def kv_landed_s(self) -> float:
        """When the prompt's KV has landed on the decode worker (0 moved: the first token): its
        first decode step may begin, and its reservation must still hold."""
        return self.total_s + self.transfer_s

    def dominant(self) -> str:
        """The TTFT term that costs the most, for a refusal's message."""
        parts = {"queue": self.wait_s + self.in_flight_s, "prefill": self.prefill_s,
                 "decode slot": self.decode_wait_s}
        return max(parts, key=parts.get)

    def fill(self, plan: pb.Plan) -> pb.Plan:
        """Write the prediction and its terms into `plan`."""
        plan.predicted_ttft_s = self.total_s
        plan.predicted_wait_s = self.wait_s + self.in_flight_s
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


def publishes_step(w: pb.WorkerStats) -> bool:
    """Whether `w` publishes its step in flight (a worker that has stepped, of a newer build)."""
    return w.step_predicted_s > 0 and fitted(w)


def in_flight_s(w: pb.WorkerStats, now_unix_s: float) -> float:
    """What is left at `now_unix_s` of the step `w` published as running (a worker publishes no
    step while it is idle); 0 once it has ended."""
    left = w.step_started_unix_s + w.step_predicted_s - now_unix_s
    return max(0.0, min(left, w.step_predicted_s))


def at_rest(w: pb.WorkerStats) -> bool:
    """Whether `w` was at rest at its beat: a worker of this build (it publishes its fitted cost)
    with nothing running or queued, so no step in flight (services/worker/rates.py `fields`).
    What is queued on it now is what routers placed there since (placements.with_placed_prompts),
    and it began on that as it arrived (`rested_in_flight_s`)."""
    return (fitted(w) and not w.step_predicted_s
            and not (w.num_running or w.num_queued or decode_batch(w)[0]))


def rested_in_flight_s(w: pb.WorkerStats) -> float:
    """On a worker at rest at its beat, the step in flight when prompts were placed there since:
    it began on the first of them as it arrived, with what had arrived (a burst reaches the
    worker over its admissions, not at once), so a newcomer waits for it before the queue is
    stepped: IN_FLIGHT_STEP of a step of their first chunks (within the budget), as on a busy
    worker whose step is not published. 0 while nothing is queued there."""
    queued = w.queued_prefill_tokens
    if not queued:
        return 0.0
    return IN_FLIGHT_STEP * with_chunks_s(w, min(queued, w.token_budget or queued))


def step_current(w: pb.WorkerStats, now_unix_s: float) -> bool:
    """Whether the step `w` published is still the one it runs at `now_unix_s`: begun less than
    OVERRUN_STEPS of its predicted lengths ago. A step past its predicted end but within that
    overran its prediction (the fit is a few % off, and the in-flight part is then ~0); an older
    one has ended, and the worker has stepped on since (a beat older than a step)."""
    return (publishes_step(w)
            and now_unix_s < w.step_started_unix_s + OVERRUN_STEPS * w.step_predicted_s)


def beside_tokens(w: pb.WorkerStats, first: int, in_flight: float = 0.0) -> int:
    """Prefill tokens of other prompts that share a step with a new prompt's `first` chunk: the
    queued ones, ahead of it and, in what they leave of the budget, behind it (the scheduler fills
    the budget): what all of them take of the next step (each at most its chunk) when `w` says,
    else all queued; plus ARRIVALS_JOINING of those expected to arrive while the step
    `in_flight` seconds from its end runs (`prefill_tokens_per_wall_s`); within what the decode
    batch and the chunk leave of the budget."""
    step = w.prefill_step_tokens_ahead
    queued = max(step.values()) if step else w.queued_prefill_tokens
    queued += round(ARRIVALS_JOINING * w.prefill_tokens_per_wall_s * max(0.0, in_flight))
    room = (w.token_budget or queued + first) - decode_batch(w)[0] - first
    return max(0, min(queued, room))


def shared_prefill_s(w: pb.WorkerStats, tokens: int, cached: int, in_flight: float = 0.0) -> float:
    """Seconds to prefill `tokens` new tokens after `cached` on `w` in steps it shares with the
    chunks of other prompts (fresh chunks), each step through the fitted cost with the decode
    batch in it: its first step with those queued and arriving before it starts
    (`beside_tokens`), each later one with those arriving while a step runs."""
    if tokens <= 0:
        return 0.0
    steps = prefill_steps(w, cached, tokens)
    share = min(tokens, chunk_share(w))
    own = tokens * w.prefill_s_per_token + attention_pairs(cached, tokens) * w.prefill_s_per_pair
    total = own + with_chunks_s(w, beside_tokens(w, share, in_flight))
    if steps > 1:
        step = own / steps + with_chunks_s(w, 0)
        room = (w.token_budget or share) - decode_batch(w)[0] - share
        later = max(0, min(room, round(w.prefill_tokens_per_wall_s * step)))
        total += (steps - 1) * with_chunks_s(w, later)
    return total


def with_chunks_s(w: pb.WorkerStats, others: int) -> float:
    """A step of `w` (its decode batch in it) carrying `others` tokens of other prompts' fresh
    chunks, besides a prompt's own part (not counted here)."""
    chunk = max(1, min(others, w.chunk_size or others)) if others else 1
    pairs = others // chunk * attention_pairs(0, chunk) + attention_pairs(0, others % chunk)
    return step_s(w, others, pairs)


def own_prefill_s(w: pb.WorkerStats, tokens: int, cached: int, prior: Prior,
                  attention_share: float = 1.0) -> float:
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
    steps = prefill_steps(w, cached, tokens, attention_share)
    alone = steps * step_s(w, 0, 0) + tokens * w.prefill_s_per_token + pairs * w.prefill_s_per_pair
    if not w.queued_prefill_tokens:
        # a co-located replica with a decode batch is always stepping: the step in flight first
        return alone + (DECODE_IN_FLIGHT_STEP * step_s(w, 0, 0) if decode_batch(w)[0] else 0.0)
    busy_step = w.prefill_recent_step_s or (
        min(w.token_budget or w.chunk_size or tokens, w.queued_prefill_tokens + tokens)
        / prefill_rate(w, prior))
    return max(alone, (steps + IN_FLIGHT_STEP) * busy_step)


def capped_share(w: pb.WorkerStats, traffic_class: str) -> float:
    """The share of a co-located replica's prefill attention a prompt of a lower class gets while
    chats wait there (the scheduler's `share_while_interactive_waits`), taken for its whole
    prefill: a replica that decodes chats keeps receiving them (the router's own wait queue
    holds them when the replica's is empty); 1 for a chat or on another role."""
    return LOWER_CLASS_SHARE if w.role == "mixed" and _lower(traffic_class) else 1.0


def _lower(traffic_class: str) -> bool:
    """A class below the interactive one ("" is the interactive class)."""
    return traffic_class not in ("", INTERACTIVE.name)


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


def prefill_steps(w: pb.WorkerStats, cached: int, tokens: int,
                  attention_share: float = 1.0) -> int:
    """Steps to prefill positions [cached, cached + tokens) on `w`: chunks of `chunk_share`, and
    while a co-located replica decodes, chunks whose attention fits `max_prefill_attention`
    pairs (the scheduler's cap: n (pos + n/2) <= cap, so about cap / pos tokens deep in a prompt,
    never under its MIN_CHUNK); a lower class while chats wait gets `attention_share` of them."""
    share = chunk_share(w)
    cap = int(w.max_prefill_attention * attention_share) if decode_batch(w)[0] else 0
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
            weights: Mapping[str, float] | None = None,
            now_unix_s: float | None = None,
            classes: Sequence[TrafficClass] = CLASSES) -> Prediction:
    """TTFT of a prompt placed on prefill (or mixed) worker `w`; `kv_bytes` > 0 when its KV
    moves to a decode worker afterwards (`kv_bytes_of`), `decode_wait_s` from `decode_wait_s()`;
    `now_unix_s` (default: the wall clock) on the clock of the worker's `step_started_unix_s`."""
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
    now = time.time() if now_unix_s is None else now_unix_s
    current, rested = step_current(w, now), at_rest(w)
    flight = in_flight_s(w, now) if current else rested_in_flight_s(w) if rested else 0.0
    idle = not (w.queued_prefill_tokens or decode_batch(w)[0])
    if current or rested or (publishes_step(w) and idle):
        # a beat younger than a step (or an idle worker's): its queue is the one the prompt meets
        forward = step_ahead(w, own, cached_tokens, traffic_class or INTERACTIVE.name,
                            tenant, weights or {}, flight, ARRIVALS_JOINING, classes)
        if forward is not None:
            return Prediction(wait_s=forward.wait_s, prefill_s=forward.prefill_s,
                              transfer_s=transfer_s(w, kv_bytes, prior),
                              decode_wait_s=decode_wait_s, in_flight_s=flight)
    if current and w.role != "mixed":
        prefill = shared_prefill_s(w, own, cached_tokens, flight)
    else:   # and a co-located replica not stepped: its decode-batch rule (its own ramp's)
        flight, prefill = 0.0, own_prefill_s(w, own, cached_tokens, prior,
                                             capped_share(w, traffic_class))
    if w.role == "mixed" and _lower(traffic_class) and ahead and own:
        # the documents ahead go as deep in their prompts as this one: its own pace a token
        wait = max(wait, ahead / own * prefill)
    return Prediction(wait_s=wait, prefill_s=prefill, transfer_s=transfer_s(w, kv_bytes, prior),
                      decode_wait_s=decode_wait_s, in_flight_s=flight)
