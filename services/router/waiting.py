"""How a router's queued requests learn that capacity freed, and how fast the fleet drains.

`Wakeups` holds the router's one subscription to `{ns}capacity` (services/state/wait_queue.py):
each notification wakes every waiter of this router at once (a fresh asyncio.Event per round) and
is counted by `DrainRate`, the fleet's measured rate of freed decode KV blocks, which prices a
refusal's Retry-After. Pub/sub is at-most-once: waiters also retry on their own slow timer.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from redis.exceptions import RedisError

from services.state.wait_queue import WaitQueue

log = logging.getLogger(__name__)

RETRY_MIN_S, RETRY_MAX_S = 0.5, 60.0      # a Retry-After is clamped to this range
RESUBSCRIBE_S = 1.0                       # after a Redis error, subscribe again this much later


class DrainRate:
    """Decode KV blocks freed per second over the last `window_s`, fleet-wide."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._freed: deque[tuple[float, int]] = deque()

    def add(self, blocks: int) -> None:
        self._freed.append((self._clock(), max(0, blocks)))

    def blocks_per_s(self) -> float:
        now = self._clock()
        while self._freed and self._freed[0][0] < now - self.window_s:
            self._freed.popleft()
        return sum(b for _, b in self._freed) / self.window_s


def retry_after_s(blocks_needed: int, blocks_per_s: float, queued_prefill_tokens: float,
                  prefill_tokens_per_s: float) -> float:
    """When a retry may succeed: the blocks this request needs at the fleet's measured rate of
    freed blocks; before any block was seen freed, the prefill work queued ahead at the fleet's
    prefill rate; clamped to [RETRY_MIN_S, RETRY_MAX_S]."""
    if blocks_per_s > 0:
        s = blocks_needed / blocks_per_s
    elif prefill_tokens_per_s > 0:
        s = queued_prefill_tokens / prefill_tokens_per_s
    else:
        s = RETRY_MIN_S
    return min(RETRY_MAX_S, max(RETRY_MIN_S, s))


class Wakeups:
    def __init__(self, queue: WaitQueue, drain: DrainRate) -> None:
        self.queue = queue
        self.drain = drain
        self._event = asyncio.Event()
        self.subscribed = asyncio.Event()     # set once the first subscription is live

    def next(self) -> asyncio.Event:
        """The event the next notification sets (await it, with the waiter's own timeout)."""
        return self._event

    def wake(self, freed_blocks: int) -> None:
        self.drain.add(freed_blocks)
        event, self._event = self._event, asyncio.Event()
        event.set()

    async def listen(self) -> None:
        """Until cancelled: wake waiters on every notification; a broken subscription is
        renewed after RESUBSCRIBE_S (one warning per outage); waiters then run on their timers."""
        warned = False
        while True:
            try:
                async for freed in self.queue.notifications(on_subscribed=self.subscribed.set):
                    warned = False
                    self.wake(freed)
            except (RedisError, OSError) as e:
                if not warned:
                    log.warning("capacity subscription lost (%s); waiters retry on their timer", e)
                    warned = True
            await asyncio.sleep(RESUBSCRIBE_S)
