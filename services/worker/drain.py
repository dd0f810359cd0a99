"""Draining a worker (SIGUSR1; `kvfleet up` sends it on a drain order, services/cli/fleet_orders.py):
no new work, the work it holds finishes, then it stops as on SIGTERM.

  1. its heartbeat stops and its Redis record is removed: routers stop placing on it once their
     worker list is re-read (services/router/service.py re-reads it within WORKERS_TTL_S);
  2. it keeps serving what it holds: running and queued sequences, KV reservations made for it
     (a decode stream whose prompt is still in prefill elsewhere), KV writes in flight;
  3. once all of these have been zero for QUIET_S in a row (a placement decided just before the
     record went is given time to arrive), or after DRAIN_LIMIT_S whatever it holds, it stops.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb

log = logging.getLogger(__name__)

QUIET_S = 2.0            # idle this long in a row: nothing more is on its way
DRAIN_LIMIT_S = 600.0    # a drain never holds the worker longer than this
POLL_S = 0.1


def holds_work(s: pb.WorkerStats) -> bool:
    return bool(s.num_running or s.num_queued or s.kv_blocks_reserved or s.kv_writes_in_flight
                or s.kv_blocks_held)


async def drain(stats: Callable[[], Awaitable[pb.WorkerStats]], leave: Callable[[], Awaitable[None]],
                clock: Callable[[], float] = time.monotonic, quiet_s: float = QUIET_S,
                limit_s: float = DRAIN_LIMIT_S) -> bool:
    """Leave the fleet (`leave`: stop beating, drop the record), then wait until `stats` shows
    nothing held for `quiet_s`. True: drained; False: `limit_s` passed first."""
    await leave()
    began = idle_since = clock()
    while clock() - began < limit_s:
        if holds_work(await stats()):
            idle_since = clock()
        elif clock() - idle_since >= quiet_s:
            return True
        await asyncio.sleep(POLL_S)
    return False
