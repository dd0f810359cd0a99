"""The fleet's shared state in Redis (DESIGN section 3, item 8): worker registry and tenant quotas.

Key layout (`ns` is the namespace, "kvfleet:" by default; ids are used verbatim):

| key                                  | type          | TTL                           | written by                      |
|--------------------------------------|---------------|-------------------------------|---------------------------------|
| `{ns}worker:{worker_id}`             | string bytes  | heartbeat ttl_s               | heartbeat (SET PX, MULTI)       |
| `{ns}workers`                        | set of ids    | none; dead ids pruned         | heartbeat SADD, live_workers    |
| `{ns}service:{service_id}`           | string bytes  | heartbeat ttl_s               | heartbeat_service (SET PX)      |
| `{ns}services`                       | set of ids    | none; dead ids pruned         | heartbeat_service, live_services|
| `{ns}tenant:{t}:leases`              | zset          | until its latest lease expires| admit, renew, finish (Lua)      |
| `{ns}tenant:{t}:tokens:{minute}`     | string int    | rest of the window + 60 s     | admit/finish_stream (Lua)       |
| `{ns}tenant:{t}:requests:{minute}`   | string int    | rest of the window + 60 s     | admit, charge_request (Lua)     |
| `{ns}placed:{worker_id}:{beat_ms}`  | hash blocks, streams, t:{tenant} | 10 s (router's choice) | routers: add_placed (MULTI) |
| `{ns}kv-events`                      | stream, ~MAXLEN | none; capped by length      | workers: add_kv_events (XADD)   |

`minute` is `int(now // 60)`: a fixed 60-s window. A worker's key holds its `pb.WorkerStats`, serialized
(the message its Stats RPC answers: one shape for a worker's capacity everywhere) and signed with a
key derived from the fleet token (services/state/records.py: a record the fleet did not write, or
naming an address outside its networks, is ignored, logged and counted); a worker whose
heartbeat is older than its TTL has no key, so it is not live. A record that does not parse, or names
an unknown role or KV backend, a non-finite rate, or another worker's id, is skipped (logged), never
fatal: one bad worker must not hide the rest of the fleet.

Gateways and routers register the same way (`heartbeat_service`): a `pb.ServiceRecord` under
`{ns}service:{service_id}`, so that `kvfleet status` and Prometheus file discovery find every
process of a fleet. Nothing decides on these records; they only name who is there and where.

Stream slots are leases. Each open stream is one member of `{ns}tenant:{t}:leases` (named by its
holder: a gateway names them `{gateway_id}/{n}`), scored by its expiry in unix ms. The holder renews
every lease it holds every `LeaseTerms.renew_every_s` (to now + ttl_s); a lease whose expiry is
past counts for nothing and is pruned by the next admit. So the slots of a gateway that dies
come back at most `ttl_s` after its last renewal, and a tenant nobody serves leaves no key behind.
Invariants: the tenant's open streams = the members with expiry > now (never negative, never a
drifting counter); only the admit script adds a member, and only while fewer than the limit are live.

Quota state written around kvfleet is bounded (it cannot be signed: Lua scripts update it): a
lease expiring more than `LeaseTerms.max_ahead_s` ahead is dropped by the next admission, and a
window that is not an integer >= 0 expiring within MAX_WINDOW_TTL_MS is deleted and counts 0. Both
are logged.

Clocks: expiries are the gateways' unix time (an input, `now`, so tests drive it): the gateways'
clocks must agree to well within `ttl_s - 2 * renew_every_s`.
Source of truth: the worker's own heartbeat for capacity; the leases and windows for tenant quotas.
"""
from __future__ import annotations

import logging
import math
import time
import typing
import uuid
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from google.protobuf.message import DecodeError
from redis.asyncio.retry import Retry
from redis.backoff import ConstantBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.state.records import RecordSeal, RejectedRecord
from services.state.redis_auth import RedisCredentials

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "mixed")
SERVICE_ROLES = ("gateway", "router")
KV_BACKENDS = ("nixl", "tcp", "local")
WINDOW_S = 60
# A window key is written with the rest of its minute and one more to live (_window_ttl_ms): one
# with a longer TTL (or none) was not written by kvfleet. 5 s of slack for clocks.
MAX_WINDOW_TTL_MS = (2 * WINDOW_S + 5) * 1000


