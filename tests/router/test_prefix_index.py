"""The router's prefix index follows the workers' KV events: a worker's block pool records what its
prefix cache stored and evicted, the worker publishes it in batches (snapshots now and then), and the
index answers, per worker, how many leading prompt tokens it holds. The router hashes a prompt with
the engine's own function and tenant salt, so what it predicts is what the engine then finds, and
another tenant's prompt finds nothing. A gap in a worker's batches, or batches that stopped, and the
worker counts as holding nothing until its next snapshot. Real redis-server for the stream."""
from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.block_pool import BlockPool, hash_full_blocks
from services.router.prefix_index import KVEventFeed, PrefixIndex, request_block_hashes
from services.state import kv_events
from services.state.fleet_state import FleetState
from services.worker.engine_core import KVEvents
from services.worker.kv_events import KVEventPublisher, PublisherConfig
from tests.engine.scheduler_helpers import add, make_scheduler, step
from tests.state.test_fleet_state import run

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def batch(seq: int, stored=(), evicted=(), snapshot=False, worker="prefill-0", epoch="e1",
          stale_after_s=2.0) -> kv_events.KVEventBatch:
    return kv_events.KVEventBatch(worker, epoch, seq, BS, snapshot, list(stored), list(evicted),
                                  stale_after_s)


def publisher_of(pool: BlockPool, worker="prefill-0") -> KVEventPublisher:
    """A worker's publisher over a pool in this process (the engine core's TakeKVEvents)."""
    async def take(snapshot: bool) -> KVEvents:
        stored, evicted, overflowed = pool.events.take()
        if snapshot or overflowed:
            return KVEvents(0, pool.cached_hashes(), [], True)
        return KVEvents(0, stored, evicted, False)
    return KVEventPublisher(PublisherConfig(worker, pool.block_size, 0.5, snapshot_every=10), take)


def prefill(sched, prompt, tenant="a"):
    """Run one request's prompt through the scheduler (no model: it sees token ids only)."""
    req = add(sched, prompt=prompt, tenant=tenant, max_tokens=1)
    while not req.is_finished:
        step(sched)
    return req


# --- the block pool's events ------------------------------------------------------------------

def test_the_pool_records_stored_and_evicted_hashes_net_per_batch():
    pool = BlockPool(num_blocks=2, block_size=BS)
    pool.reserve("r1", 2)
    b0, b1 = pool.allocate("r1", 2)
    pool.cache_block(b0, 11)
    pool.cache_block(b1, 12)
    assert pool.events.take() == ([11, 12], [], False)
    pool.free("r1")                                # cached blocks stay in the cache when freed
    assert pool.events.take() == ([], [], False)
    pool.reserve("r2", 1)
    pool.allocate("r2", 1)                # freed tail first: the prefix's last block goes first
    assert pool.events.take() == ([], [12], False)
    assert pool.cached_hashes() == [11]


def test_a_change_log_past_its_bound_says_overflowed_instead():
    pool = BlockPool(num_blocks=2, block_size=BS)  # bound: 4 distinct hashes a batch
    pool.reserve("r", 2)
    b0, b1 = pool.allocate("r", 2)
    pool.cache_block(b0, 1)
    pool.cache_block(b1, 2)
    pool.free("r")
    for h in range(3, 6):                          # each round evicts one hash, stores another
        pool.reserve(f"x{h}", 1)
        (b,) = pool.allocate(f"x{h}", 1)
        pool.cache_block(b, h)
        pool.free(f"x{h}")
    stored, evicted, overflowed = pool.events.take()
    assert overflowed and stored == evicted == []
    assert pool.events.take() == ([], [], False)   # the reader took a snapshot; the log starts over


# --- the index follows batches ----------------------------------------------------------------

def test_the_index_follows_stored_and_evicted_events():
    clock = Clock()
    index = PrefixIndex(clock)
    chain = request_block_hashes(list(range(13)), "a", BS)        # 13 tokens: 3 usable blocks
    index.apply(batch(1, snapshot=True))
    index.apply(batch(2, stored=chain[:2]))
    assert index.cached_tokens(list(range(13)), "a", ["prefill-0", "prefill-1"]) == {
        "prefill-0": 8, "prefill-1": 0}
    index.apply(batch(3, stored=chain[2:]))
    assert index.cached_tokens(list(range(13)), "a", ["prefill-0"]) == {"prefill-0": 12}
    index.apply(batch(4, evicted=chain[1:2]))                     # a hole: only the first counts
    assert index.cached_tokens(list(range(13)), "a", ["prefill-0"]) == {"prefill-0": 4}


