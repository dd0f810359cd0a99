"""The router's worker list (real Redis): placing a request never waits on Redis while the list is
fresh enough; a stale list is replaced in the background; a list missing a needed role, or one
that led to a failed worker, is re-read before the next placement."""
from __future__ import annotations

import asyncio

from services.state.fleet_state import FleetState
from services.router import service
from services.router.service import RouterServicer
from tests.state.test_fleet_state import make_record, run


def ids(workers) -> list[str]:
    return [w.worker_id for w in workers]


def run_router(url: str, ns: str, monkeypatch, mode: str, ttl_s: float, max_age_s: float,
               scenario) -> None:
    """scenario(state, router) against real Redis, with the list's ages set for the test."""
    monkeypatch.setattr(service, "WORKERS_TTL_S", ttl_s)
    monkeypatch.setattr(service, "WORKERS_MAX_AGE_S", max_age_s)

    async def with_router(fs: FleetState):
        router = RouterServicer(fs, mode)
        try:
            await scenario(fs, router)
        finally:
            await router.close()

    run(url, ns, with_router)


def test_a_stale_list_is_served_while_a_background_read_replaces_it(any_redis_url, redis_ns,
                                                                     monkeypatch):
    async def scenario(fs: FleetState, router: RouterServicer):
        await fs.heartbeat(make_record("m0", "mixed"), ttl_s=30)
        assert ids(await router.live_workers()) == ["m0"]            # first call: read at once
        await fs.heartbeat(make_record("m1", "mixed"), ttl_s=30)
        assert ids(await router.live_workers()) == ["m0"]            # fresh: no read
        await asyncio.sleep(0.1)
        assert ids(await router.live_workers()) == ["m0"]            # stale: served, read started
        await asyncio.sleep(0.1)
        assert ids(await router.live_workers()) == ["m0", "m1"]      # the read has landed

    run_router(any_redis_url, redis_ns, monkeypatch, "colocated", 0.05, 30.0, scenario)


def test_a_list_too_old_or_missing_a_role_is_read_before_placing(any_redis_url, redis_ns,
                                                                 monkeypatch):
    async def scenario(fs: FleetState, router: RouterServicer):
        await fs.heartbeat(make_record("p0", "prefill"), ttl_s=30)
        assert ids(await router.live_workers()) == ["p0"]
        await fs.heartbeat(make_record("d0", "decode"), ttl_s=30)
        assert ids(await router.live_workers()) == ["d0", "p0"]      # no decode role: re-read
        await fs.heartbeat(make_record("d1", "decode"), ttl_s=30)
        assert ids(await router.live_workers()) == ["d0", "p0"]      # complete and fresh
        await asyncio.sleep(0.1)
        assert ids(await router.live_workers()) == ["d0", "d1", "p0"]   # too old: re-read

    run_router(any_redis_url, redis_ns, monkeypatch, "disagg", 30.0, 0.05, scenario)
