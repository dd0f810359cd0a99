"""Placement: which prefill and decode replicas serve a request (DESIGN.md section 3, step 2).

Pure functions over the capacity records workers heartbeat into Redis; a worker whose heartbeat
went stale has no record, so it is never a candidate.

  prefill: cost = w * uncached_prompt_blocks + queued_prefill_tokens   (lowest first)
  decode:  most free unreserved KV blocks first, then the smaller batch
"""
from __future__ import annotations

from collections.abc import Sequence

from services.state.fleet_state import WorkerRecord

PREFILL_BLOCK_WEIGHT = 16.0   # tokens of queue one uncached prompt block is worth


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rank_prefill(workers: Sequence[WorkerRecord], prompt_tokens: int) -> list[WorkerRecord]:
    """Prefill candidates, best first. No prefix index yet: every prompt block counts as uncached."""
    def cost(w: WorkerRecord) -> float:
        return PREFILL_BLOCK_WEIGHT * cdiv(prompt_tokens, w.block_size) + w.queued_prefill_tokens
    return sorted((w for w in workers if w.role == "prefill"), key=lambda w: (cost(w), w.worker_id))


def rank_decode(workers: Sequence[WorkerRecord], role: str = "decode") -> list[WorkerRecord]:
    """Decode (or co-located `mixed`) candidates, best first."""
    def key(w: WorkerRecord):
        return (-(w.kv_blocks_free - w.kv_blocks_reserved), w.running, w.worker_id)
    return sorted((w for w in workers if w.role == role), key=key)
