"""The admission wait queue in Redis: requests that cannot be admitted now but can still make
their deadline wait here, shared by every router, in a tenant-fair order within a class
(services/router/fair_order.py: protected waiters first by deadline, then start-time fair
queuing over tenants, each tenant's waiters by deadline).

Keys (`ns` the namespace):

| key                            | type   | holds                                          |
|--------------------------------|--------|------------------------------------------------|
| `{ns}waitq:{class}`            | zset   | every waiter, by deadline (pruned past it)     |
| `{ns}waitq:at:{class}`         | zset   | every waiter, by enqueue time                  |
| `{ns}waitq:first:{class}`      | zset   | protected waiters, by deadline                 |
| `{ns}waitq:t:{class}:{tenant}` | zset   | a tenant's other waiters, by deadline          |
| `{ns}waitq:who:{class}`        | hash   | waiter -> its tenant (not protected)           |
| `{ns}waitq:n:{class}`          | hash   | tenant -> its waiters (fields at 0 deleted)    |
| `{ns}waitq:v:{class}`          | string | the class's virtual time (fair_order.py)       |
| `{ns}waitq:vt:{class}`         | hash   | tenant -> its virtual service                  |
| `{ns}capacity`                 | pubsub | freed KV blocks: decode and mixed workers      |

None has a TTL: waiters are pruned past their deadline; `v` and `vt` hold one number per class
and tenant. The router writes all but `{ns}capacity`.

A member is a request id scored by its deadline (unix s). Enqueue, leave, prune and an
admission's charge (`admitted`) are one Lua script each, so every router sees each change whole.
The order itself (start tags, ties, what is ahead) is computed by services/router/fair_order.py
from what these keys hold, for the routers and the simulator alike; the charge's one line of
arithmetic is the only part mirrored in Lua (and a property test holds both queues to the same
order). Invariants: a request is in the queue
only while its router waits for it (the router removes it when it admits, refuses, or its caller
goes); a member whose deadline is past is pruned by the next reader, so a router that died
leaves nothing behind for longer than its requests' deadlines. The queue's age (the `queue_age`
stage signal) is now minus the oldest enqueue time of a live member.

Wake-ups: a worker that frees KV (a sequence ended, a reservation released) publishes on
`{ns}capacity`; every router subscribed wakes its waiters, and each tries only while its request
is among the first `wake_width` of its class (so waiters are admitted in the fair order across
routers). Pub/sub is at-most-once: routers also retry on a slow timer, as a safety net.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis

from services.router import fair_order

log = logging.getLogger(__name__)

CLOSE_S = 1.0      # a subscription's close waits at most this long


@dataclass(frozen=True, slots=True)
class QueueDepth:
    traffic_class: str
    waiting: int
    oldest_age_s: float


# The member bookkeeping both scripts share: drop member `m` of the class whose keys start with
# `base` ({ns}waitq:) and end with `cls` from every key of the class. (The tenant's own zset is
# named from the member's record, so these scripts suit one Redis server, not a cluster.)
_DROP_LUA = """
local function drop(base, cls, m)
  redis.call('ZREM', base .. cls, m)
  redis.call('ZREM', base .. 'at:' .. cls, m)
  redis.call('ZREM', base .. 'first:' .. cls, m)
  local tenant = redis.call('HGET', base .. 'who:' .. cls, m)
  if tenant then
    redis.call('HDEL', base .. 'who:' .. cls, m)
    if redis.call('ZREM', base .. 't:' .. cls .. ':' .. tenant, m) == 1 then
      if redis.call('HINCRBY', base .. 'n:' .. cls, tenant, -1) <= 0 then
        redis.call('HDEL', base .. 'n:' .. cls, tenant)
      end
    end
  end
