"""Registry records are signed (services/state/records.py): a reader keyed by the fleet token
takes a record only if the fleet wrote it and it points inside the fleet's networks. Against a
real redis-server and EmbeddedRedis; the forgeries are written as an intruder would, raw."""
from __future__ import annotations

import asyncio
import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.state.fleet_state import FleetState
from services.state.records import (RecordSeal, RejectedRecord, address_problem, networks_from_env,
                                    parse_networks, record_key)
from tests.state.test_fleet_state import make_stats
from tests.state.test_service_registry import make_record

TOKEN = "the-fleet-token-0123456789abcdef"
FLEET = RecordSeal.from_token(TOKEN, environ={})
LOOPBACK = parse_networks("127.0.0.0/8,::1")


def fleet_state(url: str, ns: str, seal: RecordSeal | None = None) -> FleetState:
    return FleetState(url, namespace=ns, seal=seal or RecordSeal.from_token(TOKEN, environ={}))


def read_workers(url: str, ns: str, write) -> tuple[list[str], RecordSeal]:
    """`write(fs)` (as the fleet or as an intruder), then the ids a fleet reader takes."""
    async def scenario():
        async with fleet_state(url, ns) as fs:
            await write(fs)
            return [w.worker_id for w in await fs.live_workers()], fs.seal
    return asyncio.run(scenario())


def test_a_record_the_fleet_wrote_is_read(any_redis_url, redis_ns):
    async def write(fs):
        await fs.heartbeat(make_stats("d0"), ttl_s=30)
    assert read_workers(any_redis_url, redis_ns, write)[0] == ["d0"]


@pytest.mark.parametrize("forge, reason", [
    (lambda payload: payload, "unsigned"),
    (lambda payload: RecordSeal(record_key("another-token-0123456789")).seal("worker", "evil", payload),
     "bad_signature"),
    (lambda payload: FLEET.seal("worker", "d0", payload), "bad_signature"),      # another id's MAC
    (lambda payload: FLEET.seal("service", "evil", payload), "bad_signature"),   # another kind's
    (lambda payload: FLEET.seal("worker", "evil", payload)[:-1] + b"\x00", "bad_signature"),
])
def test_a_forged_record_is_ignored_logged_and_counted(any_redis_url, redis_ns, caplog, forge,
                                                        reason):
    async def write(fs):
        await fs.heartbeat(make_stats("d0"), ttl_s=30)
        payload = make_stats("evil", grpc_address="127.0.0.1:1").SerializeToString()
        await fs._raw.set(fs._worker_key("evil"), forge(payload))
        await fs._raw.sadd(fs._workers_key, "evil")
    with caplog.at_level(logging.WARNING):
        ids, seal = read_workers(any_redis_url, redis_ns, write)
    assert ids == ["d0"]
    assert seal.rejected == {("worker", reason): 1}
    assert "ignoring the worker record 'evil' in Redis" in caplog.text


def test_a_signed_record_with_a_foreign_address_is_refused(redis_url, redis_ns, caplog):
    """Signed by the fleet (say, a worker misconfigured to advertise a public address): still
    refused, since the fleet's calls must stay on its own networks."""
    async def write(fs):
        await fs.heartbeat(make_stats("far", grpc_address="10.1.2.3:50051"), ttl_s=30)
        await fs.heartbeat(make_stats("named", grpc_address="evil.example:50051"), ttl_s=30)
        await fs.heartbeat(make_stats("scrape", metrics_url="http://192.0.2.1:9100/metrics"),
                           ttl_s=30)
        await fs.heartbeat(make_stats("v6", grpc_address="[::1]:50051"), ttl_s=30)
    with caplog.at_level(logging.WARNING):
        ids, seal = read_workers(redis_url, redis_ns, write)
    assert ids == ["v6"]
    assert seal.rejected == {("worker", "address"): 3}
    assert "address '10.1.2.3:50051' is outside the allowed networks" in caplog.text
    assert "address 'evil.example:50051' is not an IP literal" in caplog.text


def test_allowed_networks_are_configurable(redis_url, redis_ns):
    seal = RecordSeal.from_token(TOKEN, environ={"KVFLEET_ALLOWED_NETWORKS": "10.0.0.0/8"})

    async def scenario():
        async with fleet_state(redis_url, redis_ns, seal) as fs:
            await fs.heartbeat(make_stats("far", grpc_address="10.1.2.3:50051"), ttl_s=30)
            await fs.heartbeat(make_stats("near", grpc_address="127.0.0.1:50051"), ttl_s=30)
            return [w.worker_id for w in await fs.live_workers()]
    assert asyncio.run(scenario()) == ["far"]


def test_a_forged_service_record_is_ignored(redis_url, redis_ns):
    async def scenario():
        async with fleet_state(redis_url, redis_ns) as fs:
            await fs.heartbeat_service(make_record("router-0"), ttl_s=30)
            await fs._raw.set(fs._service_key("router-evil"),
                              make_record("router-evil").SerializeToString())
            await fs._raw.sadd(fs._services_key, "router-evil")
            return [s.service_id for s in await fs.live_services()], fs.seal.rejected
    assert asyncio.run(scenario()) == (["router-0"], {("service", "unsigned"): 1})


def test_the_log_is_rate_limited_per_record_and_reason(caplog):
    seal = RecordSeal(record_key(TOKEN))
    error = RejectedRecord("unsigned", "not a signed record")
    with caplog.at_level(logging.WARNING):
        for now in (0.0, 1.0, 59.0, 60.0, 61.0):
            seal.reject("worker", "evil", error, now=now)
    assert seal.rejected[("worker", "unsigned")] == 5
    assert caplog.text.count("ignoring the worker record 'evil'") == 2       # at 0 and 60


@given(payload=st.binary(max_size=200), record_id=st.text(min_size=1, max_size=30))
def test_sealing_round_trips_and_any_change_to_the_bytes_is_caught(payload, record_id):
    sealed = FLEET.seal("worker", record_id, payload)
    assert FLEET.open("worker", record_id, sealed) == payload
    for i in range(len(sealed)):
        tampered = sealed[:i] + bytes([sealed[i] ^ 1]) + sealed[i + 1:]
        with pytest.raises(RejectedRecord):
            FLEET.open("worker", record_id, tampered)


def test_without_a_token_the_networks_are_still_checked():
    """--insecure-internal (no fleet token): records carry no MAC and any is read, but only
    inside the allowed networks."""
    seal = RecordSeal(None, LOOPBACK)
    assert seal.open("worker", "w", seal.seal("worker", "w", b"x")) == b"x"
    with pytest.raises(RejectedRecord, match="outside"):
        seal.check_addresses("10.0.0.1:1")


@pytest.mark.parametrize("address, ok", [
    ("127.0.0.1:50051", True), ("127.8.9.10:1", True), ("[::1]:50051", True),
    ("localhost:9000", True), ("http://127.0.0.1:9100/metrics", True), ("", True),
    ("10.0.0.1:50051", False), ("[::2]:1", False), ("example.com:80", False),
    ("http://192.0.2.1/metrics", False), ("0.0.0.0:1", False),
])
def test_address_problem(address, ok):
    assert (address_problem(address, LOOPBACK) is None) == ok


def test_bad_allowed_networks_are_refused_by_name():
    with pytest.raises(ValueError, match="'10.0.0.0/33'"):
        networks_from_env({"KVFLEET_ALLOWED_NETWORKS": "127.0.0.0/8,10.0.0.0/33"})
    assert networks_from_env({}) == LOOPBACK
    assert repr(FLEET).count(TOKEN) == 0 and "key=" not in repr(FLEET)
