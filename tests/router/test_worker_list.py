"""The router's worker list (real Redis, a driven clock): placing a request never waits on Redis while
the list is fresh enough; a stale list is replaced in the background; a list missing a needed role,
or one too old, is re-read before the next placement."""
from __future__ import annotations

import asyncio
import time

from services.router import service
from services.router.service import RouterServicer
from services.state.fleet_state import FleetState
from tests.state.test_fleet_state import make_stats, run


class Clock:
    """Stands in for the `time` module inside services/router/service.py: `monotonic()` is driven
    by the test, everything else is the real module's."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str):
        return getattr(time, name)


def ids(workers) -> list[str]:
    return [w.worker_id for w in workers]


async def lands(router: RouterServicer, expected: list[str], timeout_s: float = 5.0) -> bool:
    """The router's list becomes `expected` (a background read landing) within timeout_s, without
    the clock moving."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ids(await router.live_workers()) == expected:
            return True
        await asyncio.sleep(0.005)
    return False


def run_router(url: str, ns: str, monkeypatch, mode: str, scenario) -> None:
    """scenario(state, router, clock) against real Redis, the router's clock driven by the test."""
    clock = Clock()
    monkeypatch.setattr(service, "time", clock)

    async def with_router(fs: FleetState):
        router = RouterServicer(fs, mode)
        try:
            await scenario(fs, router, clock)
        finally:
            await router.close()

    run(url, ns, with_router)


def test_a_stale_list_is_served_while_a_background_read_replaces_it(any_redis_url, redis_ns,
                                                                     monkeypatch):
    async def scenario(fs: FleetState, router: RouterServicer, clock: Clock):
        await fs.heartbeat(make_stats("m0", "mixed"), ttl_s=30)
        assert ids(await router.live_workers()) == ["m0"]            # first call: read at once
        await fs.heartbeat(make_stats("m1", "mixed"), ttl_s=30)
        assert ids(await router.live_workers()) == ["m0"]            # fresh: no read
        clock.now += service.WORKERS_TTL_S * 1.5
        assert ids(await router.live_workers()) == ["m0"]            # stale: served, read started
        assert await lands(router, ["m0", "m1"])                     # the read has landed

    run_router(any_redis_url, redis_ns, monkeypatch, "colocated", scenario)


def test_a_list_too_old_or_missing_a_role_is_read_before_placing(any_redis_url, redis_ns,
                                                                 monkeypatch):
    async def scenario(fs: FleetState, router: RouterServicer, clock: Clock):
        await fs.heartbeat(make_stats("p0", "prefill"), ttl_s=30)
        assert ids(await router.live_workers()) == ["p0"]
        await fs.heartbeat(make_stats("d0", "decode"), ttl_s=30)
        assert ids(await router.live_workers()) == ["d0", "p0"]      # no decode role: re-read
        await fs.heartbeat(make_stats("d1", "decode"), ttl_s=30)
        assert ids(await router.live_workers()) == ["d0", "p0"]      # complete and fresh
        clock.now += service.WORKERS_MAX_AGE_S * 1.5
        assert ids(await router.live_workers()) == ["d0", "d1", "p0"]   # too old: re-read

    run_router(any_redis_url, redis_ns, monkeypatch, "disagg", scenario)
