"""The fleet's stage record in Redis (the real server and the embedded one): every router reads
the same stage, and two routers deciding at once change it once."""
from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from services.state.stage_record import StageRecord, StageStore


def run(url: str, ns: str, scenario):
    async def main():
        r = aioredis.Redis.from_url(url, decode_responses=True)
        try:
            return await scenario(StageStore(r, ns), r)
        finally:
            await r.aclose()
    return asyncio.run(main())


def test_a_new_fleet_reads_s0(any_redis_url, redis_ns):
    async def scenario(store, _):
        assert await store.read() == StageRecord()
    run(any_redis_url, redis_ns, scenario)


def test_a_change_is_read_back_by_everyone(any_redis_url, redis_ns):
    async def scenario(store, _):
        seen = await store.read()
        new = await store.change(seen, 2, 1000.5, "enter: kv_reserved", "router-0")
        assert new == StageRecord(2, 1000.5, "enter: kv_reserved", "router-0", 1)
        assert await store.read() == new
    run(any_redis_url, redis_ns, scenario)


def test_two_routers_deciding_from_the_same_record_change_it_once(any_redis_url, redis_ns):
    async def scenario(store, _):
        seen = await store.read()
        results = await asyncio.gather(store.change(seen, 1, 10.0, "a", "router-0"),
                                       store.change(seen, 1, 10.1, "b", "router-1"))
        assert sum(r is not None for r in results) == 1
        assert (await store.read()).version == 1
    run(any_redis_url, redis_ns, scenario)


def test_a_stage_outside_s0_s4_is_refused_and_a_corrupt_record_reads_as_s0(any_redis_url, redis_ns):
    async def scenario(store, r):
        with pytest.raises(ValueError, match="S0..S4"):
            await store.change(StageRecord(), 7, 0.0, "", "x")
        await r.hset(store.key, mapping={"stage": "9", "version": "3"})
        rec = await store.read()
        assert rec.stage == 0 and rec.version == 3     # a later change still compares versions
        assert await store.change(StageRecord(version=2), 1, 0.0, "", "x") is None
        assert await store.change(rec, 1, 0.0, "", "x") is not None
    run(any_redis_url, redis_ns, scenario)
