"""A long engine step does not take a live worker out of the fleet; a stalled engine core does.

The engine core answers the heartbeat's stats only between steps, so one step longer than
`heartbeat_ttl_s` (a 512-token prefill of a real model on a loaded CPU) used to let the worker's
Redis record expire: the router stopped placing work on a live, busy worker. Now the heartbeat
publishes the last stats it has while the step runs, for `engine_stall_s` at most.

A real fleet on 127.0.0.1 per test (a colocated router and one mixed worker on the tiny model,
heartbeat 0.5 s living 1.5 s, the defaults), the slow step injected into the worker's first
engine step (KVFLEET_FAULT_ENGINE_SLOW_STEP, services/worker/faults.py). The durations below are
deadlines, not assertions on speed.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import redis

from services.cli.launcher import Launcher
from tests.waiting import wait_until
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.state.fleet_state import FleetState
from services.worker.faults import ENGINE_SLOW_STEP
from tests.harness import Fleet, route_request

WORKER = "mixed-0"
HEARTBEAT = ("--timeout-heartbeat-s", "0.5", "--timeout-heartbeat-ttl-s", "1.5")
START_S = 60.0
_db = itertools.count(11)


@contextlib.contextmanager
def slow_fleet(redis_url: str, model: str, slow_step_s: float, *worker_args: str):
    """A colocated fleet whose worker's first engine step sleeps `slow_step_s` first; stopped
    (every process) on the way out."""
    launcher = Launcher(env={ENGINE_SLOW_STEP: f"1:{slow_step_s}"})
    fleet = Fleet(launcher, f"{redis_url.rsplit('/', 1)[0]}/{next(_db)}")
    redis.Redis.from_url(fleet.redis_url).flushdb()
    try:
        fleet.worker(WORKER, "mixed", model, extra_args=(*HEARTBEAT, *worker_args))
        fleet.start_router("colocated")
        assert wait_until(lambda: fleet.router_stub().Health(pb.HealthRequest()).status ==
                          pb.HealthResponse.SERVING, START_S)
        yield fleet
    finally:
        fleet.close()
        launcher.stop_all()


def is_live(fleet: Fleet) -> bool:
    async def read() -> bool:
        async with FleetState(fleet.redis_url) as state:
            return WORKER in [w.worker_id for w in await state.live_workers()]
    return asyncio.run(read())


def send(fleet: Fleet, pool: ThreadPoolExecutor) -> Future:
    """One 8-token request through the fleet, run on `pool`: its chunks, once it ends."""
    call = fleet.generate(route_request("slow-1", list(range(1, 33)), max_tokens=8))
    return pool.submit(lambda: list(call))


def generated(chunks) -> int:
    return sum(len(c.token_ids) for c in chunks)


def log_count(fleet: Fleet, text: str) -> int:
    return Path(fleet.launcher.log_path(WORKER)).read_text(errors="replace").count(text)


def test_a_step_longer_than_the_heartbeat_ttl_keeps_the_worker_in_the_fleet(redis_url,
                                                                             tiny_model_dir):
    """A 4-s step (the TTL is 1.5 s): every look at Redis while it runs finds the worker live,
    and the request completes."""
    slow_s = 4.0
    with slow_fleet(redis_url, str(tiny_model_dir), slow_s) as fleet, \
            ThreadPoolExecutor(1) as pool:
        assert wait_until(lambda: is_live(fleet), 10)
        began = time.monotonic()
        result = send(fleet, pool)
        looks, deadline = [], began + 60
        while not result.done():             # one look at Redis per 0.1 s until the request ends
            looks.append(is_live(fleet))
            futures.wait([result], timeout=0.1)
            assert time.monotonic() < deadline, "the request did not complete within 60 s"
        ran_s = time.monotonic() - began
        assert generated(result.result(timeout=0)) == 8
        assert ran_s >= slow_s, "the injected slow step did not run"
        assert len(looks) >= 10 and all(looks), looks
        assert log_count(fleet, "heartbeat stopped") == 0


def test_an_engine_core_silent_past_engine_stall_s_leaves_the_fleet_until_it_answers(
        redis_url, tiny_model_dir):
    """engine_stall_s 2 s and an 8-s step: the worker stops beating and leaves the live list
    while the step runs (one warning), comes back once the core answers (one info line), and the
    request completes."""
    slow_s = 8.0
    with slow_fleet(redis_url, str(tiny_model_dir), slow_s,
                    "--timeout-engine-stall-s", "2") as fleet, ThreadPoolExecutor(1) as pool:
        assert wait_until(lambda: is_live(fleet), 10)
        result = send(fleet, pool)
        assert wait_until(lambda: not is_live(fleet), slow_s), "still live during the stall"
        assert not result.done()             # it left while the step still ran
        assert generated(result.result(timeout=60)) == 8
        assert wait_until(lambda: is_live(fleet), 10), "not back after the core answered"
        assert wait_until(lambda: log_count(fleet, "answered again") == 1, 5)
        assert log_count(fleet, "heartbeat stopped") == 1
