"""Publish this worker's prefix-cache events for the routers' prefix index (services/state/
kv_events.py says what a batch holds; services/router/prefix_index.py reads them).

Every `every_s` (the heartbeat's period) one batch: the hashes the engine core's block pool stored
and evicted since the previous one (one TakeKVEvents command between engine steps, never on the
token path), or a full snapshot every `snapshot_every` batches, after a batch that did not reach
Redis, and whenever the core's change log overflowed (it is bounded by twice the pool's blocks). A
batch is sent even when nothing changed: it is how the routers know the worker's events are fresh.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from services.state import kv_events
from services.state.fleet_state import FleetState
from services.state.outage import UNREACHABLE, Backoff, Outage
from services.worker.engine_client import EngineFailed
from services.worker.engine_core import KVEvents

log = logging.getLogger(__name__)

STALE_AFTER_BATCHES = 4        # a reader that missed this many intervals treats the worker as empty


@dataclass(frozen=True)
class PublisherConfig:
    worker_id: str
    block_size: int
    every_s: float
    snapshot_every: int = 10   # batches between full snapshots


class KVEventPublisher:
    """Builds the batches (`next_batch`) and sends them (`run`). `take`: the engine client's
    kv_events."""

    def __init__(self, config: PublisherConfig, take: Callable[[bool], Awaitable[KVEvents]],
                 epoch: str | None = None) -> None:
        self.config = config
        self._take = take
        self.epoch = epoch or uuid.uuid4().hex
        self.seq = 0
        self._snapshot_due = True          # the first batch is a snapshot

    async def next_batch(self) -> kv_events.KVEventBatch:
        c = self.config
        snapshot = self._snapshot_due or (self.seq + 1) % c.snapshot_every == 0
        events = await self._take(snapshot)
        self.seq += 1
        self._snapshot_due = False
        return kv_events.KVEventBatch(
            c.worker_id, self.epoch, self.seq, c.block_size, events.snapshot, events.stored,
            events.evicted, STALE_AFTER_BATCHES * c.every_s)

    def lost(self) -> None:
        """The last batch may not have reached Redis: the next one is a snapshot."""
        self._snapshot_due = True

    async def run(self, state: FleetState) -> None:
        """Until cancelled or the engine core is gone."""
        redis = Outage(f"worker {self.config.worker_id} kv events", log,
                       Backoff(base_s=min(self.config.every_s, 0.5), cap_s=2.0), announce=False)
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            try:
                batch = await self.next_batch()
                await redis.call(state.add_kv_events, batch.worker_id, kv_events.encode(batch),
                                 kv_events.MAX_LEN)
            except EngineFailed:
                return
            except UNREACHABLE:
                self.lost()
            except Exception:  # noqa: BLE001 - events are an optimisation: never end the worker
                log.exception("worker %s: publishing KV events failed", self.config.worker_id)
                self.lost()
            await asyncio.sleep(max(0.0, self.config.every_s - (loop.time() - began)))
