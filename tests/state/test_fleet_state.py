"""FleetState against a real redis-server and against EmbeddedRedis (`any_redis_url`): the worker
registry with TTL heartbeats, and the atomic tenant counters the gateway's quotas rest on."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import uuid

import pytest
import redis
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.state.fleet_state import (COMMAND_TIMEOUT_S, FleetState, LeaseTerms, StreamLease,
                                         parse_stats)
from tests.state.state_helpers import TenantCounters, charge_tokens, reset_tenant, tenant_counters

T0 = 1_700_000_000.0          # 20 s into a minute (T0 % 60 == 20): its window ends at T0 + 40
WINDOW_END = T0 + 40


def make_stats(worker_id: str = "w0", role: str = "decode", **changes) -> pb.WorkerStats:
    """A plausible heartbeat; `changes` overrides any field (unknown names raise)."""
    return pb.WorkerStats(**{
        "worker_id": worker_id, "role": role, "grpc_address": "127.0.0.1:50051",
        "kv_backend": "tcp", "block_size": 16, "kv_blocks_total": 1000, "kv_blocks_free": 700,
        "kv_blocks_reserved": 200, "kv_blocks_used": 100, "kv_blocks_cached": 50,
        "kv_blocks_held": 4, "kv_writes_in_flight": 1, "num_running": 7, "num_queued": 3,
        "queued_prefill_tokens": 4096, "prefill_tokens_per_s": 12345.678901234,
        "decode_tokens_per_s": 0.1, "model": "tiny-llama", "max_model_len": 40960,
        "updated_at_unix_s": 1_700_000_000.123456, **changes})


def run(url: str, ns: str, scenario, clients: int = 1):
    """asyncio.run(scenario(*states)) with `clients` FleetStates (separate pools), all closed after."""
    async def main():
        states = [FleetState(url, namespace=ns) for _ in range(clients)]
        try:
            return await scenario(*states)
        finally:
            await asyncio.gather(*(s.close() for s in states))
    return asyncio.run(main())


# --- what a heartbeat holds: the worker's stats message --------------------------------------------

def test_stats_round_trip_exactly_and_a_newer_workers_fields_are_ignored():
    stats = make_stats()
    assert parse_stats("w0", stats.SerializeToString()) == stats
    # a field number this reader does not know (a newer worker's) is no reason to skip it
    newer = parse_stats("w0", stats.SerializeToString() + b"\xf8\x3f\x01")  # field 1023 = 1
    newer.DiscardUnknownFields()
    assert newer == stats


@pytest.mark.parametrize("raw, why", [
    (b"\xff\xff\xff", "not a WorkerStats message"),
    (make_stats(role="router").SerializeToString(), "role"),
    (make_stats(kv_backend="carrier-pigeon").SerializeToString(), "kv_backend"),
    (make_stats(worker_id="").SerializeToString(), "worker_id is empty"),
    (make_stats(worker_id="w1").SerializeToString(), "under the key of 'w0'"),
    (make_stats(prefill_tokens_per_s=float("nan")).SerializeToString(), "prefill_tokens_per_s"),
    (make_stats(updated_at_unix_s=-1.0).SerializeToString(), "updated_at_unix_s"),
])
def test_a_bad_record_is_refused_naming_what_is_wrong(raw, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        parse_stats("w0", raw)


# --- worker registry ---------------------------------------------------------------------------

def test_heartbeat_round_trip_then_expiry_prunes_the_worker(any_redis_url, redis_ns):
    async def scenario(fs: FleetState):
        record = make_stats("w-expiring")
        await fs.heartbeat(record, ttl_s=0.3)
        assert await fs.live_workers() == [record]
        assert await fs._r.smembers(fs._workers_key) == {"w-expiring"}
        assert await fs._r.pttl(fs._worker_key("w-expiring")) <= 300

        await asyncio.sleep(0.45)  # the heartbeat goes stale
        assert await fs.live_workers() == []
        assert await fs._r.smembers(fs._workers_key) == set()  # pruned, not just hidden

    run(any_redis_url, redis_ns, scenario)


def test_heartbeat_refresh_keeps_a_worker_alive_and_updates_it(any_redis_url, redis_ns):
    async def scenario(fs: FleetState):
        await fs.heartbeat(make_stats("w", num_running=1), ttl_s=0.3)
        await asyncio.sleep(0.2)
        await fs.heartbeat(make_stats("w", num_running=2), ttl_s=0.3)
        await asyncio.sleep(0.2)  # 0.4 s after the first heartbeat, 0.2 s after the second
        assert [r.num_running for r in await fs.live_workers()] == [2]

    run(any_redis_url, redis_ns, scenario)


def test_role_filter_and_remove_worker(any_redis_url, redis_ns):
    async def scenario(fs: FleetState):
        for wid, role in [("p0", "prefill"), ("d0", "decode"), ("d1", "decode"), ("m0", "mixed")]:
            await fs.heartbeat(make_stats(wid, role=role), ttl_s=30)
        assert [r.worker_id for r in await fs.live_workers()] == ["d0", "d1", "m0", "p0"]
        assert [r.worker_id for r in await fs.live_workers("decode")] == ["d0", "d1"]
        assert [r.worker_id for r in await fs.live_workers("prefill")] == ["p0"]

        await fs.remove_worker("d0")  # clean shutdown
        assert [r.worker_id for r in await fs.live_workers("decode")] == ["d1"]
        assert "d0" not in await fs._r.smembers(fs._workers_key)
        with pytest.raises(ValueError, match="role"):
            await fs.live_workers("router")

    run(any_redis_url, redis_ns, scenario)


def test_a_malformed_record_is_skipped_with_a_warning_not_fatal(any_redis_url, redis_ns, caplog):
    async def scenario(fs: FleetState):
        for wid in ("good", "garbled", "impostor", "bad-role"):
            await fs.heartbeat(make_stats(wid), ttl_s=30)
        # signed with the fleet's key (so only what is in them is wrong)
        sealed = lambda wid, payload: fs.seal.seal("worker", wid, payload)  # noqa: E731
        await fs._raw.set(fs._worker_key("garbled"), sealed("garbled", b"\xff\x00 not protobuf"))
        await fs._raw.set(fs._worker_key("impostor"),
                          sealed("impostor", make_stats("good").SerializeToString()))
        await fs._raw.set(fs._worker_key("bad-role"), sealed(
            "bad-role", make_stats("bad-role", role="router").SerializeToString()))
        assert [r.worker_id for r in await fs.live_workers()] == ["good"]
        assert await fs._r.smembers(fs._workers_key) == {"good", "garbled", "impostor", "bad-role"}

    run(any_redis_url, redis_ns, scenario)
    skipped = {r.args[0] for r in caplog.records if "malformed heartbeat" in r.getMessage()}
    assert skipped == {"garbled", "impostor", "bad-role"}


def test_a_worker_cannot_publish_a_record_readers_would_skip(any_redis_url, redis_ns):
    async def scenario(fs: FleetState):
        with pytest.raises(ValueError, match="kv_backend"):
            await fs.heartbeat(make_stats("w", kv_backend="smoke-signals"), ttl_s=30)
        with pytest.raises(ValueError, match="ttl_s"):
            await fs.heartbeat(make_stats("w"), ttl_s=0)
        assert await fs.live_workers() == []

    run(any_redis_url, redis_ns, scenario)


def test_namespaces_do_not_see_each_other(any_redis_url, redis_ns):
    async def scenario(a: FleetState, b: FleetState):
        b.ns = redis_ns + "other:"
        await a.heartbeat(make_stats("only-in-a"), ttl_s=30)
        assert (await a.admit("t", 1, 10, 1, 10)).admitted
        assert await b.live_workers() == [] and await b.streams("t") == 0

    run(any_redis_url, redis_ns, scenario, clients=2)


# --- stream leases ------------------------------------------------------------------------------
# A gateway's stream slot is a lease: `admit` takes it, its holder renews it, `finish_stream` drops
# it; a holder that stops renewing loses it `ttl_s` later. Time is an input here (`now`).

TERMS = LeaseTerms(ttl_s=10.0, renew_every_s=2.0)     # lapsed when less than 6 s is left
BIG = dict(requests_per_minute=10_000, prompt_tokens=1, tokens_per_minute=10_000_000)


async def take(fs: FleetState, tenant: str, limit: int, now: float = T0, lease_id: str | None = None):
    return await fs.admit(tenant, limit, now=now, lease_id=lease_id, terms=TERMS, **BIG)


def test_fifty_concurrent_admits_with_limit_ten_take_exactly_ten(any_redis_url, redis_ns):
    async def scenario(*states: FleetState):
        results = await asyncio.gather(*(take(states[i % len(states)], "acme", 10) for i in range(50)))
        leases = [r.lease for r in results if r.admitted]
        assert len(leases) == 10 and len({x.lease_id for x in leases}) == 10
        assert {r.refused for r in results if not r.admitted} == {"streams"}
        fs = states[0]
        assert await fs.streams("acme", now=T0) == 10
        assert not (await take(fs, "acme", 10)).admitted

        held = await asyncio.gather(*(fs.finish_stream(x, 0, now=T0) for x in leases))
        again = await asyncio.gather(*(fs.finish_stream(x, 0, now=T0) for x in leases[:3]))
        assert all(held) and not any(again)           # a second finish gives nothing back twice
        assert await fs.streams("acme", now=T0) == 0
        assert await fs._r.exists(fs._leases_key("acme")) == 0     # no empty key left behind
        assert (await take(fs, "acme", 10)).admitted
        assert (await tenant_counters(fs, "acme", now=T0)).streams == 1
        assert not (await take(fs, "zero", 0)).admitted

    run(any_redis_url, redis_ns, scenario, clients=5)


def test_a_holder_that_stops_renewing_loses_its_slots_after_the_ttl(any_redis_url, redis_ns):
    """Gateway a renews, gateway b dies holding two slots: b's slots come back 10 s after its
    last renewal, and while they lapse the refusal says exactly when the first frees."""
    async def scenario(fs: FleetState):
        a1 = (await take(fs, "t", 3, now=T0, lease_id="a/1")).lease
        b1 = (await take(fs, "t", 3, now=T0 + 1, lease_id="b/1")).lease
        b2 = (await take(fs, "t", 3, now=T0 + 2, lease_id="b/2")).lease
        assert all((a1, b1, b2))
        refused = await take(fs, "t", 3, now=T0 + 3)
        assert refused.refused == "streams"
        assert refused.retry_after_s is None            # every holder renewed recently: unknown

        for t in (T0 + 2, T0 + 4):                      # a renews; b is gone
            assert await fs.renew_leases([a1], TERMS, now=t) == []
        # b1 expires at T0 + 11: with less than 6 s left at T0 + 5.5 it has missed renewals
        refused = await take(fs, "t", 3, now=T0 + 5.5)
        assert refused.refused == "streams" and refused.retry_after_s == pytest.approx(5.5)
        for t in (T0 + 6, T0 + 8, T0 + 10):
            assert await fs.renew_leases([a1], TERMS, now=t) == []
        assert await fs.streams("t", now=T0 + 10.9) == 3
        assert await fs.streams("t", now=T0 + 11) == 2          # b1 gone, b2 still counted
        assert (await take(fs, "t", 3, now=T0 + 11, lease_id="a/2")).admitted
        refused = await take(fs, "t", 3, now=T0 + 11)
        assert refused.retry_after_s == pytest.approx(1.0)      # b2 frees at T0 + 12
        assert await fs.streams("t", now=T0 + 12) == 2
        assert await fs.finish_stream(b2, 0, now=T0 + 12) is False   # lapsed: nothing to give back

    run(any_redis_url, redis_ns, scenario)


def test_the_retry_hint_names_the_lease_whose_expiry_frees_a_slot(any_redis_url, redis_ns):
    """Over the limit by two (the limit was lowered): the second lapsing lease frees the slot."""
    async def scenario(fs: FleetState):
        for i in range(3):
            assert (await take(fs, "t", 3, now=T0 + i, lease_id=f"dead/{i}")).admitted
        refused = await take(fs, "t", 2, now=T0 + 6)        # expiries T0+10, T0+11, T0+12
        assert refused.retry_after_s == pytest.approx(5.0)  # live 3, limit 2: two must go

    run(any_redis_url, redis_ns, scenario)


def test_renewal_adds_back_leases_redis_lost_and_says_which(any_redis_url, redis_ns):
    async def scenario(fs: FleetState):
        x = (await take(fs, "t", 5, lease_id="g/1")).lease
        y = (await take(fs, "u", 5, lease_id="g/2")).lease
        await reset_tenant(fs, "t", now=T0)                  # as an empty Redis would be
        assert await fs.streams("t", now=T0) == 0
        assert await fs.renew_leases([x, y], TERMS, now=T0 + 1) == [x]
        assert await fs.streams("t", now=T0 + 1) == 1 and await fs.streams("u", now=T0 + 1) == 1
        lapsed = await fs.renew_leases([x], TERMS, now=T0 + 30)     # renewed too late: back too
        assert lapsed == [x] and await fs.streams("t", now=T0 + 30) == 1

    run(any_redis_url, redis_ns, scenario)


def test_a_lease_key_expires_with_its_latest_lease(any_redis_url, redis_ns):
    async def scenario(fs: FleetState):
        now = time.time()
        lease = (await take(fs, "t", 5, now=now)).lease
        assert 0 < await fs._r.pttl(fs._leases_key("t")) <= TERMS.ttl_s * 1000
        await fs.renew_leases([lease], TERMS, now=now + 5)
        assert 9000 < await fs._r.pttl(fs._leases_key("t")) <= 15_000

    run(any_redis_url, redis_ns, scenario)


def test_finishing_a_stream_gives_its_slot_back_and_charges_what_it_generated(any_redis_url, redis_ns):
    async def scenario(fs: FleetState):
        first = await fs.admit("acme", 2, 100, 50, 10_000, now=T0)
        second = await fs.admit("acme", 2, 100, 50, 10_000, now=T0)
        assert first.admitted and second.admitted and first.refused is None
        assert await fs.finish_stream(first.lease, 300, now=T0 + 1)
        assert await tenant_counters(fs, "acme", now=T0) == TenantCounters(streams=1, tokens=400,
                                                                          requests=2)
        assert await fs.finish_stream(second.lease, 20_000, now=T0 + 3)   # past the budget:
        counters = await tenant_counters(fs, "acme", now=T0)                # charged anyway
        assert counters == TenantCounters(streams=0, tokens=20_400, requests=2)
        refused = await fs.admit("acme", 2, 100, 50, 10_000, now=T0 + 4)
        assert refused.refused == "tokens"
        assert refused.retry_after_s == pytest.approx(WINDOW_END - (T0 + 4))
        with pytest.raises(ValueError):
            await fs.finish_stream(first.lease, -1)

    run(any_redis_url, redis_ns, scenario)


# --- per-minute windows ------------------------------------------------------------------------

def test_charge_tokens_until_the_limit_then_refuse_with_retry_after(any_redis_url, redis_ns):
    async def scenario(fs: FleetState):
        assert await charge_tokens(fs, "acme", 600, 1000, now=T0) == (True, 0.0)
        assert await charge_tokens(fs, "acme", 400, 1000, now=T0 + 1) == (True, 0.0)  # exactly at the limit
        allowed, retry_after = await charge_tokens(fs, "acme", 1, 1000, now=T0 + 10)
        assert not allowed and retry_after == pytest.approx(WINDOW_END - (T0 + 10))
        assert 0 < retry_after <= 60
        assert (await tenant_counters(fs, "acme", now=T0)).tokens == 1000

    run(any_redis_url, redis_ns, scenario)


def test_a_refused_charge_consumes_nothing(any_redis_url, redis_ns):
    async def scenario(fs: FleetState):
        assert (await charge_tokens(fs, "acme", 900, 1000, now=T0))[0]
        assert not (await charge_tokens(fs, "acme", 200, 1000, now=T0))[0]   # would pass the limit
        assert not (await charge_tokens(fs, "acme", 5000, 1000, now=T0))[0]  # bigger than any window
        assert (await tenant_counters(fs, "acme", now=T0)).tokens == 900
        assert (await charge_tokens(fs, "acme", 100, 1000, now=T0))[0]        # what is left still fits

    run(any_redis_url, redis_ns, scenario)


def test_a_new_minute_starts_fresh_and_windows_expire(any_redis_url, redis_ns):
    async def scenario(fs: FleetState):
        assert (await charge_tokens(fs, "acme", 1000, 1000, now=T0))[0]
        assert not (await charge_tokens(fs, "acme", 1, 1000, now=WINDOW_END - 0.001))[0]
        assert await charge_tokens(fs, "acme", 1000, 1000, now=WINDOW_END) == (True, 0.0)
        assert (await tenant_counters(fs, "acme", now=WINDOW_END)).tokens == 1000
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
        await charge_tokens(fs, "acme", 42, 1000, now=T0)
        assert (await take(fs, "acme", 4)).admitted           # 1 more token, 1 more request
        assert await tenant_counters(fs, "acme", now=T0) == TenantCounters(1, 43, 6)
        assert await tenant_counters(fs, "other", now=T0) == TenantCounters(0, 0, 0)

        await reset_tenant(fs, "acme", now=T0)
        assert await tenant_counters(fs, "acme", now=T0) == TenantCounters(0, 0, 0)
        assert (await fs.charge_request("acme", 5, now=T0))[0]
        with pytest.raises(ValueError, match="negative"):
            await charge_tokens(fs, "acme", -1, 1000, now=T0)

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
            first = await state.admit("t", 1, 10, 50, 100, now=now)
            assert first.admitted
            assert (await state.admit("t", 1, 10, 5, 100, now=now)).refused == "streams"
            await state.finish_stream(first.lease, 0, now=now)
            refused = await state.admit("t", 1, 10, 60, 100, now=now)   # 50 + 60 > 100
            assert refused.refused == "tokens" and 0 < refused.retry_after_s <= 60
            assert refused.lease is None
            assert await tenant_counters(state, "t", now=now) == TenantCounters(0, 50, 2)
            assert (await state.admit("t", 1, 2, 1, 100, now=now)).refused == "requests"
            assert (await tenant_counters(state, "t", now=now)).streams == 0
    asyncio.run(story())


# --- property: any interleaving of admit / renew / finish / gateway death / time -----------------

class LeaseMachine(RuleBasedStateMachine):
    """Three gateways share one tenant (limit 3) against a real Redis; a model keeps each lease's
    expiry. After every step Redis counts exactly the model's live leases (never negative, never
    drifting), and every admit, refusal hint, renewal and finish says what the model says."""

    url = ns = ""
    LIMIT = 3

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.fs = FleetState(self.url, namespace=self.ns)
        self.tenant = f"prop-{uuid.uuid4().hex[:8]}"
        self.now = T0
        self.expiry: dict[str, float] = {}               # lease id -> expiry, as Redis holds it
        self.held = {g: set() for g in "abc"}           # what each gateway thinks it holds
        self.alive = set("abc")
        self.seq = 0

    def _run(self, coro):
        return self.loop.run_until_complete(coro)

    def _live(self) -> list[float]:
        return sorted(e for e in self.expiry.values() if e > self.now)

    @rule(g=st.sampled_from("abc"))
    def admit(self, g):
        assume(g in self.alive)
        self.seq += 1
        lease_id = f"{g}/{self.seq}"
        got = self._run(take(self.fs, self.tenant, self.LIMIT, now=self.now, lease_id=lease_id))
        live = self._live()
        self.expiry = {i: e for i, e in self.expiry.items() if e > self.now}   # the script prunes
        if len(live) < self.LIMIT:
            assert got.admitted and got.lease.lease_id == lease_id
            self.expiry[lease_id] = self.now + TERMS.ttl_s
            self.held[g].add(lease_id)
            return
        assert got.refused == "streams"
        left = live[len(live) - self.LIMIT] - self.now      # the lease whose expiry frees a slot
        expected = left if left < TERMS.lapsed_below_s else None
        assert got.retry_after_s == (None if expected is None else pytest.approx(expected, abs=1e-3))

    @rule(g=st.sampled_from("abc"), data=st.data())
    def finish(self, g, data):
        assume(g in self.alive and self.held[g])
        lease_id = data.draw(st.sampled_from(sorted(self.held[g])))
        self.held[g].discard(lease_id)
        was_live = self.expiry.pop(lease_id, 0.0) > self.now
        assert self._run(self.fs.finish_stream(StreamLease(self.tenant, lease_id), 7,
                                               now=self.now)) is was_live

    @rule(g=st.sampled_from("abc"))
    def renew(self, g):
        assume(g in self.alive)
        leases = [StreamLease(self.tenant, i) for i in sorted(self.held[g])]
        restored = self._run(self.fs.renew_leases(leases, TERMS, now=self.now))
        assert {x.lease_id for x in restored} == {
            i for i in self.held[g] if self.expiry.get(i, 0.0) <= self.now}
        for i in self.held[g]:
            self.expiry[i] = self.now + TERMS.ttl_s

    @rule(seconds=st.floats(0.0, 12.0))
    def advance(self, seconds):
        self.now += round(seconds, 3)

    @rule(g=st.sampled_from("abc"))
    def kill(self, g):
        self.alive.discard(g)                       # its leases stay, unrenewed, until they lapse

    @invariant()
    def redis_counts_exactly_the_live_leases(self):
        counted = self._run(self.fs.streams(self.tenant, now=self.now))
        assert counted == len(self._live()) >= 0

    def teardown(self):
        self._run(self.fs._r.delete(self.fs._leases_key(self.tenant)))
        self._run(self.fs.close())
        self.loop.close()


def test_any_interleaving_keeps_the_lease_count_exact(redis_url, redis_ns):
    LeaseMachine.url, LeaseMachine.ns = redis_url, redis_ns
    run_state_machine_as_test(LeaseMachine, settings=settings(
        max_examples=60, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow]))


# --- a Redis that stops answering -----------------------------------------------------------------

def test_a_hung_redis_fails_a_call_within_the_timeout_and_the_client_recovers():
    """SIGSTOP: the server accepts nothing and answers nothing. A call fails after
    COMMAND_TIMEOUT_S (never a hang); once it answers again, the same FleetState works."""
    from services.state.redis_server import RedisServerProcess

    async def scenario(fs: FleetState, pid: int):
        assert (await take(fs, "t", 5)).admitted
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(redis.exceptions.TimeoutError):
                await take(fs, "t", 5)
            assert time.monotonic() - start < COMMAND_TIMEOUT_S + 0.5
        finally:
            os.kill(pid, signal.SIGCONT)
        assert (await take(fs, "t", 5)).admitted
        # the timed-out admit may have run once the server woke: 2 or 3 leases, never a hang
        assert await fs.streams("t", now=T0) in (2, 3)

    with RedisServerProcess() as server:
        run(server.url, "hung:", lambda fs: scenario(fs, server.process.pid))
