"""Two routers share what they placed since a worker's beat through Redis (real redis-server): each
sees its own placements at once and its peer's on its next read; a newer beat starts from nothing; a
placement taken back is gone for both; with Redis gone a router still counts its own; an admission that
read the counts before another admission on the same router placed ranks with the counts as they are
when it places, not as it read them."""
from __future__ import annotations

import itertools
import logging

from hypothesis import HealthCheck, given, settings, strategies as st

from services.router.placement import Placed, rank_decode
from services.router.placements import PlacementLedger
from services.state.fleet_state import FleetState
from services.state.outage import Outage
from services.state.wait_queue import WaitQueue
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


def test_the_admission_reads_placements_and_its_class_waiters_together(redis_url, redis_ns):
    """The admission's one read: a peer's placements since the beat, and how many of the
    request's class wait in the queue (the fair order is asked only when someone waits)."""
    beat = make_stats("decode-0")

    async def scenario(one: FleetState, two: FleetState):
        mine, peer = ledger(one), ledger(two)
        queue = WaitQueue(one.redis, one.ns)
        await peer.add(beat, 6, "quiet")
        await queue.enqueue("doc-1", "document", 2e9, 1e9, tenant="quiet")
        await queue.enqueue("doc-2", "document", 2e9, 1e9, tenant="loud")
        placed, waiting = await mine.read_with_waiting([beat], queue.members_key("document"))
        assert placed == {"decode-0": Placed(blocks=6, streams=1)}
        assert waiting == 2
        _, none_waiting = await mine.read_with_waiting([beat], queue.members_key("interactive"))
        assert none_waiting == 0
        assert mine.tenant_blocks([beat]) == {"quiet": 6}

    run(redis_url, redis_ns, scenario, clients=2)


def test_a_placement_is_counted_at_once_and_reaches_redis_behind_it(redis_url, redis_ns):
    """`add` counts the router's own placement before it returns (the next ranking on its loop
    sees it) and writes the fleet's count behind it; once written, a peer reads it."""
    beat = make_stats("decode-0")

    async def scenario(one: FleetState, two: FleetState):
        mine, peer = ledger(one), ledger(two)
        written = mine.add(beat, 5, "quiet")
        assert mine.now([beat]) == {"decode-0": Placed(blocks=5, streams=1)}
        await written
        assert await peer.read([beat]) == {"decode-0": Placed(blocks=5, streams=1)}
        mine.take_back(beat, 5, "quiet")
        await mine.flush()
        assert await peer.read([beat]) == {"decode-0": Placed()}
        assert mine.now([beat]) == {"decode-0": Placed()}

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


def test_a_tenants_placed_blocks_count_fleet_wide_until_the_next_beat(redis_url, redis_ns):
    """Each placement's blocks are counted under its tenant, in Redis: a peer router sees them on
    its next read, a taken-back placement leaves nothing, and a newer beat (which publishes the
    tenants' shares itself) starts from zero."""
    beat = make_stats("decode-0")
    other = make_stats("decode-1")
    next_beat = make_stats("decode-0", updated_at_unix_s=beat.updated_at_unix_s + 0.5)

    async def scenario(one: FleetState, two: FleetState):
        a, b = ledger(one), ledger(two)
        await a.add(beat, 6, "quiet")
        await b.add(other, 4, "quiet")
        await b.add(beat, 10, "flood")
        assert a.tenant_blocks([beat, other]) == {"quiet": 6}          # its own, before a read
        await a.read([beat, other])
        assert a.tenant_blocks([beat, other]) == {"quiet": 10, "flood": 10}
        await b.take_back(beat, 10, "flood")                            # its Reserve was refused
        await a.read([beat, other])
        assert a.tenant_blocks([beat, other]) == {"quiet": 10}
        await a.read([next_beat, other])
        assert a.tenant_blocks([next_beat, other]) == {"quiet": 4}     # decode-0's beat says it

    run(redis_url, redis_ns, scenario, clients=2)


def test_a_placed_hash_written_around_kvfleet_counts_nothing_it_cannot_read(redis_url, redis_ns):
    beat = make_stats("decode-0")

    async def scenario(state: FleetState):
        key = state._placed_key("decode-0", beat.updated_at_unix_s)
        await state.redis.hset(key, mapping={"blocks": "x", "streams": "2", "t:quiet": "3",
                                             "t:bad": "-4", "t:worse": "nan"})
        [row] = await state.placed([("decode-0", beat.updated_at_unix_s)])
        assert (row.blocks, row.streams, dict(row.tenants)) == (0, 2, {"quiet": 3})

    run(redis_url, redis_ns, scenario)


_beats = itertools.count(1)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 1), st.sampled_from("abc"),
                              st.integers(1, 50), st.booleans()), max_size=20))
def test_tenant_counts_are_every_routers_placements_less_those_taken_back(redis_url, redis_ns, ops):
    """Whatever two routers place and take back, by tenant over two workers, each reads the same
    fleet-wide count per tenant: the sum of what stands (never negative), and nothing once each
    worker has beaten again."""
    base = 1000.0 + next(_beats) * 10                  # a fresh beat per example: no leftovers
    beats = [make_stats(f"decode-{i}", updated_at_unix_s=base) for i in range(2)]
    later = [make_stats(f"decode-{i}", updated_at_unix_s=base + 0.5) for i in range(2)]

    async def scenario(one: FleetState, two: FleetState):
        routers = [ledger(one), ledger(two)]
        standing: dict[tuple[int, int, str], list[int]] = {}
        for r, w, tenant, blocks, back in ops:
            mine = standing.setdefault((r, w, tenant), [])
            if back and mine:
                await routers[r].take_back(beats[w], mine.pop(), tenant)
            else:
                await routers[r].add(beats[w], blocks, tenant)
                mine.append(blocks)
        want: dict[str, int] = {}
        for (_, _, tenant), placed in standing.items():
            if sum(placed):
                want[tenant] = want.get(tenant, 0) + sum(placed)
        for router in routers:
            await router.read(beats)
            assert router.tenant_blocks(beats) == want
            await router.read(later)
            assert router.tenant_blocks(later) == {}

    run(redis_url, redis_ns, scenario, clients=2)
