"""A gateway's or router's heartbeat into the Redis registry (FleetState.heartbeat_service), the
way a worker beats its WorkerStats (services/worker/heartbeat.py: heartbeat_forever).

    beat = asyncio.create_task(beat_forever(state, record, every_s, ttl_s, log))
    ...
    await stop_beating(beat, state, record.service_id, log)     # at shutdown

A failed beat never ends the loop: Redis down is retried with capped, jittered backoff
(services/state/outage.py; logged at DEBUG, since the process's main Redis concern reports the
outage), and the first beat that lands re-registers the service, also into an empty new Redis.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time

from redis.exceptions import RedisError

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.state.fleet_state import FleetState
from services.state.outage import UNREACHABLE, Backoff, Outage


# At shutdown the record is removed within this (else it expires with its TTL): the 3-s stop
# budget must not wait on a dead Redis's connect timeout.
REMOVE_TIMEOUT_S = 0.5


def service_record(service_id: str, role: str, address: str, metrics_url: str = "") -> pb.ServiceRecord:
    """This process's record (its pid included); `updated_at_unix_s` is set at each beat."""
    return pb.ServiceRecord(service_id=service_id, role=role, address=address,
                            metrics_url=metrics_url, pid=os.getpid())


async def beat_forever(state: FleetState, record: pb.ServiceRecord, every_s: float, ttl_s: float,
                       log: logging.Logger) -> None:
    """Publish `record` every `every_s` (each beat lives `ttl_s`) until cancelled. Its outages
    are its own concern (a failed beat never puts the process's requests into backoff), logged
    at DEBUG: the gateway's quota store and the router's worker list report them, one warning
    per process."""
    redis = Outage(f"{record.role} {record.service_id} heartbeat", log,
                   Backoff(base_s=min(every_s, 0.5), cap_s=max(every_s, 2.0)), announce=False)
    broken = False                 # the last beat failed on something other than Redis
    while True:
        try:
            record.updated_at_unix_s = time.time()
            await redis.call(state.heartbeat_service, record, ttl_s)
            delay, broken = every_s, False
        except UNREACHABLE:
            delay = max(redis.retry_in(), 0.05)
        except Exception:  # noqa: BLE001 - a bad beat must not end the registration
            if not broken:         # one traceback per streak, not one per beat
                log.exception("%s %s: heartbeat failed", record.role, record.service_id)
            delay, broken = every_s, True
        await asyncio.sleep(delay)


async def stop_beating(beat: asyncio.Task, state: FleetState, service_id: str,
                       log: logging.Logger) -> None:
    """Cancel the loop and take the record out of Redis (Redis down: it expires with its TTL)."""
    beat.cancel()
    try:
        await beat
    except asyncio.CancelledError:
        pass
    try:
        await asyncio.wait_for(state.remove_service(service_id), REMOVE_TIMEOUT_S)
    except (RedisError, TimeoutError) as e:
        log.warning("could not remove %s from Redis at shutdown (it expires with its TTL): %r",
                    service_id, e)
