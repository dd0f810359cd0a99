"""The registry of gateways and routers in Redis (FleetState.heartbeat_service / live_services /
remove_service), against a real redis-server and the embedded one (`any_redis_url`): a record
lives as long as its heartbeats, comes back exactly as written, and a bad one never hides the rest.
The heartbeat loop (services/state/service_heartbeat.py) re-registers after an outage."""
from __future__ import annotations

import asyncio
import logging
import re

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.waiting import wait_until
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.state.fleet_state import FleetState, parse_service
from services.state.redis_server import EmbeddedRedis
from services.state.service_heartbeat import beat_forever, service_record, stop_beating
from tests.state.test_fleet_state import make_stats, run


def make_record(service_id: str = "router-0", role: str = "router", **changes) -> pb.ServiceRecord:
    return pb.ServiceRecord(**{
        "service_id": service_id, "role": role, "address": "127.0.0.1:50061",
        "metrics_url": "http://127.0.0.1:9100/metrics", "updated_at_unix_s": 1_700_000_000.5,
        "pid": 4242, **changes})


@pytest.mark.parametrize("record, why", [
    (make_record(service_id=""), "service_id is empty"),
    (make_record(role="decode"), "role 'decode'"),
    (make_record(address=""), "address is empty"),
    (make_record(updated_at_unix_s=float("inf")), "updated_at_unix_s"),
    (make_record(service_id="gateway-9", role="gateway"), "under the key of 'router-0'"),
])
def test_a_bad_record_is_refused_naming_what_is_wrong(record, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        parse_service("router-0", record.SerializeToString())


def test_a_record_lives_as_long_as_its_heartbeats_then_is_pruned(any_redis_url, redis_ns):
    async def scenario(fs: FleetState):
        router, gateway = make_record(), make_record("gateway-1", "gateway", address="127.0.0.1:8000")
        await fs.heartbeat_service(router, ttl_s=0.3)
        await fs.heartbeat_service(gateway, ttl_s=30)
        assert await fs.live_services() == [gateway, router]        # sorted by id
        assert await fs.live_services("router") == [router]
        # the router stops beating: its key expires, and the next read prunes its id from the set
        deadline = asyncio.get_running_loop().time() + 5
        while len(await fs.live_services()) == 2:
            assert asyncio.get_running_loop().time() < deadline, "the record never expired"
            await asyncio.sleep(0.05)
        assert await fs.live_services() == [gateway]
        assert await fs._raw.smembers(fs._services_key) == {b"gateway-1"}
        await fs.remove_service("gateway-1")
        assert await fs.live_services() == []
    run(any_redis_url, redis_ns, scenario)


def test_services_and_workers_are_separate_registries(redis_url, redis_ns):
    async def scenario(fs: FleetState):
        await fs.heartbeat(make_stats("router-0"), ttl_s=30)        # a worker named like a router
        await fs.heartbeat_service(make_record("router-0"), ttl_s=30)
        assert [w.role for w in await fs.live_workers()] == ["decode"]
        assert [s.role for s in await fs.live_services()] == ["router"]
        await fs.remove_service("router-0")
        assert len(await fs.live_workers()) == 1
    run(redis_url, redis_ns, scenario)


def test_heartbeat_refuses_a_record_readers_would_skip(redis_url, redis_ns):
    async def scenario(fs: FleetState):
        with pytest.raises(ValueError, match="role 'worker'"):
            await fs.heartbeat_service(make_record(role="worker"), ttl_s=1)
        with pytest.raises(ValueError, match="ttl_s"):
            await fs.heartbeat_service(make_record(), ttl_s=0)
        assert await fs.live_services() == []
    run(redis_url, redis_ns, scenario)


def test_a_malformed_record_is_skipped_and_the_rest_still_listed(redis_url, redis_ns, caplog):
    client = redis.Redis.from_url(redis_url)
    client.set(f"{redis_ns}service:garbage", b"\xff\xff\xff")
    client.sadd(f"{redis_ns}services", "garbage")
    client.close()

    async def scenario(fs: FleetState):
        await fs.heartbeat_service(make_record(), ttl_s=30)
        return await fs.live_services()
    with caplog.at_level(logging.WARNING):
        assert [s.service_id for s in run(redis_url, redis_ns, scenario)] == ["router-0"]
    assert "ignoring the service record 'garbage' in Redis: not a signed record" in caplog.text


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(service_id=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1,
                          max_size=40),
       role=st.sampled_from(["gateway", "router"]),
       # any address in the allowed networks (records elsewhere are refused: test_record_seal.py)
       address=st.builds("127.{}.{}.{}:{}".format, *[st.integers(0, 255)] * 3, st.integers(1, 65535)),
       metrics_url=st.one_of(st.just(""), st.builds("http://[::1]:{}/metrics".format,
                                                    st.integers(1, 65535))),
       at=st.floats(min_value=0, max_value=4e9), pid=st.integers(0, 2 ** 32 - 1))
def test_any_valid_record_comes_back_exactly(redis_url, redis_ns, service_id, role, address,
                                             metrics_url, at, pid):
    record = pb.ServiceRecord(service_id=service_id, role=role, address=address,
                              metrics_url=metrics_url, updated_at_unix_s=at, pid=pid)

    async def scenario(fs: FleetState):
        await fs.heartbeat_service(record, ttl_s=30)
        try:
            return await fs.live_services()
        finally:
            await fs.remove_service(service_id)
    assert run(redis_url, redis_ns, scenario) == [record]


def test_the_heartbeat_loop_registers_again_once_a_new_redis_is_there():
    """Redis goes away and a new, empty one comes up on the same port: the loop, which kept
    retrying with backoff, registers the service in it; stopping removes the record."""
    first = EmbeddedRedis().start()

    async def scenario():
        fs = FleetState(first.url)
        record = service_record("router-7", "router", "127.0.0.1:1234", "http://127.0.0.1:1/metrics")
        beat = asyncio.create_task(beat_forever(fs, record, every_s=0.1, ttl_s=0.5,
                                                log=logging.getLogger("test")))
        try:
            assert await eventually(lambda: fs.live_services(), lambda s: len(s) == 1)
            first.stop()
            second = EmbeddedRedis(port=first.port).start()
            try:
                found = await eventually(lambda: fs.live_services(), lambda s: len(s) == 1,
                                         timeout_s=15)
                assert found and found[0].service_id == "router-7" and found[0].pid > 0
                await stop_beating(beat, fs, "router-7", logging.getLogger("test"))
                assert await fs.live_services() == []
            finally:
                second.stop()
        finally:
            beat.cancel()
            await fs.close()
    asyncio.run(scenario())


async def eventually(read, ok, timeout_s: float = 5.0):
    """`await read()` until `ok(result)` (Redis errors count as not yet); the last good result."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        try:
            result = await read()
            if ok(result):
                return result
        except redis.RedisError:
            pass
        await asyncio.sleep(0.05)
    return None