# The measured rates and cost coefficients a heartbeat carries (the router divides by them).
RATE_FIELDS = ("prefill_step_s", "prefill_s_per_token", "prefill_s_per_pair", "prior_step_s",
               "prior_s_per_token", "prior_s_per_pair", "prefill_drain_tokens_per_s",
               "kv_transfer_bytes_per_s", "kv_blocks_freed_per_s", "sequences_finished_per_s",
               "prefill_recent_step_s")


def stats_problems(stats: pb.WorkerStats) -> list[str]:
    """What makes a heartbeat unusable (empty: none). Unsigned fields are >= 0 by construction;
    the doubles must be finite and >= 0."""
    out = []
    if not stats.worker_id:
        out.append("worker_id is empty")
    if stats.role not in ROLES:
        out.append(f"role {stats.role!r} not in {ROLES}")
    if stats.kv_backend not in KV_BACKENDS:
        out.append(f"kv_backend {stats.kv_backend!r} not in {KV_BACKENDS}")
    for name in ("prefill_tokens_per_s", "decode_tokens_per_s", "updated_at_unix_s",
                 *RATE_FIELDS):
        value = getattr(stats, name)
        if not (math.isfinite(value) and value >= 0):
            out.append(f"{name} {value!r} is not finite and >= 0")
    return out


def _parse(kind, key_id: str, id_field: str, raw: bytes, problems_of):
    """The `kind` message stored under `key_id`'s key, or ValueError naming what is wrong with it:
    undecodable, `problems_of(message)`, or an id field naming another key."""
    try:
        message = kind.FromString(raw)
    except DecodeError as e:
        raise ValueError(f"not a {kind.__name__} message ({e})") from None
    problems = problems_of(message)
    own = getattr(message, id_field)
    if own and own != key_id:
        problems.append(f"{id_field} {own!r} under the key of {key_id!r}")
    if problems:
        raise ValueError("; ".join(problems))
    return message


def parse_stats(worker_id: str, raw: bytes) -> pb.WorkerStats:
    """The stats stored under `worker_id`'s key, or ValueError naming what is wrong with them."""
    return _parse(pb.WorkerStats, worker_id, "worker_id", raw, stats_problems)


def service_problems(record: pb.ServiceRecord) -> list[str]:
    """What makes a gateway's or router's record unusable (empty: none)."""
    out = []
    if not record.service_id:
        out.append("service_id is empty")
    if record.role not in SERVICE_ROLES:
        out.append(f"role {record.role!r} not in {SERVICE_ROLES}")
    if not record.address:
        out.append("address is empty")
    if not (math.isfinite(record.updated_at_unix_s) and record.updated_at_unix_s >= 0):
        out.append(f"updated_at_unix_s {record.updated_at_unix_s!r} is not finite and >= 0")
    return out


def parse_service(service_id: str, raw: bytes) -> pb.ServiceRecord:
    """The record stored under `service_id`'s key, or ValueError naming what is wrong with it."""
    return _parse(pb.ServiceRecord, service_id, "service_id", raw, service_problems)


# A minute window's count, as every script reads it. A window key kvfleet wrote is a string holding
# an integer >= 0 that expires within MAX_WINDOW_TTL_MS; anything else (another type, not an
# integer, no TTL or a longer one) was written around kvfleet and is deleted, counting 0 (the
# second value returned is 1 then). So a forged value lasts one window at most.
_WINDOW_VALUE = """
local function window_value(key, max_ttl)
  if redis.call('TYPE', key)['ok'] == 'none' then return 0, 0 end
  local ttl = redis.call('PTTL', key)
  local n = nil
  if redis.call('TYPE', key)['ok'] == 'string' then n = tonumber(redis.call('GET', key)) end
  if n == nil or n < 0 or n ~= math.floor(n) or ttl < 0 or ttl > tonumber(max_ttl) then
    redis.call('DEL', key)
    return 0, 1
  end
  return n, 0
end
"""
# KEYS[1] window counter; ARGV amount, limit, ttl_ms, max window ttl_ms. All or nothing: a refused
# charge leaves the counter untouched (checking before INCRBY is the same as INCRBY-then-undo,
# since a script is atomic).
_CHARGE_LUA = _WINDOW_VALUE + """
local n = window_value(KEYS[1], ARGV[4])
local amount = tonumber(ARGV[1])
if n + amount > tonumber(ARGV[2]) then return 0 end
redis.call('INCRBY', KEYS[1], amount)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""
# Keeps a lease zset's own TTL at its latest lease's expiry (relative, so the server's clock does
# not matter): once every holder is gone, the key goes too. KEYS[1] zset; `now` in ms.
_EXPIRE_WITH_LATEST_LEASE = """
local function expire_with_latest(key, now)
  local top = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if top[2] and tonumber(top[2]) > now then redis.call('PEXPIRE', key, tonumber(top[2]) - now) end
