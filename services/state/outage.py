"""How a process lives through a Redis outage: capped, jittered backoff, one warning per outage.

Every service that talks to Redis keeps one `Outage` per concern (a worker's heartbeat, the
router's worker list, the gateway's quota store) and routes its Redis calls through it:

    up --a call fails--> down (warning logged once, next try after Backoff.delay(1))
    down --a call before next_try_at--> RedisDown raised at once, Redis is not touched
    down --a call at/after next_try_at fails--> down (next try after Backoff.delay(n+1), debug log)
    down --a call succeeds--> up (info logged once: how long it lasted, how many tries failed)

So a request never waits for a dead Redis (it fails fast with `retry_in()` as its retry hint),
and the process finds out that Redis is back within `Backoff.cap_s` of it coming back, as long
as something calls (a heartbeat loop, a lease renewer, or traffic). The redis client itself
reconnects: FleetState sets socket timeouts and one retry on a broken pooled connection.
"""
from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# What an outage is: no connection, or no answer in time (a script error is a bug, not an outage).
# A restarted Redis still loading its data answers LOADING, a ConnectionError too.
UNREACHABLE = (RedisConnectionError, RedisTimeoutError)

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff, capped, with "equal jitter": try n waits in [d/2, d], where
    d = min(cap_s, base_s * 2**(n-1)), so that processes that failed together do not retry together."""
    base_s: float = 0.1
    cap_s: float = 2.0

    def delay(self, failures: int, rng: Callable[[], float] = random.random) -> float:
        d = min(self.cap_s, self.base_s * 2 ** max(0, failures - 1))
        return d / 2 + rng() * d / 2


class RedisDown(RedisConnectionError):
    """Raised without touching Redis while an outage's next try is not due yet."""


class Outage:
    """One concern's view of Redis: up, or down since `since` with `failures` failed tries."""

    def __init__(self, what: str, log: logging.Logger, backoff: Backoff = Backoff(),
                 clock: Callable[[], float] = time.monotonic,
                 rng: Callable[[], float] = random.random, announce: bool = True) -> None:
        """`announce=False`: a background concern of a process whose main concern already
        reports the outage (its warning and its recovery line go to DEBUG), so that one outage
        is one warning per process."""
        self.what = what
        self.log = log
        self._warn = logging.WARNING if announce else logging.DEBUG
        self._back = logging.INFO if announce else logging.DEBUG
        self.backoff = backoff
        self.clock = clock
        self.rng = rng
        self.failures = 0             # failed tries in this outage; 0 = up
        self.since = 0.0              # clock() of the outage's first failure
        self.next_try_at = 0.0        # no call reaches Redis before this while down
        self.last_error = ""

    @property
    def down(self) -> bool:
        return self.failures > 0

    def retry_in(self) -> float:
        """Seconds until Redis is tried again (0 when up): the retry hint for a refused request."""
        return max(0.0, self.next_try_at - self.clock()) if self.down else 0.0

    def failed(self, error: BaseException) -> float:
        """Record a failed try; returns the delay before the next one."""
        now = self.clock()
        if not self.down:
            self.since = now
            self.log.log(self._warn, "%s: redis unavailable, retrying with backoff (at most every "
                         "%.1f s): %s", self.what, self.backoff.cap_s, error)
        else:
            self.log.debug("%s: redis still unavailable (%d tries): %s", self.what,
                           self.failures + 1, error)
        self.failures += 1
        self.last_error = str(error) or type(error).__name__
        delay = self.backoff.delay(self.failures, self.rng)
        self.next_try_at = now + delay
        return delay

    def succeeded(self) -> None:
        if self.down:
            self.log.log(self._back, "%s: redis is back after %.1f s (%d failed tries)",
                         self.what, self.clock() - self.since, self.failures)
        self.failures = 0
        self.next_try_at = 0.0

    def check(self) -> None:
        """Raise RedisDown when down and the next try is not due yet."""
        if self.down and self.clock() < self.next_try_at:
            raise RedisDown(f"redis unavailable for {self.clock() - self.since:.1f} s "
                            f"({self.last_error}); next try in {self.retry_in():.1f} s")

    async def call(self, fn: Callable[..., Awaitable[T]], *args, **kwargs) -> T:
        """`await fn(*args, **kwargs)` through this outage: fails fast while down, records the
        outcome otherwise. Only UNREACHABLE errors count as failures."""
        self.check()
        try:
            result = await fn(*args, **kwargs)
        except RedisDown:
            raise
        except UNREACHABLE as e:
            self.failed(e)
            raise
        self.succeeded()
        return result