end
"""

# ARGV base, class, now. Drops members past their deadline from every key; returns how many.
_PRUNE_LUA = _DROP_LUA + """
local gone = redis.call('ZRANGEBYSCORE', ARGV[1] .. ARGV[2], '-inf', ARGV[3])
for _, m in ipairs(gone) do drop(ARGV[1], ARGV[2], m) end
return #gone
"""

# ARGV base, class, member. Drops one member (whoever it was); returns nothing.
_LEAVE_LUA = _DROP_LUA + """
drop(ARGV[1], ARGV[2], ARGV[3])
"""

# ARGV base, class, member, deadline, now, tenant, protected (1/0). A member already queued is
# moved (dropped, then added as asked).
_ENQUEUE_LUA = _DROP_LUA + """
local base, cls, m = ARGV[1], ARGV[2], ARGV[3]
drop(base, cls, m)
redis.call('ZADD', base .. cls, ARGV[4], m)
redis.call('ZADD', base .. 'at:' .. cls, ARGV[5], m)
if ARGV[7] == '1' then
  redis.call('ZADD', base .. 'first:' .. cls, ARGV[4], m)
else
  redis.call('HSET', base .. 'who:' .. cls, m, ARGV[6])
  redis.call('ZADD', base .. 't:' .. cls .. ':' .. ARGV[6], ARGV[4], m)
  redis.call('HINCRBY', base .. 'n:' .. cls, ARGV[6], 1)
