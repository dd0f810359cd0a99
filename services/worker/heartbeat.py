"""A worker's heartbeat: its stats into Redis every heartbeat_s, and its engine core's liveness
(an engine core silent past engine_stall_s takes the worker out of the fleet until it answers)."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.state.fleet_state import FleetState
from services.state.outage import UNREACHABLE, Backoff, Outage
from services.worker.config import WorkerConfig
from services.worker.engine_client import EngineFailed
from services.worker.servicer import WorkerServicer

log = logging.getLogger(__name__)


class _EngineStats:
    """This worker's stats as the engine core last answered them, with one call in flight at most.

    The core answers only between engine steps, so one long step (a big prefill on a loaded CPU)
    holds the answer back for as long as it runs. Invariants: `stats` is the last answer (None
    before the first); `answered_at` is when it came (the start before the first), so
    `silent_s()` is how long the core has kept the worker waiting."""

    def __init__(self, servicer: WorkerServicer, clock: Callable[[], float]) -> None:
        self._servicer, self._clock = servicer, clock
        self._call: asyncio.Future[pb.WorkerStats] | None = None
        self.stats: pb.WorkerStats | None = None
        self.answered_at = clock()

    async def take(self, wait_s: float) -> bool:
        """True when an answer came within `wait_s` (now in `stats`), False when the call is still
        in flight (it stays so: the next take waits on the same call). Raises what the call
        raised, EngineFailed included."""
        if self._call is None:
            self._call = asyncio.ensure_future(self._servicer.stats())
        done, _ = await asyncio.wait({self._call}, timeout=wait_s)
        if not done:
            return False
        call, self._call = self._call, None
        self.stats, self.answered_at = call.result(), self._clock()
        return True

    def silent_s(self) -> float:
        return self._clock() - self.answered_at

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()


async def heartbeat_forever(state: FleetState | None, servicer: WorkerServicer,
                            clock: Callable[[], float] = time.monotonic) -> None:
    """Every `heartbeat_s` until cancelled, take this worker's stats (the Stats RPC's message,
    which also refreshes its /metrics gauges) and publish them to Redis when there is one
    (`state`); each beat lives `heartbeat_ttl_s`.

    Liveness is not step length: one stats call to the engine core is in flight at a time, and a
    beat whose answer has not come (a step still running) publishes the last answer again: the
    worker is alive and its engine busy. Only once the core has been silent for `engine_stall_s`
    does the worker stop beating (one warning) and its Health answer NOT_SERVING: its record
    expires and it leaves the fleet until the core answers again (one info line; the next beat
    re-registers it). A core frozen for good is the supervisor's to restart (it probes Health). A dead engine core
    ends the loop: the worker is going down.

    A failed beat (Redis down, or anything else) never ends the loop: it is retried with capped,
    jittered backoff (one warning per outage, one info line on recovery), and the first beat that
    lands re-registers the worker, also into an empty new Redis."""
    config = servicer.config
    every_s, ttl_s = config.timeouts.heartbeat_s, config.timeouts.heartbeat_ttl_s
    redis = Outage(f"worker {config.worker_id} heartbeat", log,
                   Backoff(base_s=min(every_s, 0.5), cap_s=max(every_s, 2.0)))
    engine = _EngineStats(servicer, clock)
    broken = stalled = False       # the last beat failed on something other than Redis; ...
    try:                           # ... the core has been silent past engine_stall_s
        while True:
            began = clock()
            try:
                silent_s = engine.silent_s()
                fresh = await engine.take(every_s)
                stalled = _stall_changed(config, stalled, fresh, silent_s, engine.silent_s())
                servicer.engine_stalled = stalled      # Health answers NOT_SERVING meanwhile
                if state is not None and engine.stats is not None and not stalled:
                    engine.stats.updated_at_unix_s = time.time()      # this beat's time
                    await redis.call(state.heartbeat, engine.stats, ttl_s)
                delay, broken = every_s - (clock() - began), False
            except UNREACHABLE:
                delay = max(redis.retry_in(), 0.05)
            except EngineFailed:
                return
            except Exception:  # noqa: BLE001 - a bad beat must not end the worker's registration
                if not broken:         # one traceback per streak, not one per beat
                    log.exception("worker %s: heartbeat failed", config.worker_id)
                delay, broken = every_s - (clock() - began), True
            await asyncio.sleep(max(delay, 0.0))
    finally:
        engine.close()


def _stall_changed(config: WorkerConfig, stalled: bool, fresh: bool, silent_before_s: float,
                   silent_s: float) -> bool:
    """Whether the engine core counts as stalled after this beat's take, logging the change."""
    if fresh and stalled:
        log.info("worker %s: the engine core answered again after %.1f s; heartbeating again",
                 config.worker_id, silent_before_s)
        return False
    if not fresh and not stalled and silent_s > config.timeouts.engine_stall_s:
        log.warning("worker %s: the engine core has not answered for %.1f s (engine_stall_s "
                    "%g); heartbeat stopped: the worker leaves the fleet until it answers",
                    config.worker_id, silent_s, config.timeouts.engine_stall_s)
        return True
    return stalled
