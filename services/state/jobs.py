"""Asynchronous jobs in Redis: a request the fleet refused for time, accepted to run later
(services/gateway/jobs.py runs them; `GET /v1/jobs/{id}` reads them).

Keys (`ns` the namespace, "kvfleet:" by default):

| key                 | type | TTL                                             | written by                |
|---------------------|------|-------------------------------------------------|---------------------------|
| `{ns}job:{id}`      | hash | deadline + ttl while open; `ttl` once finished  | create, update, finish    |
| `{ns}jobs:leases`   | zset | none; members leave when their job finishes     | create, renew, claim      |

A job's hash holds the `Job` fields as strings. An open job (queued or running) is a member of
`{ns}jobs:leases`, scored by its owner's lease expiry (unix ms). The owning gateway renews the
leases of the jobs it runs; a gateway that dies stops renewing, and any gateway's `claim` takes
the jobs whose lease lapsed (it becomes their owner and runs them from the start). A finished job
leaves the zset and its hash expires `ttl` seconds later.

A gateway claims only jobs made with an API key it has (gateways with different keys files may
share a Redis); a lapsed job past its deadline is failed by whichever gateway looks.

Invariants: only `claim` changes an open job's owner, and only once its lease has lapsed; `renew`
extends a lease only for its owner (a gateway that lost a job to a claim learns so and stops it);
a finished job is never reopened (update and finish need the hash to exist and the job open).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields
from typing import Literal

import redis.asyncio as aioredis

JobState = Literal["queued", "running", "completed", "failed"]
OPEN_STATES = ("queued", "running")
FINISHED_STATES = ("completed", "failed")

# KEYS[1] the job hash, KEYS[2] the leases zset; ARGV: id, then field/value pairs. Only an open
# job is written (a finished or expired one stays as it is).
_UPDATE_LUA = """
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'queued' and state ~= 'running' then return 0 end
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""

# KEYS[1] the job hash, KEYS[2] the leases zset; ARGV: id, ttl_ms, then field/value pairs.
_FINISH_LUA = """
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'queued' and state ~= 'running' then return 0 end
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""

# KEYS[1] the leases zset; ARGV: now_ms, lease_ms, holder, key prefix, limit, ttl_ms, the
# error of a job past its deadline, then the key ids the holder has. Of the jobs whose lease
# lapsed: one past its deadline fails; one made with a key the holder has is taken; one whose
# hash is gone leaves the zset; the rest wait for a gateway with their key. Returns the taken ids.
_CLAIM_LUA = """
local known = {}
for i = 8, #ARGV do known[ARGV[i]] = true end
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[5])
local taken = {}
for _, id in ipairs(lapsed) do
  local key = ARGV[4] .. id
  local job = redis.call('HMGET', key, 'state', 'key_id', 'deadline_s')
  if job[1] ~= 'queued' and job[1] ~= 'running' then
    redis.call('ZREM', KEYS[1], id)
  elseif tonumber(job[3]) * 1000 < tonumber(ARGV[1]) then
    redis.call('HSET', key, 'state', 'failed', 'error', ARGV[7], 'updated_s', ARGV[1] / 1000)
    redis.call('PEXPIRE', key, ARGV[6])
    redis.call('ZREM', KEYS[1], id)
  elseif known[job[2]] then
    redis.call('ZADD', KEYS[1], ARGV[1] + ARGV[2], id)
    redis.call('HSET', key, 'owner', ARGV[3])
    table.insert(taken, id)
  end
end
return taken
"""

# KEYS[1] the leases zset; ARGV: expiry_ms, holder, key prefix, ids... Extends the leases this
# holder still owns; returns the ids it no longer owns (claimed by another, or gone).
_RENEW_LUA = """
local lost = {}
for i = 4, #ARGV do
  local id = ARGV[i]
  if redis.call('HGET', ARGV[3] .. id, 'owner') == ARGV[2] and
     redis.call('ZSCORE', KEYS[1], id) then
    redis.call('ZADD', KEYS[1], ARGV[1], id)
  else
    table.insert(lost, id)
  end