end
"""

# KEYS[1] the class's virtual time, KEYS[2] its tenants' virtual service; ARGV tenant, weight.
# fair_order.charge, atomically (one step of arithmetic; tests/router/test_fair_order.py holds
# this queue and the simulator's, which calls fair_order.charge, to the same order).
_CHARGE_LUA = """
local v = tonumber(redis.call('GET', KEYS[1]) or '0')
local served = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
local begin = math.max(v, served)
redis.call('SET', KEYS[1], string.format('%.17g', begin))
redis.call('HSET', KEYS[2], ARGV[1], string.format('%.17g', begin + 1 / tonumber(ARGV[2])))
"""


class WaitQueue:
    def __init__(self, redis: aioredis.Redis, namespace: str = "kvfleet:") -> None:
        """`redis` must decode responses (str)."""
        self._r = redis
        self.ns = namespace
        self.base = f"{namespace}waitq:"
        self.channel = f"{namespace}capacity"
        self._prune = redis.register_script(_PRUNE_LUA)
        self._leave = redis.register_script(_LEAVE_LUA)
        self._enqueue = redis.register_script(_ENQUEUE_LUA)
        self._charge = redis.register_script(_CHARGE_LUA)

    def _keys(self, cls: str) -> tuple[str, str]:
        return f"{self.base}{cls}", f"{self.base}at:{cls}"

    def _tenant_key(self, cls: str, tenant: str) -> str:
        return f"{self.base}t:{cls}:{tenant}"

    async def enqueue(self, request_id: str, cls: str, deadline_unix_s: float,
                      now_unix_s: float, tenant: str = "", protected: bool = False) -> None:
        """Queue a waiter: a protected one ahead of every borrower (by deadline), any other in
        its tenant's line (by deadline) of the class's fair order."""
        await self._enqueue(args=[self.base, cls, request_id, repr(deadline_unix_s),
                                  repr(now_unix_s), tenant, "1" if protected else "0"])

    async def leave(self, request_id: str, cls: str) -> None:
        await self._leave(args=[self.base, cls, request_id])

    async def admitted(self, cls: str, tenant: str, weight: float) -> None:
        """Charge `tenant` one admission in the class's fair order (fair_order.charge), atomically
        against other routers. Called for an unprotected request admitted while others of its
        class waited, whether it had queued or not."""
        if not weight > 0:
            raise ValueError(f"tenant weight must be > 0, got {weight!r}")
        await self._charge(keys=[f"{self.base}v:{cls}", f"{self.base}vt:{cls}"],
                           args=[tenant, repr(float(weight))])

    async def position(self, request_id: str, cls: str, now_unix_s: float, tenant: str = "",
                       weights: Mapping[str, float] | None = None) -> int | None:
        """0-based place in its class's fair order (None: not queued, e.g. pruned). `tenant`: the
        tenant it was queued for; `weights`: tenant -> weight (1 when not named)."""
        by_deadline, _ = self._keys(cls)
        await self._prune(args=[self.base, cls, repr(now_unix_s)])
        async with self._r.pipeline(transaction=False) as p:
            p.zrank(f"{self.base}first:{cls}", request_id)
            p.zcard(f"{self.base}first:{cls}")
            p.zrank(self._tenant_key(cls, tenant), request_id)
            p.zscore(by_deadline, request_id)
            first_rank, protected, rank, deadline = await p.execute()
        if first_rank is not None:
            return int(first_rank)
        if rank is None or deadline is None:
            return None
        return int(protected) + await self._ahead(cls, tenant, int(rank), deadline, weights or {})

    async def ahead(self, cls: str, tenant: str, deadline_unix_s: float,
                    weights: Mapping[str, float] | None = None) -> int:
        """How many would be served before a new unprotected waiter of `tenant` with this
        deadline, were it queued now (0: none; the queue is not pruned first)."""
        async with self._r.pipeline(transaction=False) as p:
            p.zcard(f"{self.base}first:{cls}")
            p.zcount(self._tenant_key(cls, tenant), "-inf", f"({deadline_unix_s!r}")
            protected, rank = await p.execute()
        return int(protected) + await self._ahead(cls, tenant, int(rank), deadline_unix_s,
                                                  weights or {})

    async def _ahead(self, cls: str, tenant: str, rank: int, deadline: float,
                     weights: Mapping[str, float]) -> int:
        """Unprotected waiters ahead of tenant's waiter at `rank` (fair_order.ahead)."""
        async with self._r.pipeline(transaction=False) as p:
            p.hgetall(f"{self.base}n:{cls}")
            p.get(f"{self.base}v:{cls}")
            p.hgetall(f"{self.base}vt:{cls}")
            counts, v, served = await p.execute()
        v = float(v or 0.0)
        counts = {u: int(n) for u, n in counts.items() if int(n) > 0}
        counts[tenant] = max(rank, counts.get(tenant, 0))
        lines = {u: fair_order.Line(n, weights.get(u, 1.0),
                                    fair_order.start_of(v, float(served.get(u, 0.0))))
                 for u, n in counts.items()}
        tied = fair_order.ties(tenant, rank, lines)
        deadlines = {}
        if tied:
            async with self._r.pipeline(transaction=False) as p:
                for u, j in tied:
                    p.zrange(self._tenant_key(cls, u), j, j, withscores=True)
                for (u, j), got in zip(tied, await p.execute()):
                    deadlines[(u, j)] = got[0][1] if got else float("inf")
        return fair_order.ahead(tenant, rank, deadline, lines, deadlines)

    async def depth(self, cls: str, now_unix_s: float) -> QueueDepth:
        by_deadline, by_time = self._keys(cls)
        await self._prune(args=[self.base, cls, repr(now_unix_s)])
        async with self._r.pipeline(transaction=False) as p:
            p.zcard(by_deadline)
            p.zrange(by_time, 0, 0, withscores=True)
            waiting, oldest = await p.execute()
        age = max(0.0, now_unix_s - oldest[0][1]) if oldest else 0.0
        return QueueDepth(cls, int(waiting), age)

    async def waiting(self, cls: str) -> int:
        """Members of a class, unpruned (one command)."""
        return int(await self._r.zcard(self.members_key(cls)))

    def members_key(self, cls: str) -> str:
        """The sorted set of every waiter of a class: its ZCARD is `waiting` (the admission
        path reads it in the same round trip as the placements: PlacementLedger)."""
        return self._keys(cls)[0]

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
