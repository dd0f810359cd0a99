"""Placement: which prefill and decode replicas serve a request (DESIGN.md section 3, step 2).

Pure functions over the `pb.WorkerStats` workers heartbeat into Redis (services/state/fleet_state.py).
A worker whose heartbeat went stale has no record there (its key's TTL ran out), so it is never a
candidate; staleness is Redis's TTL, not a clock compared here.

  prefill: cost = w * uncached_prompt_blocks + queued_prefill_tokens     (lowest first)
  decode:  most free unreserved KV blocks first, then the smaller batch  (num_running),
           both less what routers placed there since the worker's beat  (`Placed`)
  ties:    the worker ids in a ring, starting at `turn`: a router turns it once a placement, so
           equal replicas alternate instead of the lowest id taking every tie

A beat stays the same for heartbeat_s (0.5 s): without `Placed`, a burst of requests within one beat
would all see the same best replica. `Placed` is what was placed on a worker since the beat the ranking
reads: this router's own placements at once, the fleet's through Redis (services/router/placements.py).

"Free unreserved" is what a new reservation can still take: blocks free, less those promised to
reservations and those held back for writes that may still land (`kv_blocks_held`).

KV pages a request needs (`kv_blocks_needed`): the decode worker's own arithmetic
(services/engine/admission.py, blocks_for_samples): n > 1 samples share the prompt's full
blocks, so the prompt counts once and each sample adds its own blocks (its copy of a partial last
prompt block, and its output). A replica whose whole pool is smaller is never asked.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.engine.admission import blocks_for_samples
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb

PREFILL_BLOCK_WEIGHT = 16.0   # tokens of queue one uncached prompt block is worth


@dataclass(frozen=True)
class Placed:
    """Placed on one worker since its beat: KV blocks asked for, and streams."""
    blocks: int = 0
    streams: int = 0


NOTHING = Placed()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def prefill_cost(w: pb.WorkerStats, prompt_tokens: int) -> float:
    """No prefix index yet: every prompt block counts as uncached."""
    return PREFILL_BLOCK_WEIGHT * cdiv(prompt_tokens, max(1, w.block_size)) + w.queued_prefill_tokens


def free_unreserved_blocks(w: pb.WorkerStats) -> int:
    return max(0, w.kv_blocks_free - w.kv_blocks_reserved - w.kv_blocks_held)


def kv_blocks_needed(w: pb.WorkerStats, prompt_tokens: int, params: pb.SamplingParams) -> int:
    """Blocks a reservation on `w` takes: prompt + max_tokens (the gateway clamped it to the
    class's output cap) per sample, within the context, the prompt's full blocks once."""
    block_size = max(1, w.block_size)
    tokens = prompt_tokens + params.max_tokens
    if w.max_model_len:
        tokens = min(tokens, w.max_model_len)
    return blocks_for_samples(prompt_tokens, tokens, max(1, params.n), block_size)


def can_ever_hold(w: pb.WorkerStats, prompt_tokens: int, params: pb.SamplingParams) -> bool:
    return not w.kv_blocks_total or kv_blocks_needed(w, prompt_tokens, params) <= w.kv_blocks_total


def ring(workers: Sequence[pb.WorkerStats], turn: int) -> dict[str, int]:
    """Each worker's place in the tie order: ids sorted, the ring started at `turn`."""
    ordered = sorted(w.worker_id for w in workers)
    return {wid: (i - turn) % len(ordered) for i, wid in enumerate(ordered)}


def rank_prefill(workers: Sequence[pb.WorkerStats], prompt_tokens: int,
                 turn: int = 0) -> list[pb.WorkerStats]:
    """Prefill candidates, best first."""
    mine = [w for w in workers if w.role == "prefill"]
    tie = ring(mine, turn)
    return sorted(mine, key=lambda w: (prefill_cost(w, prompt_tokens), tie[w.worker_id]))


def room_after(w: pb.WorkerStats, placed: Placed) -> tuple[int, int]:
    """(free unreserved blocks, batch size) once what was placed since the beat is counted."""
    return max(0, free_unreserved_blocks(w) - placed.blocks), w.num_running + placed.streams


def rank_decode(workers: Sequence[pb.WorkerStats], role: str = "decode",
                placed: Mapping[str, Placed] | None = None, turn: int = 0) -> list[pb.WorkerStats]:
    """Decode (or co-located `mixed`) candidates, best first. `placed`: by worker id."""
    placed = placed or {}
    mine = [w for w in workers if w.role == role]
    tie = ring(mine, turn)

    def key(w):
        free, running = room_after(w, placed.get(w.worker_id, NOTHING))
        return -free, running, tie[w.worker_id]
    return sorted(mine, key=key)
