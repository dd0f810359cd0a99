"""Model pools: the primary pool and the fallback pool (DESIGN.md section 6, stage S3).

Every worker heartbeats its pool (`WorkerStats.pool`, "" = primary) and its quality version. A
request goes to the fallback pool when all of these hold, else to the primary:

  * the fleet's stage (the Redis record every router's stage keeper follows:
    services/router/keeper.py, services/state/stage_record.py) is S3_FALLBACK or higher;
  * the gateway marked it `degradable`: its traffic class may degrade and its tenant is not
    critical (the gateway knows both; the router holds no tenant or class config);
  * the fallback pool has a live worker of every role this mode needs.

Placement then sees the chosen pool's workers only, so the prefill and decode workers of one
request are always in the same pool (their KV layouts differ between models).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb

PRIMARY, FALLBACK = "primary", "fallback"


def pool_of(w: pb.WorkerStats) -> str:
    return w.pool or PRIMARY


def in_pool(workers: Iterable[pb.WorkerStats], pool: str) -> list[pb.WorkerStats]:
    return [w for w in workers if pool_of(w) == pool]


def choose_pool(workers: Sequence[pb.WorkerStats], stage: int, degradable: bool,
                needed_roles: set[str]) -> str:
    """The pool that serves a request (module docstring)."""
    if stage >= pb.S3_FALLBACK and degradable and needed_roles <= {
            w.role for w in in_pool(workers, FALLBACK)}:
        return FALLBACK
    return PRIMARY


def served_by(plan: pb.Plan, workers: Sequence[pb.WorkerStats], pool: str) -> pb.Plan:
    """`plan` naming its pool, and the model and quality version of its first prefill worker."""
    plan.pool = pool
    first = next((w for w in workers if plan.prefill and w.worker_id == plan.prefill[0].worker_id),
                 None)
    if first is not None:
        plan.model, plan.quality_version = first.model, first.quality_version
    return plan
