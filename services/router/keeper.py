"""The stage keeper: each router's task that decides the fleet's overload stage, once for all.

Every `keeper_every_s` (0.5 s) a router computes the signals (services/router/stages.py), runs
`StageMachine.decide` against the record in Redis (services/state/stage_record.py) and writes a
change with its compare-and-set: when two routers decide at once, one change wins and the other
re-reads it. Every router admits by the record's stage as last read, so they agree within one
period. The signals:

  kv_reserved    decode (mixed) KV used or reserved / total, from the live workers' stats;
  ttft_pressure  predicted TTFT / class target over this router's recent decisions (p95), those
                 admitted or queued (not those refused because their own prefill misses);
  queue_age      the oldest wait-queue entry's age / its class target, worst class;
  error_rate     refusals and failures / decisions of every router over the last two windows of
                 `COUNT_WINDOW_S`, counted in Redis (`{ns}decisions:{window}`, a hash with a
                 TTL). Refusals the stage itself made (S4, a held batch request that ran out)
                 are not counted: the stage must not hold itself up.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.router.stages import Signals, StageMachine, stage_name
from services.state.stage_record import StageRecord, StageStore

log = logging.getLogger(__name__)

COUNT_WINDOW_S = 10.0
PRESSURE_QUANTILE = 0.95


class RecentPredictions:
    """Predicted TTFT / target of this router's decisions over the last `window_s`."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._seen: deque[tuple[float, float]] = deque()

    def add(self, pressure: float) -> None:
        self._seen.append((self._clock(), pressure))

    def quantile(self, q: float = PRESSURE_QUANTILE) -> float:
        now = self._clock()
        while self._seen and self._seen[0][0] < now - self.window_s:
            self._seen.popleft()
        if not self._seen:
            return 0.0
        ordered = sorted(p for _, p in self._seen)
        return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


class DecisionCounts:
    """Decisions and errors, counted here and added into Redis once a keeper period."""

    def __init__(self, redis: aioredis.Redis, namespace: str = "kvfleet:",
                 clock: Callable[[], float] = time.time) -> None:
        self._r = redis
        self.ns = namespace
        self._clock = clock
        self.decided = self.errors = 0         # not yet added to Redis

    def count(self, error: bool) -> None:
        self.decided += 1
        self.errors += int(error)

    def _key(self, window: int) -> str:
        return f"{self.ns}decisions:{window}"

    async def flush_and_read(self) -> float:
        """Add this router's counts and return the fleet's error rate (0 with no decisions)."""
        window = int(self._clock() // COUNT_WINDOW_S)
        decided, errors = self.decided, self.errors
        async with self._r.pipeline(transaction=False) as p:
            if decided:
                p.hincrby(self._key(window), "decided", decided)
                p.hincrby(self._key(window), "errors", errors)
                p.expire(self._key(window), int(3 * COUNT_WINDOW_S))
            p.hmget(self._key(window), "decided", "errors")
            p.hmget(self._key(window - 1), "decided", "errors")
            out = await p.execute()
        self.decided -= decided
        self.errors -= errors
        total = sum(int(d or 0) for d, _ in out[-2:])
        failed = sum(int(e or 0) for _, e in out[-2:])
        return failed / total if total else 0.0


class StageKeeper:
    def __init__(self, store: StageStore, machine: StageMachine, router_id: str,
                 signals: Callable[[], Awaitable[Signals]],
                 clock: Callable[[], float] = time.time,
                 on_stage: Callable[[int], None] | None = None) -> None:
        self.store = store
        self.machine = machine
        self.router_id = router_id
        self.signals = signals
        self._clock = clock
        self._on_stage = on_stage
        self.record = StageRecord()
        self.last_signals = Signals()
        self._read = False

    @property
    def stage(self) -> int:
        return self.record.stage

    async def first_read(self) -> None:
        """Read the record once before the first decision (a new router does not decide in S0
        while the fleet is elsewhere); Redis down: S0 until the keeper reads it."""
        if self._read:
            return
        try:
            self.record = await self.store.read()
            self._read = True
        except (RedisError, OSError) as e:
            log.warning("stage keeper: could not read the stage (%s); deciding in %s", e,
                        stage_name(self.stage))

    async def tick(self) -> StageRecord:
        """One period: read the record, decide on fresh signals, write a change (CAS)."""
        record = await self.store.read()
        signals = await self.signals()
        now = self._clock()
        decision = self.machine.decide(record.stage, record.since_unix_s, signals, now)
        if decision.changed:
            won = await self.store.change(record, decision.stage, now, decision.why,
                                          self.router_id)
            if won is not None:
                log.warning("overload stage %s -> %s (%s)", stage_name(record.stage),
                            stage_name(won.stage), decision.why)
            record = won or await self.store.read()
        self.record, self.last_signals, self._read = record, signals, True
        if self._on_stage is not None:
            self._on_stage(record.stage)
        return record

    async def run(self, every_s: float) -> None:
        """Until cancelled; a failed period (Redis down) keeps the last stage, warned once."""
        broken = False
        while True:
            try:
                await self.tick()
                broken = False
            except (RedisError, OSError) as e:
                if not broken:
                    log.warning("stage keeper: Redis unavailable (%s); keeping stage %s", e,
                                stage_name(self.stage))
                broken = True
            except Exception:  # noqa: BLE001 - a bad period must not end the keeper
                if not broken:
                    log.exception("stage keeper: a period failed")
                broken = True
            await asyncio.sleep(every_s)