end
"""
# Admission in one round trip. KEYS leases zset, requests window, tokens window; ARGV 1 max_streams,
# 2 rpm, 3 prompt tokens, 4 tpm, 5 window ttl_ms, 6 now_ms, 7 lease ttl_ms, 8 lapsed_below_ms,
# 9 lease id, 10 max lease ahead ms, 11 max window ttl_ms. 1) a stream slot: expired leases are
# dropped, and so are leases expiring more than max-ahead from now (no holder sets one so far: it
# was written around kvfleet), then fewer than max_streams must be
# live (refused: nothing taken) 2) the request (refused: no slot taken) 3) the prompt's tokens
# (refused: no slot taken, the request stays counted, as OpenAI counts refused requests).
# Returns {code, ms, leases dropped as too far ahead, windows dropped as forged}: code 0 admitted, 1 streams, 2 requests, 3 tokens refused. For 1, ms is when
# the slot that frees first would free if its holder is gone: the expiry of the (live - max + 1)-th
# earliest lease, minus now, if that lease has missed a renewal (less than lapsed_below_ms left,
# so its holder is presumably dead), else -1 (unknown: a live holder renews it).
_ADMIT_LUA = _EXPIRE_WITH_LATEST_LEASE + _WINDOW_VALUE + """
local now = tonumber(ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local far = redis.call('ZREMRANGEBYSCORE', KEYS[1], '(' .. (now + tonumber(ARGV[10])), '+inf')
local live, limit = redis.call('ZCARD', KEYS[1]), tonumber(ARGV[1])
if live >= limit then
  if limit < 1 then return {1, -1, far, 0} end
  local nth = redis.call('ZRANGE', KEYS[1], live - limit, live - limit, 'WITHSCORES')
  local left = tonumber(nth[2]) - now
  if left < tonumber(ARGV[8]) then return {1, left, far, 0} end
  return {1, -1, far, 0}
end
local requests, forged_requests = window_value(KEYS[2], ARGV[11])
if requests + 1 > tonumber(ARGV[2]) then return {2, 0, far, forged_requests} end
redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], ARGV[5])
local tokens, forged_tokens = window_value(KEYS[3], ARGV[11])
local forged = forged_requests + forged_tokens
if tokens + tonumber(ARGV[3]) > tonumber(ARGV[4]) then return {3, 0, far, forged} end
redis.call('INCRBY', KEYS[3], ARGV[3])
redis.call('PEXPIRE', KEYS[3], ARGV[5])
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[7]), ARGV[9])
expire_with_latest(KEYS[1], now)
return {0, 0, far, forged}
"""
# A holder renews its leases of one tenant. KEYS[1] leases zset; ARGV now_ms, lease ttl_ms, ids...
# Each lease's expiry moves to now + ttl. A lease that was gone (Redis lost it, or it lapsed while
# its holder could not reach Redis) is added back: the stream it stands for is still open. Returns
# the ids added back (the holder releases any whose stream ended meanwhile).
_RENEW_LUA = _EXPIRE_WITH_LATEST_LEASE + """
local now, expiry, restored = tonumber(ARGV[1]), tonumber(ARGV[1]) + tonumber(ARGV[2]), {}
for i = 3, #ARGV do
  local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if not score or tonumber(score) <= now then restored[#restored + 1] = ARGV[i] end
  redis.call('ZADD', KEYS[1], expiry, ARGV[i])
end
expire_with_latest(KEYS[1], now)
return restored
"""
# The end of a stream in one round trip. KEYS leases zset, tokens window; ARGV generated tokens,
# window ttl_ms, lease id, now_ms, max window ttl_ms. The lease is dropped (returns 1 if it was live, 0 if it had
# lapsed or was gone); the tokens are charged uncapped, since they are already generated (a
# tenant over its budget is refused at its next admission).
_FINISH_LUA = _WINDOW_VALUE + """
local score = redis.call('ZSCORE', KEYS[1], ARGV[3])
redis.call('ZREM', KEYS[1], ARGV[3])
local held = 0
if score and tonumber(score) > tonumber(ARGV[4]) then held = 1 end
if tonumber(ARGV[1]) > 0 then
  window_value(KEYS[2], ARGV[5])
  redis.call('INCRBY', KEYS[2], ARGV[1])
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
return held
"""
# KEYS[1] workers (or services) set, KEYS[2..] their keys; ARGV the matching ids. SREMs an id only
# if its key is still gone, so one that heartbeats between our read and this prune is not dropped.
_PRUNE_LUA = """
local removed = 0
for i, id in ipairs(ARGV) do
  if redis.call('EXISTS', KEYS[i + 1]) == 0 then removed = removed + redis.call('SREM', KEYS[1], id) end
end
return removed
"""


TENANT_FIELD = "t:"    # a placed hash's field naming a tenant's KV blocks: "t:{tenant}"


@dataclass(frozen=True, slots=True)
class PlacedCounts:
    """What routers placed on one worker since its beat."""
    blocks: int = 0
    streams: int = 0
    tenants: typing.Mapping[str, int] = field(default_factory=dict)   # KV blocks by tenant


def _placed_counts(row: typing.Mapping[str, str]) -> PlacedCounts:
    """A placed hash as counts; a field that is not an integer counts 0 (state written around
    kvfleet must not break a ranking)."""
    def num(v) -> int:
        try:
            return int(v)
        except (TypeError, ValueError):
            return 0
    tenants = {k[len(TENANT_FIELD):]: num(v) for k, v in row.items() if k.startswith(TENANT_FIELD)}
    return PlacedCounts(num(row.get("blocks")), num(row.get("streams")),
                        {t: n for t, n in tenants.items() if n > 0})


@dataclass(frozen=True)
class LeaseTerms:
    """How long a stream slot's lease lives unrenewed, and how often its holder renews it.

    A gateway that dies gives its slots back within `ttl_s` of its last renewal. A lease with
    less than `lapsed_below_s` left has missed a renewal: its holder is presumably gone, and
    its expiry is when its slot frees (the 429's Retry-After)."""
    ttl_s: float = 10.0
    renew_every_s: float = 2.0

    def __post_init__(self) -> None:
        if not (self.renew_every_s > 0 and self.ttl_s >= 3 * self.renew_every_s):
            raise ValueError(f"need ttl_s >= 3 * renew_every_s > 0, got {self}")

    @property
    def lapsed_below_s(self) -> float:
        return self.ttl_s - 2 * self.renew_every_s

    @property
    def max_ahead_s(self) -> float:
        """No holder sets a lease's expiry further ahead than one TTL (plus a renewal period of
        clock skew between gateways); admission drops any lease further ahead."""
        return self.ttl_s + self.renew_every_s


@dataclass(frozen=True)
class StreamLease:
    """One open stream's slot: member `lease_id` of `{ns}tenant:{tenant}:leases`."""
    tenant: str
    lease_id: str


Refusal = typing.Literal["streams", "requests", "tokens"]


@dataclass(frozen=True)
class Admission:
    """What `FleetState.admit` decided: a lease, or what refused and when to retry.

    retry_after_s: for "requests" / "tokens", the seconds left in the minute window; for
    "streams", the seconds until a lapsed lease (a holder that stopped renewing) expires and
    frees a slot, or None when every slot is held by a live holder (nobody knows when a live
    stream ends; the caller estimates)."""
    lease: StreamLease | None
    refused: Refusal | None = None
    retry_after_s: float | None = None

    @property
    def admitted(self) -> bool:
        return self.lease is not None


# Redis calls never hang a request: a connection is given this long to open and a command this long
# to answer (the scripts are O(streams of one tenant)); a pooled connection that broke (Redis
# restarted) is retried once on a new connection, at once. Anything longer is an outage, which
# the callers' `services.state.outage.Outage` handles with backoff. The connect timeout covers
# one SYN retransmission (1 s on Linux), which a server with a full listen backlog causes.
CONNECT_TIMEOUT_S = 1.5
COMMAND_TIMEOUT_S = 1.0
_RETRY = Retry(ConstantBackoff(0.0), retries=1, supported_errors=(RedisConnectionError,))


class FleetState:
    """Typed asyncio access to the fleet's Redis state; one instance per process (it owns a pool).

    credentials: the URL's own, else these, else the environment's (services/state/redis_auth.py).
    seal: signs the records this process writes and checks those it reads (services/state/
    records.py); default: keyed by this process's fleet token."""

    def __init__(self, redis_url: str, namespace: str = "kvfleet:", *,
                 credentials: RedisCredentials | None = None, seal: RecordSeal | None = None):
        self.ns = namespace
        self.seal = seal if seal is not None else RecordSeal.from_env()
        credentials = credentials if credentials is not None else RedisCredentials.from_env()
        options = dict(socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=COMMAND_TIMEOUT_S,
                       retry=_RETRY, **credentials.client_kwargs())
        self._r = aioredis.Redis.from_url(redis_url, decode_responses=True, **options)
        # the worker registry holds serialized messages: bytes in, bytes out (its own pool)
        self._raw = aioredis.Redis.from_url(redis_url, decode_responses=False, **options)
        self._prune = self._raw.register_script(_PRUNE_LUA)
        self._charge = self._r.register_script(_CHARGE_LUA)
        self._admit = self._r.register_script(_ADMIT_LUA)
        self._renew = self._r.register_script(_RENEW_LUA)
        self._finish = self._r.register_script(_FINISH_LUA)

    @property
    def redis(self) -> aioredis.Redis:
        """The str-decoding client, for the stores that share this pool (stage, wait queue)."""
        return self._r

    async def close(self) -> None:
        await self._r.aclose()
        await self._raw.aclose()

    async def __aenter__(self) -> "FleetState":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def redis(self) -> aioredis.Redis:
        """The client for plain (str) records, e.g. the stage record's StageStore."""
        return self._r

    async def ping(self) -> None:
        await self._r.ping()

    # --- keys ---------------------------------------------------------------------------------
    def _worker_key(self, worker_id: str) -> str:
        return f"{self.ns}worker:{worker_id}"

    @property
    def _workers_key(self) -> str:
        return f"{self.ns}workers"

    def _service_key(self, service_id: str) -> str:
        return f"{self.ns}service:{service_id}"

    @property
    def _services_key(self) -> str:
        return f"{self.ns}services"

    def _tenant_key(self, tenant: str, what: str) -> str:
        return f"{self.ns}tenant:{tenant}:{what}"

    def _leases_key(self, tenant: str) -> str:
        return self._tenant_key(tenant, "leases")

    def _window_key(self, tenant: str, kind: str, now: float) -> str:
        return self._tenant_key(tenant, f"{kind}:{int(now // WINDOW_S)}")

    # --- placements since a worker's beat: routers count them to spread a burst -----------------
    def _placed_key(self, worker_id: str, beat_unix_s: float) -> str:
        return f"{self.ns}placed:{worker_id}:{round(beat_unix_s * 1000)}"

    async def placed(self, beats: typing.Sequence[tuple[str, float]]) -> list[PlacedCounts]:
        """What routers placed on each (worker id, beat's updated_at_unix_s) since that beat: KV
        blocks, streams, and KV blocks by tenant; one round trip. A newer beat has a new key, so
        its count starts at 0."""
        if not beats:
            return []
        return (await self.placed_and_members(beats, ""))[0]

    async def placed_and_members(self, beats: typing.Sequence[tuple[str, float]],
                                 zset_key: str) -> tuple[list[PlacedCounts], int]:
        """`placed(beats)` and the members of the sorted set `zset_key` (a wait queue's class:
        services/state/wait_queue.py; "": none read, 0), in one round trip: the router's
        admission reads both before it decides."""
        async with self._r.pipeline(transaction=False) as p:
            for worker_id, beat in beats:
                p.hgetall(self._placed_key(worker_id, beat))
            if zset_key:
                p.zcard(zset_key)
            rows = await p.execute()
        members = int(rows.pop()) if zset_key else 0
        return [_placed_counts(row) for row in rows], members

    async def add_placed(self, worker_id: str, beat_unix_s: float, blocks: int, streams: int,
                         ttl_s: float, tenant: str = "") -> None:
        """Count a placement (negative: undo one) on a worker's beat, and its blocks under its
        tenant when one is named; the count lives ttl_s."""
        key = self._placed_key(worker_id, beat_unix_s)
        async with self._r.pipeline(transaction=True) as p:
            p.hincrby(key, "blocks", int(blocks))
            p.hincrby(key, "streams", int(streams))
            if tenant:
                p.hincrby(key, TENANT_FIELD + tenant, int(blocks))
            p.pexpire(key, max(1, round(ttl_s * 1000)))
            await p.execute()

    # --- worker registry ----------------------------------------------------------------------
    async def heartbeat(self, stats: pb.WorkerStats, ttl_s: float) -> None:
        """Publish the worker's stats; they disappear ttl_s after the last heartbeat. A record
        readers would skip is refused here (ValueError): that is a bug in the worker."""
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        problems = stats_problems(stats)
        if problems:
            raise ValueError(f"WorkerStats of {stats.worker_id!r}: " + "; ".join(problems))
        async with self._raw.pipeline(transaction=True) as p:
            p.set(self._worker_key(stats.worker_id),
                  self.seal.seal("worker", stats.worker_id, stats.SerializeToString()),
                  px=max(1, round(ttl_s * 1000)))
            p.sadd(self._workers_key, stats.worker_id)
            await p.execute()

    async def live_workers(self, role: str | None = None) -> list[pb.WorkerStats]:
        """Workers whose heartbeat is still alive (sorted by id), optionally of one role."""
        if role is not None and role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        ids = sorted(i.decode() for i in await self._raw.smembers(self._workers_key))
        raws = await self._raw.mget([self._worker_key(i) for i in ids]) if ids else []
        dead = [wid for wid, raw in zip(ids, raws) if raw is None]
        if dead:
            await self._prune(keys=[self._workers_key, *map(self._worker_key, dead)], args=dead)
        workers = [w for w in map(self._stats_or_none, ids, raws) if w is not None]
        return [w for w in workers if role is None or w.role == role]

    def _stats_or_none(self, worker_id: str, raw: bytes | None) -> pb.WorkerStats | None:
        if raw is None:
            return None
        try:
            stats = parse_stats(worker_id, self.seal.open("worker", worker_id, raw))
            self.seal.check_addresses(stats.grpc_address, stats.metrics_url)
            return stats
        except RejectedRecord as e:    # a forgery: it must not receive the fleet's calls
            self.seal.reject("worker", worker_id, e)
            return None
        except ValueError as e:  # one bad worker must not hide the rest of the fleet
            log.warning("skipping worker %s: malformed heartbeat: %s", worker_id, e)
            return None

    async def remove_worker(self, worker_id: str) -> None:
        async with self._raw.pipeline(transaction=True) as p:
            p.delete(self._worker_key(worker_id))
            p.srem(self._workers_key, worker_id)
            await p.execute()

    # --- prefix-cache events: workers publish, routers' prefix indexes follow ------------------
    @property
    def _kv_events_key(self) -> str:
        return f"{self.ns}kv-events"

    async def add_kv_events(self, worker_id: str, payload: bytes, max_len: int) -> None:
        """Append one worker's batch (services/state/kv_events.py), signed like its record; the
        stream keeps about the last `max_len` batches."""
        fields = {"w": worker_id, "b": self.seal.seal("kv-events", worker_id, payload)}
        await self._raw.xadd(self._kv_events_key, fields, maxlen=max_len, approximate=True)

    async def read_kv_events(self, after: str, count: int,
                             block_ms: int) -> list[tuple[str, str, bytes | None]]:
        """(entry id, worker id, payload) of batches after entry `after` ("$": from now on), up to
        `count`, waiting up to `block_ms` for the first. A batch the fleet did not sign has payload
        None (logged and counted)."""
        rows = await self._raw.xread({self._kv_events_key: after}, count=count, block=block_ms)
        out = []
        for _stream, entries in rows or ():
            for entry_id, fields in entries:
                worker_id = fields.get(b"w", b"").decode(errors="replace")
                try:
                    payload = self.seal.open("kv-events", worker_id, fields.get(b"b", b""))
                except RejectedRecord as e:
                    self.seal.reject("kv-events", worker_id, e)
                    payload = None
                out.append((entry_id.decode(), worker_id, payload))
        return out

    # --- gateway / router registry ---------------------------------------------------------------
    async def heartbeat_service(self, record: pb.ServiceRecord, ttl_s: float) -> None:
        """Publish a gateway's or router's record; it disappears ttl_s after the last heartbeat.
        A record readers would skip is refused here (ValueError): a bug in the caller."""
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        problems = service_problems(record)
        if problems:
            raise ValueError(f"ServiceRecord of {record.service_id!r}: " + "; ".join(problems))
        async with self._raw.pipeline(transaction=True) as p:
            p.set(self._service_key(record.service_id),
                  self.seal.seal("service", record.service_id, record.SerializeToString()),
                  px=max(1, round(ttl_s * 1000)))
            p.sadd(self._services_key, record.service_id)
            await p.execute()

    async def live_services(self, role: str | None = None) -> list[pb.ServiceRecord]:
        """Gateways and routers whose heartbeat is still alive (sorted by id), optionally of one
        role. A malformed record is skipped (logged), as a worker's is."""
        if role is not None and role not in SERVICE_ROLES:
            raise ValueError(f"role must be one of {SERVICE_ROLES}, got {role!r}")
        ids = sorted(i.decode() for i in await self._raw.smembers(self._services_key))
        raws = await self._raw.mget([self._service_key(i) for i in ids]) if ids else []
        dead = [sid for sid, raw in zip(ids, raws) if raw is None]
        if dead:
            await self._prune(keys=[self._services_key, *map(self._service_key, dead)], args=dead)
        records = [r for r in map(self._service_or_none, ids, raws) if r is not None]
        return [r for r in records if role is None or r.role == role]

    def _service_or_none(self, service_id: str, raw: bytes | None) -> pb.ServiceRecord | None:
        if raw is None:
            return None
        try:
            record = parse_service(service_id, self.seal.open("service", service_id, raw))
            self.seal.check_addresses(record.address, record.metrics_url)
            return record
        except RejectedRecord as e:
            self.seal.reject("service", service_id, e)
            return None
        except ValueError as e:
            log.warning("skipping service %s: malformed heartbeat: %s", service_id, e)
            return None

    async def remove_service(self, service_id: str) -> None:
        async with self._raw.pipeline(transaction=True) as p:
            p.delete(self._service_key(service_id))
            p.srem(self._services_key, service_id)
            await p.execute()

    # --- tenant quotas: stream leases and minute windows ---------------------------------------
    async def admit(self, tenant: str, max_streams: int, requests_per_minute: int,
                    prompt_tokens: int, tokens_per_minute: int, now: float | None = None, *,
                    lease_id: str | None = None, terms: LeaseTerms = LeaseTerms()) -> Admission:
        """A stream slot (a lease, `lease_id` or a random one) + this minute's request + the
        prompt's tokens, atomically, in one round trip; or what refused, having taken no slot."""
        if prompt_tokens < 0:
            raise ValueError(f"cannot charge a negative amount ({prompt_tokens})")
        now = time.time() if now is None else now
        left_s = WINDOW_S - now % WINDOW_S
        lease = StreamLease(tenant, lease_id or uuid.uuid4().hex)
        keys = [self._leases_key(tenant), self._window_key(tenant, "requests", now),
                self._window_key(tenant, "tokens", now)]
        code, ms, far, forged = await self._admit(keys=keys, args=[
            int(max_streams), int(requests_per_minute), int(prompt_tokens), int(tokens_per_minute),
            _window_ttl_ms(now), _ms(now), _ms(terms.ttl_s), _ms(terms.lapsed_below_s),
            lease.lease_id, _ms(terms.max_ahead_s), MAX_WINDOW_TTL_MS])
        if far:
            log.warning("tenant %s: dropped %d stream leases expiring more than %.0f s ahead "
                        "(no gateway sets one so far: written around kvfleet?)", tenant, far,
                        terms.max_ahead_s)
        if forged:
            log.warning("tenant %s: dropped %d quota windows kvfleet did not write (not an integer, "
                        "or no or too long a TTL)", tenant, forged)
        if code == 0:
            return Admission(lease)
        if code == 1:
            return Admission(None, "streams", ms / 1000 if ms >= 0 else None)
        return Admission(None, "requests" if code == 2 else "tokens", left_s)

    async def renew_leases(self, leases: typing.Iterable[StreamLease],
                           terms: LeaseTerms = LeaseTerms(),
                           now: float | None = None) -> list[StreamLease]:
        """Push every lease's expiry to now + ttl, one script per tenant in one round trip. Returns
        the leases that were gone and are back (the caller releases any that ended meanwhile)."""
        by_tenant: dict[str, list[str]] = {}
        for lease in leases:
            by_tenant.setdefault(lease.tenant, []).append(lease.lease_id)
        if not by_tenant:
            return []
        now = time.time() if now is None else now
        async with self._r.pipeline(transaction=False) as p:
            for tenant, ids in by_tenant.items():
                await self._renew(keys=[self._leases_key(tenant)],
                                  args=[_ms(now), _ms(terms.ttl_s), *ids], client=p)
            results = await p.execute()
        return [StreamLease(t, i) for t, restored in zip(by_tenant, results) for i in restored]

    async def finish_stream(self, lease: StreamLease, output_tokens: int,
                            now: float | None = None) -> bool:
        """A stream ended: drop its lease and charge the tokens it generated, uncapped, in one
        round trip. False if the lease had already lapsed or gone (the tokens are charged anyway)."""
        if output_tokens < 0:
            raise ValueError(f"cannot charge a negative amount ({output_tokens})")
        now = time.time() if now is None else now
        held = await self._finish(keys=[self._leases_key(lease.tenant),
                                        self._window_key(lease.tenant, "tokens", now)],
                                  args=[int(output_tokens), _window_ttl_ms(now), lease.lease_id,
                                        _ms(now), MAX_WINDOW_TTL_MS])
        return bool(held)

    async def streams(self, tenant: str, now: float | None = None) -> int:
        """The tenant's open streams: its leases that have not expired."""
        now = time.time() if now is None else now
        return int(await self._r.zcount(self._leases_key(tenant), f"({_ms(now)}", "+inf"))

    async def charge_request(self, tenant: str, per_minute_limit: int,
                             now: float | None = None) -> tuple[bool, float]:
        return await self._charge_window(tenant, "requests", 1, per_minute_limit, now)

    async def _charge_window(self, tenant: str, kind: str, amount: int, limit: int,
                             now: float | None) -> tuple[bool, float]:
        if amount < 0:
            raise ValueError(f"cannot charge a negative amount ({amount})")
        now = time.time() if now is None else now
        left_s = WINDOW_S - now % WINDOW_S  # in (0, 60]
        key = self._window_key(tenant, kind, now)
        allowed = await self._charge(keys=[key], args=[int(amount), int(limit), _window_ttl_ms(now),
                                                       MAX_WINDOW_TTL_MS])
        return (True, 0.0) if allowed else (False, left_s)


def _ms(seconds: float) -> int:
    return math.floor(seconds * 1000)


def _window_ttl_ms(now: float) -> int:
    """A window key lives for the rest of its minute and one more (it is never read after)."""
    return math.ceil((WINDOW_S - now % WINDOW_S + WINDOW_S) * 1000)
