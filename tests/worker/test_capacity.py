"""A worker's capacity notifications (services/worker/capacity.py) over a real Redis: freed KV
is published on `{ns}capacity`, a burst of endings as one message with their sum, and a worker
without Redis publishes nothing and never blocks."""
from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from services.state.wait_queue import WaitQueue
from services.worker.capacity import CapacityNotifier


def test_a_burst_of_endings_reaches_a_subscribed_router_as_freed_blocks(redis_url, redis_ns):
    async def story():
        r = aioredis.Redis.from_url(redis_url, decode_responses=True)
        queue = WaitQueue(r, redis_ns)
        notifier = CapacityNotifier(queue)
        subscribed = asyncio.Event()
        got: list[int] = []

        async def listen():
            async for freed in queue.notifications(on_subscribed=subscribed.set):
                got.append(freed)

        listener = asyncio.ensure_future(listen())
        publisher = asyncio.ensure_future(notifier.run())
        try:
            await asyncio.wait_for(subscribed.wait(), 10)
            for blocks in (3, 4, 5):          # in one go: the publisher sends what accumulated
                notifier.freed(blocks)
            async with asyncio.timeout(10):
                while sum(got) < 12:
                    await asyncio.sleep(0.01)
            assert sum(got) == 12 and len(got) <= 3
        finally:
            for task in (listener, publisher):
                task.cancel()
            await asyncio.gather(listener, publisher, return_exceptions=True)
            await r.aclose()
    asyncio.run(story())


def test_a_worker_without_redis_counts_nothing():
    notifier = CapacityNotifier(None)
    notifier.freed(10)                # synchronous, no loop needed, nothing pending
    assert notifier.pending == 0
