"""Asynchronous jobs in Redis (the real server and the embedded one): a job reads back as it was
stored, only a lapsed lease can be claimed, a gateway that lost a job learns so when it renews,
and a finished job stays finished and expires."""
from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from services.state.jobs import Job, JobStore

NOW = 1_000_000.0
LEASE_S = 10.0
KEY = "ab" * 32
DEADLINE_ERROR = '{"code": "job_deadline_exceeded"}'


def claim(store, holder: str, now: float, keys: tuple[str, ...] = (KEY,)):
    return store.claim(holder, LEASE_S, list(keys), 60, DEADLINE_ERROR, now=now)


def run(url: str, ns: str, scenario):
    async def main():
        r = aioredis.Redis.from_url(url, decode_responses=True)
        try:
            return await scenario(JobStore(r, ns), r)
        finally:
            await r.aclose()
    return asyncio.run(main())


def job(job_id: str = "job-1", owner: str = "gw-a") -> Job:
    return Job(id=job_id, tenant="acme", key_id=KEY, kind="chat", traffic_class="document",
               body='{"messages": []}', created_s=NOW, deadline_s=NOW + 3600, owner=owner,
               updated_s=NOW)


def test_a_stored_job_reads_back_as_it_was(any_redis_url, redis_ns):
    async def scenario(store, r):
        await store.create(job(), LEASE_S, ttl_s=60, now=NOW)
        assert await store.get("job-1") == job()
        assert await store.get("job-unknown") is None
        await r.hset(f"{redis_ns}job:job-bad", mapping={"id": "job-bad", "state": "queued"})
        assert await store.get("job-bad") is None          # not a whole job: no job
    run(any_redis_url, redis_ns, scenario)


def test_only_a_lapsed_lease_is_claimed_and_its_old_owner_learns_it_lost_the_job(any_redis_url,
                                                                                redis_ns):
    async def scenario(store, r):
        await store.create(job(), LEASE_S, ttl_s=60, now=NOW)
        assert await claim(store, "gw-b", NOW + 1) == []          # gw-a still holds it
        assert await store.renew("gw-a", ["job-1"], LEASE_S, now=NOW + 5) == []
        assert await claim(store, "gw-b", NOW + 14) == []         # renewed to NOW + 15
        assert await claim(store, "gw-b", NOW + 16) == ["job-1"]  # gw-a went quiet
        assert (await store.get("job-1")).owner == "gw-b"
        assert await store.renew("gw-a", ["job-1"], LEASE_S, now=NOW + 17) == ["job-1"]
        assert await store.renew("gw-b", ["job-1"], LEASE_S, now=NOW + 17) == []
    run(any_redis_url, redis_ns, scenario)


def test_a_finished_job_stays_finished_leaves_the_leases_and_expires(any_redis_url, redis_ns):
    async def scenario(store, r):
        await store.create(job(), LEASE_S, ttl_s=60, now=NOW)
        assert await store.update("job-1", state="running", attempts=1)
        assert await store.finish("job-1", "completed", ttl_s=30, result='{"id": "x"}')
        done = await store.get("job-1")
        assert (done.state, done.attempts, done.result) == ("completed", 1, '{"id": "x"}')
        assert not await store.update("job-1", state="queued")             # never reopened
        assert not await store.finish("job-1", "failed", ttl_s=30, error="{}")
        assert await claim(store, "gw-b", NOW + 10_000) == []   # nothing to take over
        assert 0 < await r.ttl(f"{redis_ns}job:job-1") <= 30
        assert await r.zcard(f"{redis_ns}jobs:leases") == 0
    run(any_redis_url, redis_ns, scenario)


def test_a_gateway_claims_only_jobs_of_its_keys_and_anyone_fails_one_past_its_deadline(
        any_redis_url, redis_ns):
    async def scenario(store, r):
        await store.create(job(), LEASE_S, ttl_s=60, now=NOW)
        assert await claim(store, "gw-other-keys", NOW + 20, keys=("cd" * 32,)) == []
        assert (await store.get("job-1")).state == "queued"           # waits for its key
        assert await claim(store, "gw-other-keys", NOW + 3601, keys=()) == []
        failed = await store.get("job-1")
        assert (failed.state, failed.error) == ("failed", DEADLINE_ERROR)
        assert await r.zcard(f"{redis_ns}jobs:leases") == 0
    run(any_redis_url, redis_ns, scenario)


def test_release_lets_another_gateway_claim_at_once(any_redis_url, redis_ns):
    async def scenario(store, r):
        await store.create(job("job-1"), LEASE_S, ttl_s=60, now=NOW)
        await store.create(job("job-2"), LEASE_S, ttl_s=60, now=NOW)
        await store.release(["job-1"])
        assert await claim(store, "gw-b", NOW + 1) == ["job-1"]
    run(any_redis_url, redis_ns, scenario)


texts = st.text(min_size=1, max_size=40)


@settings(max_examples=30, deadline=None)
@given(tenant=texts, body=st.text(max_size=200), attempts=st.integers(0, 10_000),
       created=st.floats(0, 4e9, allow_nan=False))
def test_any_job_survives_its_hash(tenant, body, attempts, created):
    stored = Job(id="job-x", tenant=tenant, key_id="k", kind="completion",
                 traffic_class="batch", body=body, created_s=created, deadline_s=created + 1,
                 attempts=attempts, updated_s=created)
    assert Job.from_hash(stored.to_hash()) == stored
