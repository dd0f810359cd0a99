"""The stage keeper decides the fleet's stage once for every router: scripted signals move the
record in a real Redis, every router's keeper reads the same stage, two routers deciding at once
change it once, and the error-rate signal is the routers' shared counts."""
from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from services.router.keeper import DecisionCounts, StageKeeper
from services.router.stages import S0, S1, S2, Signals, StageConfig, StageMachine
from services.state.stage_record import StageStore

HOT = Signals(kv_reserved=0.99)
CALM = Signals()


class Script:
    """Signals and a clock the test sets."""

    def __init__(self) -> None:
        self.signals, self.now = CALM, 1000.0

    async def read(self) -> Signals:
        return self.signals


def run(url: str, ns: str, story):
    async def main():
        r = aioredis.Redis.from_url(url, decode_responses=True)
        try:
            return await story(r)
        finally:
            await r.aclose()
    return asyncio.run(main())


def keepers(r, ns: str, script: Script, n: int = 2) -> list[StageKeeper]:
    machine = StageMachine(StageConfig(min_dwell_s=5.0))
    return [StageKeeper(StageStore(r, ns), machine, f"router-{i}", script.read,
                        clock=lambda: script.now) for i in range(n)]


def test_a_scripted_signal_moves_the_fleet_and_every_router_reads_the_same_stage(redis_url,
                                                                                redis_ns):
    async def story(r):
        script = Script()
        a, b = keepers(r, redis_ns, script)
        script.signals = HOT
        assert (await a.tick()).stage == S1 and a.record.by == "router-0"
        assert (await b.tick()).stage == S1           # within the dwell: b reads, does not move
        script.now += 5.0
        assert (await b.tick()).stage == S2           # one step per dwell, by whoever ticks
        assert (await a.tick()).stage == S2 and a.record.by == "router-1"
        script.signals, script.now = CALM, script.now + 5.0
        assert (await a.tick()).stage == S1
        script.now += 5.0
        assert (await b.tick()).stage == S0
        assert (await a.tick()).stage == S0
    run(redis_url, redis_ns, story)


def test_two_routers_deciding_at_once_change_the_stage_once(redis_url, redis_ns):
    async def story(r):
        script = Script()
        script.signals = HOT
        ks = keepers(r, redis_ns, script, n=4)
        records = await asyncio.gather(*(k.tick() for k in ks))
        assert {rec.stage for rec in records} == {S1}
        assert (await StageStore(r, redis_ns).read()).version == 1
    run(redis_url, redis_ns, story)


def test_the_error_rate_is_every_routers_refusals_over_their_decisions(redis_url, redis_ns):
    async def story(r):
        clock = lambda: 5000.0            # noqa: E731 - one count window
        one, two = DecisionCounts(r, redis_ns, clock), DecisionCounts(r, redis_ns, clock)
        for _ in range(6):
            one.count(error=False)
        for error in (True, True, False, False):
            two.count(error=error)
        await one.flush_and_read()
        assert await two.flush_and_read() == 0.2
        assert await one.flush_and_read() == 0.2       # counted once: nothing new to add
    run(redis_url, redis_ns, story)
