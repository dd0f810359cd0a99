"""FleetState against a real redis-server and against EmbeddedRedis (`any_redis_url`): the worker
registry with TTL heartbeats, and the atomic tenant counters the gateway's quotas rest on."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from services.common.fleet_state import FleetState, WorkerRecord

T0 = 1_700_000_000.0          # 20 s into a minute (T0 % 60 == 20): its window ends at T0 + 40
WINDOW_END = T0 + 40


def make_record(worker_id: str = "w0", role: str = "decode", **changes) -> WorkerRecord:
    record = WorkerRecord(
        worker_id=worker_id, role=role, grpc_address="127.0.0.1:50051", kv_backend="tcp", block_size=16,
        kv_blocks_total=1000, kv_blocks_free=700, kv_blocks_reserved=200, kv_blocks_used=100, running=7,
        queued=3, queued_prefill_tokens=4096, prefill_tokens_per_s=12345.678901234,
        decode_tokens_per_s=0.1, model="tiny-llama", max_model_len=40960, updated_at=1_700_000_000.123456)
    return dataclasses.replace(record, **changes)


def run(url: str, ns: str, scenario, clients: int = 1):
    """asyncio.run(scenario(*states)) with `clients` FleetStates (separate pools), all closed after."""
    async def main():
        states = [FleetState(url, namespace=ns) for _ in range(clients)]
        try:
            return await scenario(*states)
        finally:
            await asyncio.gather(*(s.close() for s in states))
    return asyncio.run(main())


# --- WorkerRecord ------------------------------------------------------------------------------

def test_worker_record_hash_round_trips_every_field():
    record = make_record()
    h = record.to_hash()
    assert set(h) == {f.name for f in dataclasses.fields(WorkerRecord)}
    assert all(isinstance(v, str) for v in h.values())
    assert WorkerRecord.from_hash(h) == record
    assert WorkerRecord.from_hash({**h, "added_by_a_newer_worker": "x"}) == record


@pytest.mark.parametrize("field, value", [
    ("kv_blocks_free", None), ("updated_at", None), ("model", None),           # missing
    ("kv_blocks_free", "12.5"), ("kv_blocks_free", "lots"), ("kv_blocks_free", " 3"),
    ("kv_blocks_free", "-1"), ("updated_at", "yesterday"), ("updated_at", "nan"),
    ("role", "router"), ("kv_backend", "carrier-pigeon"), ("worker_id", ""),
])
def test_worker_record_from_hash_names_the_bad_field(field, value):
    h = make_record().to_hash()
    if value is None:
        del h[field]
    else:
        h[field] = value
    with pytest.raises(ValueError, match=rf"WorkerRecord\.{field}\b"):
        WorkerRecord.from_hash(h)


# --- worker registry ---------------------------------------------------------------------------

def test_heartbeat_round_trip_then_expiry_prunes_the_worker(any_redis_url, redis_ns):
    async def scenario(fs: FleetState):
        record = make_record("w-expiring")
        await fs.heartbeat(record, ttl_s=0.3)
        assert await fs.live_workers() == [record]
        assert await fs._r.smembers(fs._workers_key) == {"w-expiring"}

        await asyncio.sleep(0.45)  # the heartbeat goes stale
        assert await fs.live_workers() == []
        assert await fs._r.smembers(fs._workers_key) == set()  # pruned, not just hidden

    run(any_redis_url, redis_ns, scenario)


def test_heartbeat_refresh_keeps_a_worker_alive_and_updates_it(any_redis_url, redis_ns):
    async def scenario(fs: FleetState):
        await fs.heartbeat(make_record("w", running=1), ttl_s=0.3)
        await asyncio.sleep(0.2)
        await fs.heartbeat(make_record("w", running=2), ttl_s=0.3)
        await asyncio.sleep(0.2)  # 0.4 s after the first heartbeat, 0.2 s after the second
        assert [r.running for r in await fs.live_workers()] == [2]

    run(any_redis_url, redis_ns, scenario)


def test_role_filter_and_remove_worker(any_redis_url, redis_ns):
    async def scenario(fs: FleetState):
        for wid, role in [("p0", "prefill"), ("d0", "decode"), ("d1", "decode"), ("m0", "mixed")]:
            await fs.heartbeat(make_record(wid, role=role), ttl_s=30)
        assert [r.worker_id for r in await fs.live_workers()] == ["d0", "d1", "m0", "p0"]
        assert [r.worker_id for r in await fs.live_workers("decode")] == ["d0", "d1"]
        assert [r.worker_id for r in await fs.live_workers("prefill")] == ["p0"]

        await fs.remove_worker("d0")  # clean shutdown
        assert [r.worker_id for r in await fs.live_workers("decode")] == ["d1"]
        assert "d0" not in await fs._r.smembers(fs._workers_key)
        with pytest.raises(ValueError, match="role"):
            await fs.live_workers("router")

    run(any_redis_url, redis_ns, scenario)


def test_a_malformed_worker_hash_is_skipped_not_fatal(any_redis_url, redis_ns):
    async def scenario(fs: FleetState):
        await fs.heartbeat(make_record("good"), ttl_s=30)
        await fs.heartbeat(make_record("bad"), ttl_s=30)
        await fs._r.hset(fs._worker_key("bad"), "kv_blocks_free", "many")
        assert [r.worker_id for r in await fs.live_workers()] == ["good"]

    run(any_redis_url, redis_ns, scenario)


def test_namespaces_do_not_see_each_other(any_redis_url, redis_ns):
    async def scenario(a: FleetState, b: FleetState):
        b.ns = redis_ns + "other:"
        await a.heartbeat(make_record("only-in-a"), ttl_s=30)
        assert await a.acquire_stream("t", limit=1)
        assert await b.live_workers() == [] and await b.streams("t") == 0

    run(any_redis_url, redis_ns, scenario, clients=2)


# --- concurrent streams ------------------------------------------------------------------------

def test_fifty_concurrent_acquires_with_limit_ten_take_exactly_ten(any_redis_url, redis_ns):
    async def scenario(*states: FleetState):
        results = await asyncio.gather(*(states[i % len(states)].acquire_stream("acme", limit=10)
                                         for i in range(50)))
        assert sum(results) == 10
        fs = states[0]
        assert await fs.streams("acme") == 10
        assert not await fs.acquire_stream("acme", limit=10)

        await asyncio.gather(*(fs.release_stream("acme") for _ in range(13)))  # 3 more than held
        assert await fs.streams("acme") == 0
        assert await fs.acquire_stream("acme", limit=10)
        assert (await fs.tenant_counters("acme"))["streams"] == 1
        assert not await fs.acquire_stream("zero", limit=0)

    run(any_redis_url, redis_ns, scenario, clients=5)



def test_finishing_a_stream_gives_its_slot_back_and_charges_what_it_generated(any_redis_url, redis_ns):
    async def scenario(fs: FleetState):
        assert await fs.admit("acme", 2, 100, 50, 10_000, now=T0) == (None, 0.0)
        assert await fs.admit("acme", 2, 100, 50, 10_000, now=T0) == (None, 0.0)
        await fs.finish_stream("acme", 300, now=T0 + 1)
        assert await fs.tenant_counters("acme", now=T0) == {"streams": 1, "tokens": 400,
                                                            "requests": 2}
        await fs.finish_stream("acme", 0, now=T0 + 2)       # ended before any token
        await fs.finish_stream("acme", 20_000, now=T0 + 3)  # more than held, past the budget:
        counters = await fs.tenant_counters("acme", now=T0)  # never below zero, charged anyway
        assert counters == {"streams": 0, "tokens": 20_400, "requests": 2}
        refused, retry_after = await fs.admit("acme", 2, 100, 50, 10_000, now=T0 + 4)
        assert refused == "tokens" and retry_after == pytest.approx(WINDOW_END - (T0 + 4))
        with pytest.raises(ValueError):
            await fs.finish_stream("acme", -1)

    run(any_redis_url, redis_ns, scenario)

# --- per-minute windows ------------------------------------------------------------------------

def test_charge_tokens_until_the_limit_then_refuse_with_retry_after(any_redis_url, redis_ns):
    async def scenario(fs: FleetState):
        assert await fs.charge_tokens("acme", 600, 1000, now=T0) == (True, 0.0)
        assert await fs.charge_tokens("acme", 400, 1000, now=T0 + 1) == (True, 0.0)  # exactly at the limit
        allowed, retry_after = await fs.charge_tokens("acme", 1, 1000, now=T0 + 10)
        assert not allowed and retry_after == pytest.approx(WINDOW_END - (T0 + 10))
        assert 0 < retry_after <= 60
        assert (await fs.tenant_counters("acme", now=T0))["tokens"] == 1000

    run(any_redis_url, redis_ns, scenario)


def test_a_refused_charge_consumes_nothing(any_redis_url, redis_ns):
    async def scenario(fs: FleetState):
        assert (await fs.charge_tokens("acme", 900, 1000, now=T0))[0]
        assert not (await fs.charge_tokens("acme", 200, 1000, now=T0))[0]   # would pass the limit
        assert not (await fs.charge_tokens("acme", 5000, 1000, now=T0))[0]  # bigger than any window
        assert (await fs.tenant_counters("acme", now=T0))["tokens"] == 900
        assert (await fs.charge_tokens("acme", 100, 1000, now=T0))[0]        # what is left still fits

    run(any_redis_url, redis_ns, scenario)


def test_a_new_minute_starts_fresh_and_windows_expire(any_redis_url, redis_ns):
    async def scenario(fs: FleetState):
        assert (await fs.charge_tokens("acme", 1000, 1000, now=T0))[0]
        assert not (await fs.charge_tokens("acme", 1, 1000, now=WINDOW_END - 0.001))[0]
        assert await fs.charge_tokens("acme", 1000, 1000, now=WINDOW_END) == (True, 0.0)
        assert (await fs.tenant_counters("acme", now=WINDOW_END))["tokens"] == 1000
        key = fs._window_key("acme", "tokens", T0)
        assert 0 < await fs._r.pttl(key) <= 120_000  # every window key carries a TTL

    run(any_redis_url, redis_ns, scenario)


def test_retry_after_is_in_range_at_the_window_edges(any_redis_url, redis_ns):
    async def scenario(fs: FleetState):
        start = T0 - 20  # the window's first instant
        for now, expected in [(start, 60.0), (start + 59.999, 0.001)]:
            allowed, retry_after = await fs.charge_request("edge", 0, now=now)
            assert not allowed and retry_after == pytest.approx(expected, abs=1e-6) and 0 < retry_after <= 60

    run(any_redis_url, redis_ns, scenario)


def test_charge_request_counters_and_reset(any_redis_url, redis_ns):
    async def scenario(fs: FleetState):
        results = await asyncio.gather(*(fs.charge_request("acme", 5, now=T0) for _ in range(8)))
        assert [ok for ok, _ in results].count(True) == 5
        await fs.charge_tokens("acme", 42, 1000, now=T0)
        await fs.acquire_stream("acme", limit=4)
        assert await fs.tenant_counters("acme", now=T0) == {"streams": 1, "tokens": 42, "requests": 5}
        assert await fs.tenant_counters("other", now=T0) == {"streams": 0, "tokens": 0, "requests": 0}

        await fs.reset_tenant("acme", now=T0)
        assert await fs.tenant_counters("acme", now=T0) == {"streams": 0, "tokens": 0, "requests": 0}
        assert (await fs.charge_request("acme", 5, now=T0))[0]
        with pytest.raises(ValueError, match="negative"):
            await fs.charge_tokens("acme", -1, 1000, now=T0)

    run(any_redis_url, redis_ns, scenario)


def test_earlier_tests_left_no_keys_behind(any_redis_url):
    """The `redis_ns` contract: every namespace is emptied after its test (this file runs in order)."""
    import redis

    client = redis.Redis.from_url(any_redis_url)
    try:
        assert list(client.scan_iter(match="kvfleet-test-*", count=1000)) == []
    finally:
        client.close()


def test_admit_takes_slot_request_and_tokens_in_one_step_or_refuses_cleanly(any_redis_url, redis_ns):
    """One round trip for the gateway: refused at any step, no stream slot is kept; the request
    counter keeps a refused request only when the tokens refused it (OpenAI counts those)."""
    async def story():
        async with FleetState(any_redis_url, namespace=redis_ns) as state:
            now = 120.0
            assert await state.admit("t", 1, 10, 50, 100, now=now) == (None, 0.0)
            assert (await state.admit("t", 1, 10, 5, 100, now=now))[0] == "streams"
            await state.release_stream("t")
            refused, wait = await state.admit("t", 1, 10, 60, 100, now=now)   # 50 + 60 > 100
            assert refused == "tokens" and 0 < wait <= 60
            assert await state.tenant_counters("t", now=now) == {
                "streams": 0, "tokens": 50, "requests": 2}
            assert (await state.admit("t", 1, 2, 1, 100, now=now))[0] == "requests"
            assert (await state.tenant_counters("t", now=now))["streams"] == 0
    asyncio.run(story())
