"""Tenant quota state written around kvfleet (by something that can write to Redis) is bounded:
a lease can hold a slot at most one TTL ahead, a forged minute window lasts at most one window,
and a value that is not a count is dropped, never a crash. Against a real redis-server and
EmbeddedRedis (`any_redis_url`), with the clock as an input.

Also the ordinary race of a lease renewal and a stream's finish: the renewal puts the finished
lease back, the gateway drops it again, and no "lost" lease is reported.
"""
from __future__ import annotations

import asyncio
import logging

from services.gateway.config import ApiKey
from services.gateway.quota import Quotas
from services.state.fleet_state import MAX_WINDOW_TTL_MS, WINDOW_S, FleetState, LeaseTerms
from tests.state.state_helpers import charge_tokens, tenant_counters
from tests.state.test_fleet_state import T0, run

TERMS = LeaseTerms(ttl_s=10.0, renew_every_s=2.0)


def admit(fs: FleetState, now: float, tenant: str = "t", streams: int = 1, rpm: int = 100,
          prompt: int = 1, tpm: int = 1000):
    return fs.admit(tenant, streams, rpm, prompt, tpm, now=now, terms=TERMS)


def test_a_lease_further_ahead_than_one_ttl_is_dropped_at_admission_and_logged(
        any_redis_url, redis_ns, caplog):
    """Someone wrote a lease expiring in a year: the tenant would be locked out for that long."""
    async def scenario(fs: FleetState):
        await fs._r.zadd(fs._leases_key("t"), {"forged": (T0 + 365 * 86400) * 1000})
        granted = await admit(fs, T0)
        assert granted.admitted
        assert await fs._r.zrange(fs._leases_key("t"), 0, -1) == [granted.lease.lease_id]

    with caplog.at_level(logging.WARNING):
        run(any_redis_url, redis_ns, scenario)
    assert "dropped 1 stream leases expiring more than 12 s ahead" in caplog.text


def test_a_lease_one_ttl_ahead_holds_its_slot(any_redis_url, redis_ns):
    """The bound leaves an honest lease alone, also one a gateway whose clock is a little ahead
    set (up to a renewal period)."""
    async def scenario(fs: FleetState):
        ahead = T0 + TERMS.ttl_s + TERMS.renew_every_s
        await fs._r.zadd(fs._leases_key("t"), {"other-gateway/1": ahead * 1000})
        refused = await admit(fs, T0)
        assert refused.refused == "streams"
        assert await fs._r.zrange(fs._leases_key("t"), 0, -1) == ["other-gateway/1"]

    run(any_redis_url, redis_ns, scenario)


def test_a_forged_token_window_lasts_one_window_at_most(any_redis_url, redis_ns, caplog):
    """A huge token count with no TTL (it would 429 the tenant for good) is dropped at the next
    admission; one with a TTL longer than any window kvfleet writes is dropped too; one within a
    window's TTL refuses the tenant until it expires, as any count of that window would."""
    async def scenario(fs: FleetState):
        key = fs._window_key("t", "tokens", T0)
        await fs._r.set(key, 10 ** 12)                                 # no TTL
        assert (await admit(fs, T0)).admitted
        assert await fs._r.get(key) == "1"                             # recounted from zero

        await fs._r.set(key, 10 ** 12, px=MAX_WINDOW_TTL_MS * 10)      # too long a TTL
        assert (await admit(fs, T0, streams=2)).admitted

        await fs._r.set(key, 10 ** 12, px=MAX_WINDOW_TTL_MS - 1000)    # within one window
        assert (await admit(fs, T0, streams=3)).refused == "tokens"
        assert fs._window_key("t", "tokens", T0 + 2 * WINDOW_S) != key  # the next windows are new keys

    with caplog.at_level(logging.WARNING):
        run(any_redis_url, redis_ns, scenario)
    assert caplog.text.count("dropped 1 quota windows kvfleet did not write") == 2


def test_a_window_that_is_not_a_count_is_dropped_not_a_crash(any_redis_url, redis_ns):
    async def scenario(fs: FleetState):
        tokens = fs._window_key("t", "tokens", T0)
        requests = fs._window_key("t", "requests", T0)
        await fs._r.set(requests, "lots", px=30_000)
        await fs._r.rpush(tokens, "a list, not a count")
        granted = await admit(fs, T0)
        assert granted.admitted
        assert await fs.finish_stream(granted.lease, 5, now=T0 + 1)
        counters = await tenant_counters(fs, "t", now=T0 + 1)
        assert (counters.requests, counters.tokens) == (1, 6)

        await fs._r.set(tokens, "-7", px=30_000)
        assert await charge_tokens(fs, "t", 3, 100, now=T0 + 2) == (True, 0.0)
        assert await fs._r.get(tokens) == "3"

    run(any_redis_url, redis_ns, scenario)


class GatedRenewals(FleetState):
    """A FleetState whose lease renewal waits for `gate` before it goes to Redis (a real Redis
    call, held back to order it after a stream's finish)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = asyncio.Event()
        self.renewing = asyncio.Event()

    async def renew_leases(self, *args, **kwargs):
        self.renewing.set()
        await self.gate.wait()
        return await super().renew_leases(*args, **kwargs)


def test_a_renewal_that_races_a_finish_is_not_reported_as_a_lost_lease(redis_url, redis_ns, caplog):
    key = ApiKey("sk-race-0001", "acme", "interactive", 1, 100, 10_000)

    async def scenario():
        state = GatedRenewals(redis_url, namespace=redis_ns)
        try:
            quotas = Quotas(state, "gw-0", TERMS)
            lease = await quotas.admit(key, 3)
            renewal = asyncio.create_task(quotas.renew_once())   # takes the held leases, then waits
            await state.renewing.wait()
            await quotas.finish(lease, 4)                        # the stream ends meanwhile
            state.gate.set()                                     # the renewal puts the lease back...
            await renewal
            assert await state.streams("acme") == 0              # ...and it is dropped again
        finally:
            await state.close()

    with caplog.at_level(logging.INFO, logger="services.gateway.quota"):
        asyncio.run(scenario())
    assert "had lost" not in caplog.text


def test_a_lease_redis_really_lost_is_added_back_and_reported(redis_url, redis_ns, caplog):
    key = ApiKey("sk-lost-0001", "acme", "interactive", 1, 100, 10_000)

    async def scenario():
        state = FleetState(redis_url, namespace=redis_ns)
        try:
            quotas = Quotas(state, "gw-0", TERMS)
            await quotas.admit(key, 3)
            await state._r.delete(state._leases_key("acme"))    # Redis lost it (say, a restart)
            await quotas.renew_once()
            assert await state.streams("acme") == 1
        finally:
            await state.close()

    with caplog.at_level(logging.INFO, logger="services.gateway.quota"):
        asyncio.run(scenario())
    assert "redis had lost 1 of this gateway's stream leases" in caplog.text

