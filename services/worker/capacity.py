"""Tell the routers that KV freed here: a decode (or mixed) worker publishes on `{ns}capacity`
(services/state/wait_queue.py) when a sequence ends or a reservation is released, so a request
queued at a router is admitted the moment there is room.

Off the token path: `freed(blocks)` only adds to a count and sets an event (synchronous, safe in
`finally`); one background task publishes what accumulated, one message per round, so a burst of
endings costs one publish. A failed publish is dropped (one warning per outage): routers retry on
their own timer.
"""
from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from services.state.wait_queue import WaitQueue

log = logging.getLogger(__name__)


class CapacityNotifier:
    def __init__(self, queue: WaitQueue | None) -> None:
        self.queue = queue
        self._pending = 0
        self._event = asyncio.Event()

    @property
    def pending(self) -> int:
        """Blocks freed and not yet published."""
        return self._pending

    def freed(self, blocks: int) -> None:
        """`blocks` KV blocks went back (a sequence ended, a reservation released)."""
        if self.queue is None:
            return
        self._pending += max(1, blocks)
        self._event.set()

    async def run(self) -> None:
        """Until cancelled: publish every accumulated count."""
        warned = False
        while True:
            await self._event.wait()
            self._event.clear()
            freed, self._pending = self._pending, 0
            try:
                await self.queue.notify(freed)
                warned = False
            except (RedisError, OSError) as e:
                if not warned:
                    log.warning("capacity notification not sent (%s); routers retry on "
                                "their timer", e)
                    warned = True
