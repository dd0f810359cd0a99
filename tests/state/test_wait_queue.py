"""The admission wait queue in Redis (the real server and the embedded one): deadline order within
a class, nothing left behind past a deadline, and capacity notifications reaching a waiter."""
from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from services.state.wait_queue import QueueDepth, WaitQueue


def run(url: str, ns: str, scenario):
    async def main():
        r = aioredis.Redis.from_url(url, decode_responses=True)
        try:
            return await scenario(WaitQueue(r, ns))
        finally:
            await r.aclose()
    return asyncio.run(main())


def test_waiters_are_ordered_by_deadline_within_their_class(any_redis_url, redis_ns):
    async def scenario(q):
        await q.enqueue("late", "interactive", deadline_unix_s=130.0, now_unix_s=100.0)
        await q.enqueue("soon", "interactive", deadline_unix_s=101.0, now_unix_s=100.5)
        await q.enqueue("doc", "document", deadline_unix_s=110.0, now_unix_s=99.0)
        assert await q.position("soon", "interactive", 100.6) == 0
        assert await q.position("late", "interactive", 100.6) == 1
        assert await q.position("doc", "document", 100.6) == 0
        depth = await q.depth("interactive", 100.6)
        assert (depth.waiting, round(depth.oldest_age_s, 6)) == (2, 0.6)
    run(any_redis_url, redis_ns, scenario)


def test_a_waiter_past_its_deadline_is_pruned_and_leave_removes_one(any_redis_url, redis_ns):
    async def scenario(q):
        await q.enqueue("a", "batch", 105.0, 100.0)
        await q.enqueue("b", "batch", 200.0, 101.0)
        depth = await q.depth("batch", 106.0)          # "a" is past its deadline: gone
        assert (depth.waiting, depth.oldest_age_s) == (1, 5.0)
        assert await q.position("a", "batch", 106.0) is None
        await q.leave("b", "batch")
        assert await q.depth("batch", 106.0) == QueueDepth("batch", 0, 0.0)
    run(any_redis_url, redis_ns, scenario)


def test_a_capacity_notification_reaches_a_subscribed_router(any_redis_url, redis_ns):
    async def scenario(q):
        got = asyncio.get_running_loop().create_future()

        async def listen():
            async for freed in q.notifications():
                got.set_result(freed)
                return
        task = asyncio.create_task(listen())
        # publish until the subscription is live (a publish before it reaches no one)
        async with asyncio.timeout(10):
            while not got.done():
                await q.notify(6)
                await asyncio.wait([got], timeout=0.05)
        assert got.result() == 6
        await task
    run(any_redis_url, redis_ns, scenario)
