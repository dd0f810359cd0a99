"""Placement: which prefill and decode replicas serve a request (DESIGN.md section 3, step 2).

Pure functions over the `pb.WorkerStats` workers heartbeat into Redis (services/state/fleet_state.py).
A worker whose heartbeat went stale has no record there (its key's TTL ran out), so it is never a
candidate; staleness is Redis's TTL, not a clock compared here.

  prefill: the DESIGN's token score: prefill tokens queued ahead there, plus the prompt tokens
           the worker does not hold in its prefix cache (`cached`, by worker id: the router's
           prefix index, services/router/prefix_index.py)                      (lowest first)
  decode:  most free unreserved KV blocks first, then the smaller batch  (num_running),
           both less what routers placed there since the worker's beat  (`Placed`)
  mixed:   as decode, but a worker holding more of the prompt's prefix comes first while it has
           room for the request (`rank_mixed`)
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
from services.router.predict import free_unreserved_blocks, queued_ahead


@dataclass(frozen=True)
class Placed:
    """Placed on one worker since its beat: KV blocks asked for, and streams."""
    blocks: int = 0
    streams: int = 0


NOTHING = Placed()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def prefill_score(w: pb.WorkerStats, prompt_tokens: int, cached_tokens: int = 0) -> int:
    """The ranking's score of `w` for a prompt (DESIGN section 3): the prefill tokens queued there
    plus the prompt tokens it does not hold. Token counts, never the worker's own rates: its fitted
    step cost has a fixed term that differs from worker to worker by measurement noise (a
    simulated engine's has no per-token term at all), and its drain rate is its prior's until it
    has run a few prefill steps, then whatever the prompts it happened to serve drained at (short
    prompts drain slowly), so two workers' rates are not comparable and a prior beside a
    measurement hid the prefix a worker held. The admission decision prices the chosen worker
    with the full prediction (services/router/predict.py)."""
    return queued_ahead(w) + max(0, prompt_tokens - cached_tokens)


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


def rank_prefill(workers: Sequence[pb.WorkerStats], prompt_tokens: int, turn: int = 0,
                 cached: Mapping[str, int] | None = None) -> list[pb.WorkerStats]:
    """Prefill candidates, best first. `cached`: leading prompt tokens each holds, by worker id."""
    cached = cached or {}
    mine = [w for w in workers if w.role == "prefill"]
    tie = ring(mine, turn)
    return sorted(mine, key=lambda w: (prefill_score(w, prompt_tokens, cached.get(w.worker_id, 0)),
                                       tie[w.worker_id]))


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


def rank_mixed(workers: Sequence[pb.WorkerStats], needed_blocks: int,
               placed: Mapping[str, Placed] | None = None, turn: int = 0,
               cached: Mapping[str, int] | None = None) -> list[pb.WorkerStats]:
    """Co-located candidates, best first: more of the prompt's prefix held first among those with
    room for `needed_blocks` (after what was placed since their beat), then as `rank_decode`."""
    placed, cached = placed or {}, cached or {}
    ranked = rank_decode(workers, "mixed", placed, turn)
    order = {w.worker_id: i for i, w in enumerate(ranked)}

    def key(w):
        free, _ = room_after(w, placed.get(w.worker_id, NOTHING))
        held = cached.get(w.worker_id, 0) if free >= needed_blocks else 0
        return -held, order[w.worker_id]
    return sorted(ranked, key=key)
