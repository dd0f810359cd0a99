"""The router's prefix index: which worker holds which prefix blocks (DESIGN.md section 3, step 2),
fed by the workers' KV events (services/state/kv_events.py, services/worker/kv_events.py).

    index:     worker id -> the block hashes its prefix cache holds (its last snapshot, plus the
               stored and less the evicted hashes of every batch since, in sequence)
    query:     a request's block hashes, computed with the engine's own function
               (block_pool.hash_full_blocks, salted by the tenant exactly as the engine salts it),
               -> per worker, how many leading prompt tokens it holds (a hit the engine would use:
               block_pool.usable_prefix_blocks)
    freshness: a worker whose batches stopped (none for its `stale_after_s`, on this router's
               clock), or whose sequence has a gap or a new epoch, counts as holding nothing until
               its next snapshot

The index owns only what the events say; placement (services/router/placement.py) decides with it,
and `KVEventFeed` is the one task that writes it. Memory: at most one hash per KV block of each
worker; a worker gone quiet is dropped after `forget_after_s`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from services.engine.block_pool import hash_full_blocks, usable_prefix_blocks
from services.state import kv_events
from services.state.fleet_state import FleetState
from services.state.outage import UNREACHABLE, Backoff, Outage

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"    # the engine's name for a request that names no tenant
FORGET_AFTER_S = 60.0


def engine_tenant(tenant: str) -> str:
    """The tenant the engine salts a request's hashes with: the request's, else the default."""
    return tenant or DEFAULT_TENANT


def request_block_hashes(prompt_token_ids: Sequence[int], tenant: str, block_size: int) -> list[int]:
    """The hashes of the prompt's blocks a prefix hit can cover, as the engine computes them."""
    usable = usable_prefix_blocks(len(prompt_token_ids), block_size)
    return hash_full_blocks(list(prompt_token_ids[:usable * block_size]), block_size,
                            engine_tenant(tenant))


@dataclass
class WorkerPrefixes:
    epoch: str
    seq: int
    block_size: int
    heard_at: float                   # this router's clock
    stale_after_s: float
    synced: bool                      # False: a batch was missed; waiting for a snapshot
    hashes: set[int] = field(default_factory=set)


class PrefixIndex:
    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 forget_after_s: float = FORGET_AFTER_S) -> None:
        self.clock = clock
        self.forget_after_s = forget_after_s
        self.workers: dict[str, WorkerPrefixes] = {}

    def apply(self, batch: kv_events.KVEventBatch) -> None:
        """Follow one batch of a worker's events."""
        now = self.clock()
        w = self.workers.get(batch.worker_id)
        if batch.snapshot:
            self.workers[batch.worker_id] = WorkerPrefixes(
                batch.epoch, batch.seq, batch.block_size, now, batch.stale_after_s, True,
                set(batch.stored))
            return
        if w is None or w.epoch != batch.epoch or batch.seq != w.seq + 1:
            if w is not None and w.synced:
                log.info("prefix index: worker %s missed KV events (epoch %s seq %d after %s "
                         "seq %d): holding nothing until its next snapshot", batch.worker_id,
                         batch.epoch, batch.seq, w.epoch, w.seq)
            self.workers[batch.worker_id] = WorkerPrefixes(
                batch.epoch, batch.seq, batch.block_size, now, batch.stale_after_s, False)
            return
        w.seq, w.heard_at, w.stale_after_s = batch.seq, now, batch.stale_after_s
        if w.synced:
            w.hashes.difference_update(batch.evicted)
            w.hashes.update(batch.stored)

    def holding(self, worker_id: str) -> WorkerPrefixes | None:
        """The worker's entry if it is usable now: in sequence and fresh."""
        w = self.workers.get(worker_id)
        if w is None or not w.synced or self.clock() - w.heard_at > w.stale_after_s:
            return None
        return w

    def cached_tokens(self, prompt_token_ids: Sequence[int], tenant: str,
                      worker_ids: Iterable[str]) -> dict[str, int]:
        """Per worker, the leading prompt tokens its prefix cache holds (0: none, or unknown)."""
        out, chains = {}, {}
        for wid in worker_ids:
            w = self.holding(wid)
            if w is None:
                out[wid] = 0
                continue
            chain = chains.get(w.block_size)
            if chain is None:
                chain = chains[w.block_size] = request_block_hashes(prompt_token_ids, tenant,
                                                                    w.block_size)
            hits = 0
            for h in chain:
                if h not in w.hashes:
                    break
                hits += 1
            out[wid] = hits * w.block_size
        return out

    def forget_quiet(self) -> None:
        now = self.clock()
        for wid in [wid for wid, w in self.workers.items()
                    if now - w.heard_at > self.forget_after_s]:
            del self.workers[wid]


@dataclass(frozen=True)
class FeedConfig:
    block_ms: int = 200        # one XREAD waits this long for news (well under the socket timeout)
    count: int = 256           # batches per read


class KVEventFeed:
    """The task that reads `{ns}kv-events` into a PrefixIndex, from the stream's start (it is
    capped: a few thousand small batches), so that a router started after the workers is synced
    by their latest snapshots at once rather than at their next ones. A batch that does not
    decode is skipped, logged."""

    def __init__(self, state: FleetState, index: PrefixIndex, config: FeedConfig = FeedConfig()):
        self.state, self.index, self.config = state, index, config
        self._after: str | None = None
        self._redis = Outage("router kv events", log, Backoff(base_s=0.2, cap_s=2.0),
                             announce=False)

    async def read_once(self) -> int:
        """One read; returns the batches applied."""
        if self._after is None:
            self._after = "0-0"
        rows = await self._redis.call(self.state.read_kv_events, self._after, self.config.count,
                                      self.config.block_ms)
        applied = 0
        for entry_id, worker_id, payload in rows:
            self._after = entry_id
            if payload is None:
                continue                     # not signed by this fleet: FleetState logged it
            try:
                batch = kv_events.decode(payload)
            except ValueError as e:
                log.warning("prefix index: skipping a KV event batch from %r: %s", worker_id, e)
                continue
            if batch.worker_id != worker_id:
                log.warning("prefix index: skipping a batch of %r filed under %r",
                            batch.worker_id, worker_id)
                continue
            self.index.apply(batch)
            applied += 1
        return applied

    async def run(self) -> None:
        """Until cancelled. While Redis is down the index ages: every worker goes stale."""
        while True:
            try:
                await self.read_once()
                self.index.forget_quiet()
            except UNREACHABLE:
                await asyncio.sleep(max(self._redis.retry_in(), 0.05))
            except Exception:  # noqa: BLE001 - the index is an optimisation: keep reading
                log.exception("prefix index: reading KV events failed")
                await asyncio.sleep(1.0)