def test_a_missed_batch_or_a_restarted_worker_holds_nothing_until_its_next_snapshot():
    index = PrefixIndex(Clock())
    chain = request_block_hashes(list(range(13)), "a", BS)
    index.apply(batch(1, stored=chain, snapshot=True))
    index.apply(batch(3, stored=chain))                           # seq 2 never arrived
    assert index.cached_tokens(list(range(13)), "a", ["prefill-0"]) == {"prefill-0": 0}
    index.apply(batch(4, stored=chain))
    assert index.cached_tokens(list(range(13)), "a", ["prefill-0"]) == {"prefill-0": 0}
    index.apply(batch(5, stored=chain, snapshot=True))
    assert index.cached_tokens(list(range(13)), "a", ["prefill-0"]) == {"prefill-0": 12}
    index.apply(batch(1, epoch="e2"))                             # a new process: its cache is new
    assert index.cached_tokens(list(range(13)), "a", ["prefill-0"]) == {"prefill-0": 0}


def test_stale_events_are_ignored():
    clock = Clock()
    index = PrefixIndex(clock, forget_after_s=30.0)
    chain = request_block_hashes(list(range(13)), "a", BS)
    index.apply(batch(1, stored=chain, snapshot=True, stale_after_s=2.0))
    clock.now += 1.9
    assert index.cached_tokens(list(range(13)), "a", ["prefill-0"]) == {"prefill-0": 12}
    clock.now += 0.2                                              # 2.1 s without a batch
    assert index.cached_tokens(list(range(13)), "a", ["prefill-0"]) == {"prefill-0": 0}
    index.apply(batch(2))                                         # it speaks again, in sequence
    assert index.cached_tokens(list(range(13)), "a", ["prefill-0"]) == {"prefill-0": 12}
    clock.now += 31
    index.forget_quiet()
    assert index.workers == {}


# --- the router's hash chain is the engine's ----------------------------------------------------

prompts = st.lists(st.integers(0, 50_000), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(prompts, st.lists(st.integers(0, 50_000), max_size=12), st.sampled_from(["a", "b"]))
def test_what_the_index_predicts_is_what_the_engine_finds(first, turn, tenant):
    """A first turn runs on a worker; its events feed the index; the second turn (the first plus
    more) is predicted to find exactly the prefix the engine's scheduler then finds."""
    sched, _ = make_scheduler(block_size=BS)
    pub = publisher_of(sched.pool)
    index = PrefixIndex(Clock())
    index.apply(asyncio.run(pub.next_batch()))                    # the first batch: a snapshot
    done = prefill(sched, first, tenant)
    assert done.block_hashes[:len(request_block_hashes(first, tenant, BS))] == \
        request_block_hashes(first, tenant, BS)                   # the same chain, same salt
    index.apply(asyncio.run(pub.next_batch()))
    second = first + turn
    predicted = index.cached_tokens(second, tenant, ["prefill-0"])["prefill-0"]
    found = prefill(sched, second, tenant).num_cached_tokens
    assert predicted == found
    other = "b" if tenant == "a" else "a"                         # another tenant: nothing
    assert index.cached_tokens(second, other, ["prefill-0"]) == {"prefill-0": 0}


@given(st.lists(st.integers(0, 50_000), min_size=BS, max_size=40))
def test_tenants_salt_the_chain_apart(prompt):
    assert request_block_hashes(prompt + [1], "a", BS) == hash_full_blocks(
        prompt[:len(prompt) // BS * BS], BS, "a")
    assert set(request_block_hashes(prompt + [1], "a", BS)).isdisjoint(
        request_block_hashes(prompt + [1], "b", BS))


def test_no_tenant_is_the_engines_default_tenant():
    assert request_block_hashes(list(range(9)), "", BS) == request_block_hashes(
        list(range(9)), "default", BS)


# --- through Redis -----------------------------------------------------------------------------

def test_batches_travel_through_the_stream_and_a_forged_one_is_ignored(redis_url, redis_ns):
    pool = BlockPool(num_blocks=8, block_size=BS)
    pub = publisher_of(pool)
    chain = request_block_hashes(list(range(13)), "a", BS)

    async def scenario(worker: FleetState, router: FleetState):
        index = PrefixIndex()
        feed = KVEventFeed(router, index)
        assert await feed.read_once() == 0                        # from the stream's end
        pool.reserve("r", 3)
        for b, h in zip(pool.allocate("r", 3), chain):
            pool.cache_block(b, h)
        for _ in range(2):                                        # a snapshot, then a delta
            b = await pub.next_batch()
            await worker.add_kv_events(b.worker_id, kv_events.encode(b), kv_events.MAX_LEN)
        forged = batch(3, evicted=chain, worker="prefill-0", epoch=pub.epoch)
        await worker._raw.xadd(f"{redis_ns}kv-events", {"w": "prefill-0",
                                                        "b": kv_events.encode(forged)})
        assert await feed.read_once() == 2                        # the unsigned one is skipped
        assert index.cached_tokens(list(range(13)), "a", ["prefill-0"]) == {"prefill-0": 12}

    run(redis_url, redis_ns, scenario, clients=2)