end
return lost
"""


@dataclass(frozen=True)
class Job:
    """One asynchronous request. `body` is the client's JSON request body as sent; `result` the
    OpenAI-shaped response body (JSON text) once completed, `error` the error object once failed."""

    id: str
    tenant: str
    key_id: str              # the SHA-256 (hex) of the API key that created it, never the key
    kind: str                # completion | chat
    traffic_class: str
    body: str
    created_s: float
    deadline_s: float        # unix time after which it fails
    owner: str = ""          # the gateway running it
    state: JobState = "queued"
    attempts: int = 0
    result: str = ""
    error: str = ""
    updated_s: float = 0.0

    def to_hash(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_hash(cls, h: dict[str, str]) -> Job:
        """A job read back; ValueError if the hash is not one (a missing or malformed field)."""
        values = {}
        for f in fields(cls):
            if f.name not in h:
                raise ValueError(f"job hash lacks {f.name!r}")
            raw = h[f.name]
            values[f.name] = (float(raw) if f.type == "float" else int(raw) if f.type == "int"
                              else raw)
        job = cls(**values)
        if job.state not in (*OPEN_STATES, *FINISHED_STATES):
            raise ValueError(f"job state {job.state!r} is not one of {OPEN_STATES + FINISHED_STATES}")
        return job


class JobStore:
    def __init__(self, redis: aioredis.Redis, namespace: str = "kvfleet:") -> None:
        """`redis` must decode responses (str)."""
        self._r = redis
        self.ns = namespace
        self._leases = f"{namespace}jobs:leases"
        self._update = redis.register_script(_UPDATE_LUA)
        self._finish = redis.register_script(_FINISH_LUA)
        self._claim = redis.register_script(_CLAIM_LUA)
        self._renew = redis.register_script(_RENEW_LUA)

    @classmethod
    def connect(cls, redis_url: str, namespace: str = "kvfleet:") -> JobStore:
        """A store with a client of its own (credentials as FleetState finds them)."""
        from services.state.fleet_state import COMMAND_TIMEOUT_S, CONNECT_TIMEOUT_S  # noqa: PLC0415
        from services.state.redis_auth import RedisCredentials  # noqa: PLC0415
        return cls(aioredis.Redis.from_url(
            redis_url, decode_responses=True, socket_connect_timeout=CONNECT_TIMEOUT_S,
            socket_timeout=COMMAND_TIMEOUT_S, **RedisCredentials.from_env().client_kwargs()),
            namespace)

    async def close(self) -> None:
        await self._r.aclose()

    def _key(self, job_id: str) -> str:
        return f"{self.ns}job:{job_id}"

    async def create(self, job: Job, lease_s: float, ttl_s: float,
                     now: float | None = None) -> None:
        """Store an open job, owned (leased) by `job.owner`."""
        now = time.time() if now is None else now
        async with self._r.pipeline(transaction=True) as p:
            p.hset(self._key(job.id), mapping=job.to_hash())
            p.pexpire(self._key(job.id), _ms(max(0.0, job.deadline_s - now) + ttl_s))
            p.zadd(self._leases, {job.id: _ms(now + lease_s)})
            await p.execute()

    async def get(self, job_id: str) -> Job | None:
        """The job, or None if there is none (never was, expired, or not a job's hash)."""
        h = await self._r.hgetall(self._key(job_id))
        if not h:
            return None
        try:
            return Job.from_hash(h)
        except (ValueError, TypeError):
            return None

    async def update(self, job_id: str, **values) -> bool:
        """Set fields of an open job; False if it is finished or gone."""
        return bool(await self._update(keys=[self._key(job_id), self._leases],
                                       args=[job_id, *_pairs(values)]))

    async def finish(self, job_id: str, state: JobState, ttl_s: float, **values) -> bool:
        """Close an open job as `state` (completed | failed); its hash then lives `ttl_s`."""
        if state not in FINISHED_STATES:
            raise ValueError(f"a job finishes as one of {FINISHED_STATES}, not {state!r}")
        values = {**values, "state": state, "updated_s": time.time()}
        return bool(await self._finish(keys=[self._key(job_id), self._leases],
                                       args=[job_id, int(ttl_s * 1000), *_pairs(values)]))

    async def claim(self, holder: str, lease_s: float, key_ids: list[str], ttl_s: float,
                    deadline_error: str, limit: int = 16, now: float | None = None) -> list[str]:
        """Take up to `limit` open jobs whose owner's lease lapsed and whose key is one of
        `key_ids` (a gateway can only run a job under its key); their ids. A lapsed job past its
        deadline fails with `deadline_error` (JSON text) instead, whoever looks."""
        now = time.time() if now is None else now
        return list(await self._claim(keys=[self._leases], args=[
            _ms(now), int(lease_s * 1000), holder, f"{self.ns}job:", limit, int(ttl_s * 1000),
            deadline_error, *key_ids]))

    async def renew(self, holder: str, job_ids: list[str], lease_s: float,
                    now: float | None = None) -> list[str]:
        """Extend `holder`'s leases of `job_ids`; the ids it no longer owns."""
        if not job_ids:
            return []
        now = time.time() if now is None else now
        return list(await self._renew(keys=[self._leases], args=[
            _ms(now + lease_s), holder, f"{self.ns}job:", *job_ids]))

    async def release(self, job_ids: list[str]) -> None:
        """Let the leases of `job_ids` lapse now (a gateway stopping): any gateway claims them."""
        if job_ids:
            await self._r.zadd(self._leases, {i: 0 for i in job_ids}, xx=True)


def _pairs(values: dict) -> list[str]:
    return [str(x) for kv in values.items() for x in kv]


def _ms(seconds: float) -> int:
    return int(seconds * 1000)
