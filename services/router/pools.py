"""Model pools: the primary pool and the fallback pool (DESIGN.md section 6, stage S3).

Every worker heartbeats its pool (`WorkerStats.pool`, "" = primary) and its quality version. A
request goes to the fallback pool when all of these hold, else to the primary:

  * the fleet's stage (the Redis record every router reads: services/state/stage_record.py) is
    S3_FALLBACK or higher;
  * the gateway marked it `degradable`: its traffic class may degrade and its tenant is not
    critical (the gateway knows both; the router holds no tenant or class config);
  * the fallback pool has a live worker of every role this mode needs.

Placement then sees the chosen pool's workers only, so the prefill and decode workers of one
request are always in the same pool (their KV layouts differ between models).
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.state.outage import UNREACHABLE, Outage
from services.state.stage_record import StageStore

PRIMARY, FALLBACK = "primary", "fallback"
STAGE_TTL_S = 0.25          # the stage record is re-read at most this often


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


class StageView:
    """The fleet's stage as this router last read it: at most one Redis read per STAGE_TTL_S,
    through `outage` (the router's view of Redis: no wait on it while its backoff runs). Redis
    unreachable: the last stage read stands (S0 before any); `outage` logs it."""

    def __init__(self, store: StageStore, outage: Outage, clock=time.monotonic) -> None:
        self.store = store
        self.outage = outage
        self.clock = clock
        self._at, self._stage = float("-inf"), pb.S0_NORMAL

    async def current(self) -> int:
        if self.clock() - self._at < STAGE_TTL_S:
            return self._stage
        try:
            self._stage = (await self.outage.call(self.store.read)).stage
        except UNREACHABLE:
            pass
        self._at = self.clock()
        return self._stage
