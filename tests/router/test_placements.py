"""Two routers share what they placed since a worker's beat through Redis (real redis-server): each
sees its own placements at once and its peer's on its next read; a newer beat starts from nothing; a
placement taken back is gone for both; with Redis gone a router still counts its own; an admission that
read the counts before another admission on the same router placed ranks with the counts as they are
when it places, not as it read them."""
from __future__ import annotations

import logging

from services.router.placement import Placed, rank_decode
from services.router.placements import PlacementLedger
from services.state.fleet_state import FleetState
from services.state.outage import Outage
from tests.state.test_fleet_state import make_stats, run

log = logging.getLogger(__name__)


def ledger(state: FleetState) -> PlacementLedger:
    return PlacementLedger(state, Outage("test placements", log))


def test_two_routers_see_each_others_placements_until_the_next_beat(redis_url, redis_ns):
    beat = make_stats("decode-0")
    next_beat = make_stats("decode-0", updated_at_unix_s=beat.updated_at_unix_s + 0.5)

    async def scenario(one: FleetState, two: FleetState):
        a, b = ledger(one), ledger(two)
        await a.add(beat, 6)
        await a.add(beat, 6)
        await b.add(beat, 4)
        assert await a.read([beat]) == {"decode-0": Placed(blocks=16, streams=3)}
        assert await b.read([beat]) == {"decode-0": Placed(blocks=16, streams=3)}
        assert await a.read([next_beat]) == {"decode-0": Placed()}      # the beat reflects them now
        await b.take_back(beat, 4)                                      # its Reserve was refused
        assert await a.read([beat]) == {"decode-0": Placed(blocks=12, streams=2)}
        assert a.turn == 2 and b.turn == 1                              # each add turns the tie ring

    run(redis_url, redis_ns, scenario, clients=2)


def test_with_redis_gone_a_router_still_counts_its_own():
    beat = make_stats("decode-0")

    async def scenario(gone: FleetState):
        mine = ledger(gone)
        await mine.add(beat, 5)   # the Redis half fails; the own count stands
        assert await mine.read([beat]) == {"decode-0": Placed(blocks=5, streams=1)}

    run("redis://127.0.0.1:1/0", "kvfleet-test-gone:", scenario)


def test_two_admissions_that_read_at_once_still_take_different_replicas(redis_url, redis_ns):
    """Admissions on one event loop interleave at their awaits: both may read before either placed.
    Ranked with what they read, both would take the same best replica (a 16-stream burst once split
    12/4); ranked with `now()` just before placing, the second sees the first's placement."""
    workers = [make_stats("decode-0"), make_stats("decode-1")]

    async def scenario(state: FleetState):
        router = ledger(state)
        read_by_first = await router.read(workers)
        read_by_second, turn_read = await router.read(workers), router.turn   # before any placed
        first = rank_decode(workers, "decode", router.now(workers), router.turn)[0]
        await router.add(first, 6)
        second = rank_decode(workers, "decode", router.now(workers), router.turn)[0]
        stale = rank_decode(workers, "decode", read_by_second, turn_read)[0]

        assert read_by_first == read_by_second
        assert {first.worker_id, second.worker_id} == {"decode-0", "decode-1"}
        assert stale.worker_id == first.worker_id          # what the read alone would have chosen
        assert router.now(workers)[first.worker_id] == Placed(blocks=6, streams=1)

    run(redis_url, redis_ns, scenario)
