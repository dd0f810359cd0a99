"""The admission wait queue in Redis: requests that cannot be admitted now but can still make
their deadline wait here, shared by every router, ordered by deadline within a class.

Keys (`ns` the namespace):

| key                          | type   | TTL                         | written by                    |
|------------------------------|--------|-----------------------------|-------------------------------|
| `{ns}waitq:{class}`          | zset   | none; members pruned        | enqueue / leave (the router)  |
| `{ns}waitq:at:{class}`       | zset   | none; members pruned        | enqueue / leave: enqueue time |
| `{ns}capacity`               | pub/sub channel                      | decode and mixed workers, routers |

A member is a request id scored by its deadline (unix s). Invariants: a request is in the queue
only while its router waits for it (the router removes it when it admits, refuses, or its caller
goes); a member whose deadline is past is pruned by the next reader, so a router that died
leaves nothing behind for longer than its requests' deadlines. The queue's age (the `queue_age`
stage signal) is now minus the oldest enqueue time of a live member.

Wake-ups: a worker that frees KV (a sequence ended, a reservation released) publishes on
`{ns}capacity`; every router subscribed wakes its waiters, and each tries only while its request
is among the first `wake_width` of its class (so waiters are admitted in deadline order across
routers). Pub/sub is at-most-once: routers also retry on a slow timer, as a safety net.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import redis.asyncio as aioredis

log = logging.getLogger(__name__)

CLOSE_S = 1.0      # a subscription's close waits at most this long


@dataclass(frozen=True, slots=True)
class QueueDepth:
    traffic_class: str
    waiting: int
    oldest_age_s: float


# KEYS[1] deadlines zset, KEYS[2] enqueue-time zset; ARGV now. Drops members past their
# deadline from both; returns how many.
_PRUNE_LUA = """
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
for _, m in ipairs(gone) do redis.call('ZREM', KEYS[2], m) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
return #gone
"""


class WaitQueue:
    def __init__(self, redis: aioredis.Redis, namespace: str = "kvfleet:") -> None:
        """`redis` must decode responses (str)."""
        self._r = redis
        self.ns = namespace
        self.channel = f"{namespace}capacity"
        self._prune = redis.register_script(_PRUNE_LUA)

    def _keys(self, cls: str) -> tuple[str, str]:
        return f"{self.ns}waitq:{cls}", f"{self.ns}waitq:at:{cls}"

    async def enqueue(self, request_id: str, cls: str, deadline_unix_s: float,
                      now_unix_s: float) -> None:
        by_deadline, by_time = self._keys(cls)
        async with self._r.pipeline(transaction=True) as p:
            p.zadd(by_deadline, {request_id: deadline_unix_s})
            p.zadd(by_time, {request_id: now_unix_s})
            await p.execute()

    async def leave(self, request_id: str, cls: str) -> None:
        by_deadline, by_time = self._keys(cls)
        async with self._r.pipeline(transaction=True) as p:
            p.zrem(by_deadline, request_id)
            p.zrem(by_time, request_id)
            await p.execute()

    async def position(self, request_id: str, cls: str, now_unix_s: float) -> int | None:
        """0-based place in its class by deadline (None: not queued, e.g. pruned)."""
        by_deadline, by_time = self._keys(cls)
        await self._prune(keys=[by_deadline, by_time], args=[repr(now_unix_s)])
        return await self._r.zrank(by_deadline, request_id)

    async def depth(self, cls: str, now_unix_s: float) -> QueueDepth:
        by_deadline, by_time = self._keys(cls)
        await self._prune(keys=[by_deadline, by_time], args=[repr(now_unix_s)])
        async with self._r.pipeline(transaction=False) as p:
            p.zcard(by_deadline)
            p.zrange(by_time, 0, 0, withscores=True)
            waiting, oldest = await p.execute()
        age = max(0.0, now_unix_s - oldest[0][1]) if oldest else 0.0
        return QueueDepth(cls, int(waiting), age)

    async def waiting(self, cls: str) -> int:
        """Members of a class, unpruned (one command: for the admission path)."""
        return int(await self._r.zcard(self._keys(cls)[0]))

    async def notify(self, freed_blocks: int = 1) -> None:
        """Tell every waiting router that capacity freed (`freed_blocks` KV blocks)."""
        await self._r.publish(self.channel, str(int(freed_blocks)))

    async def notifications(self, on_subscribed=None) -> AsyncIterator[int]:
        """Freed-block counts as workers publish them, until cancelled (a subscription of its
        own; the caller reconnects after a Redis error). `on_subscribed()` is called once the
        subscription is live."""
        pubsub = self._r.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(self.channel)
        if on_subscribed is not None:
            on_subscribed()
        try:
            while True:
                msg = await pubsub.get_message(timeout=1.0)
                if asyncio.current_task().cancelling():   # a read may swallow a cancel
                    raise asyncio.CancelledError()
                if msg is None:
                    continue
                try:
                    yield int(msg["data"])
                except ValueError:
                    log.warning("ignored a capacity notification that is not a count: %r",
                                msg["data"])
        finally:     # bounded: a pool closed under it must not hang a cancelled task
            await asyncio.wait([asyncio.ensure_future(pubsub.aclose())], timeout=CLOSE_S)
