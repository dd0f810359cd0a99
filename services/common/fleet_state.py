"""The fleet's shared state in Redis (DESIGN section 3, item 7): worker registry and tenant quota counters.

Key layout (`ns` is the namespace, "kvfleet:" by default; ids are used verbatim):

| key                                  | type          | TTL                        | written by                     |
|--------------------------------------|---------------|----------------------------|--------------------------------|
| `{ns}worker:{worker_id}`             | hash          | heartbeat ttl_s            | heartbeat (HSET+PEXPIRE, MULTI)|
| `{ns}workers`                        | set of ids    | none; dead ids pruned      | heartbeat SADD, live_workers   |
| `{ns}tenant:{t}:streams`             | string int    | none; deleted at 0         | admit/finish_stream (Lua)      |
| `{ns}tenant:{t}:tokens:{minute}`     | string int    | rest of the window + 60 s  | admit/finish_stream (Lua)      |
| `{ns}tenant:{t}:requests:{minute}`   | string int    | rest of the window + 60 s  | admit, charge_request (Lua)    |

`minute` is `int(now // 60)`: a fixed 60-s window. The worker hash holds every `WorkerRecord` field as a
string; a worker whose heartbeat is older than its TTL has no hash, so it is not live.
Source of truth: the worker's own heartbeat for capacity; these counters for tenant quotas.
Known limit: a gateway that dies holding streams leaves `streams` too high until `reset_tenant`.
"""
from __future__ import annotations

import logging
import math
import re
import time
import typing
from dataclasses import asdict, dataclass, fields

import redis.asyncio as aioredis

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "mixed")
KV_BACKENDS = ("nixl", "tcp", "local")
WINDOW_S = 60
_INT_RE = re.compile(r"-?[0-9]+")


@dataclass(frozen=True)
class WorkerRecord:
    """What a worker heartbeats: identity, KV capacity in blocks, load and measured rates."""
    worker_id: str
    role: str                   # prefill | decode | mixed
    grpc_address: str           # 127.0.0.1:port
    kv_backend: str             # nixl | tcp | local
    block_size: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_reserved: int
    kv_blocks_used: int
    running: int
    queued: int
    queued_prefill_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    model: str
    max_model_len: int
    updated_at: float           # unix time of the heartbeat

    def __post_init__(self) -> None:
        _check(self.role in ROLES, "role", f"{self.role!r} not in {ROLES}")
        _check(self.kv_backend in KV_BACKENDS, "kv_backend", f"{self.kv_backend!r} not in {KV_BACKENDS}")
        _check(bool(self.worker_id), "worker_id", "empty")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)):
                _check(math.isfinite(value) and value >= 0, f.name, f"{value!r} is not finite and >= 0")

    def to_hash(self) -> dict[str, str]:
        """Every field as a string; floats via repr() so they round-trip exactly."""
        return {k: repr(v) if isinstance(v, float) else str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_hash(cls, h: typing.Mapping[str, str]) -> "WorkerRecord":
        """Strict inverse of to_hash: a missing or malformed field raises ValueError naming it.
        Unknown fields are ignored, so a newer worker can add fields without breaking older readers."""
        return cls(**{name: _parse(name, tp, h) for name, tp in _FIELD_TYPES.items()})


_FIELD_TYPES: dict[str, type] = typing.get_type_hints(WorkerRecord)


def _check(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ValueError(f"WorkerRecord.{name}: {why}")


def _parse(name: str, tp: type, h: typing.Mapping[str, str]) -> typing.Any:
    _check(name in h, name, "missing")
    raw = h[name]
    _check(isinstance(raw, str), name, f"expected str, got {type(raw).__name__}")
    if tp is str:
        return raw
    if tp is int:
        _check(_INT_RE.fullmatch(raw) is not None, name, f"{raw!r} is not an integer")
        return int(raw)
    try:
        return tp(raw)
    except ValueError:
        raise ValueError(f"WorkerRecord.{name}: {raw!r} is not a {tp.__name__}") from None


# KEYS[1] streams counter; ARGV[1] limit. Returns 1 if a stream was taken, else 0.
_ACQUIRE_LUA = """
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
if n < tonumber(ARGV[1]) then redis.call('INCR', KEYS[1]) return 1 end
return 0
"""
# KEYS[1] window counter; ARGV amount, limit, ttl_ms. All or nothing: a refused charge leaves the
# counter untouched (checking before INCRBY is the same as INCRBY-then-undo, since a script is atomic).
_CHARGE_LUA = """
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
local amount = tonumber(ARGV[1])
if n + amount > tonumber(ARGV[2]) then return 0 end
redis.call('INCRBY', KEYS[1], amount)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""
# Admission in one round trip. KEYS streams, requests window, tokens window; ARGV max_streams, rpm,
# prompt tokens, tpm, ttl_ms. 1) a stream slot (refused: nothing taken) 2) the request (refused:
# slot given back) 3) the prompt's tokens (refused: slot given back, the request stays counted, as
# OpenAI counts refused requests). Returns 0 admitted, 1 streams, 2 requests, 3 tokens refused.
_ADMIT_LUA = """
local streams = tonumber(redis.call('GET', KEYS[1]) or '0')
if streams >= tonumber(ARGV[1]) then return 1 end
local requests = tonumber(redis.call('GET', KEYS[2]) or '0')
if requests + 1 > tonumber(ARGV[2]) then return 2 end
redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], ARGV[5])
local tokens = tonumber(redis.call('GET', KEYS[3]) or '0')
if tokens + tonumber(ARGV[3]) > tonumber(ARGV[4]) then return 3 end
redis.call('INCRBY', KEYS[3], ARGV[3])
redis.call('PEXPIRE', KEYS[3], ARGV[5])
redis.call('INCR', KEYS[1])
return 0
"""
# The end of a stream in one round trip. KEYS streams counter, tokens window; ARGV generated tokens,
# ttl_ms. The slot is given back (never below 0, deleted at 0); the tokens are charged uncapped, since
# they are already generated (a tenant over its budget is refused at its next admission).
_FINISH_LUA = """
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
if n <= 1 then redis.call('DEL', KEYS[1]) else redis.call('DECR', KEYS[1]) end
if tonumber(ARGV[1]) > 0 then
  redis.call('INCRBY', KEYS[2], ARGV[1])
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
return 1
"""
# KEYS[1] workers set, KEYS[2..] worker hashes; ARGV the matching ids. SREMs an id only if its hash is
# still gone, so a worker that heartbeats between our read and this prune is not dropped.
_PRUNE_LUA = """
local removed = 0
for i, id in ipairs(ARGV) do
  if redis.call('EXISTS', KEYS[i + 1]) == 0 then removed = removed + redis.call('SREM', KEYS[1], id) end
end
return removed
"""


class FleetState:
    """Typed asyncio access to the fleet's Redis state; one instance per process (it owns a pool)."""

    def __init__(self, redis_url: str, namespace: str = "kvfleet:"):
        self.ns = namespace
        self._r = aioredis.Redis.from_url(redis_url, decode_responses=True)
        self._acquire = self._r.register_script(_ACQUIRE_LUA)
        self._charge = self._r.register_script(_CHARGE_LUA)
        self._prune = self._r.register_script(_PRUNE_LUA)
        self._admit = self._r.register_script(_ADMIT_LUA)
        self._finish = self._r.register_script(_FINISH_LUA)

    async def close(self) -> None:
        await self._r.aclose()

    async def __aenter__(self) -> "FleetState":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # --- keys ---------------------------------------------------------------------------------
    def _worker_key(self, worker_id: str) -> str:
        return f"{self.ns}worker:{worker_id}"

    @property
    def _workers_key(self) -> str:
        return f"{self.ns}workers"

    def _tenant_key(self, tenant: str, what: str) -> str:
        return f"{self.ns}tenant:{tenant}:{what}"

    def _window_key(self, tenant: str, kind: str, now: float) -> str:
        return self._tenant_key(tenant, f"{kind}:{int(now // WINDOW_S)}")

    # --- worker registry ----------------------------------------------------------------------
    async def heartbeat(self, record: WorkerRecord, ttl_s: float) -> None:
        """Publish the record; it disappears ttl_s after the last heartbeat."""
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        key = self._worker_key(record.worker_id)
        async with self._r.pipeline(transaction=True) as p:
            p.hset(key, mapping=record.to_hash())
            p.pexpire(key, max(1, round(ttl_s * 1000)))
            p.sadd(self._workers_key, record.worker_id)
            await p.execute()

    async def live_workers(self, role: str | None = None) -> list[WorkerRecord]:
        """Workers whose heartbeat is still alive (sorted by id), optionally of one role."""
        if role is not None and role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        ids = sorted(await self._r.smembers(self._workers_key))
        async with self._r.pipeline(transaction=False) as p:
            for worker_id in ids:
                p.hgetall(self._worker_key(worker_id))
            hashes = await p.execute()
        dead = [wid for wid, h in zip(ids, hashes) if not h]
        if dead:
            await self._prune(keys=[self._workers_key, *map(self._worker_key, dead)], args=dead)
        records = [r for r in map(self._record_or_none, ids, hashes) if r is not None]
        return [r for r in records if role is None or r.role == role]

    @staticmethod
    def _record_or_none(worker_id: str, h: dict[str, str]) -> WorkerRecord | None:
        if not h:
            return None
        try:
            return WorkerRecord.from_hash(h)
        except ValueError as e:  # one bad worker must not hide the rest of the fleet
            log.warning("skipping worker %s: malformed heartbeat: %s", worker_id, e)
            return None

    async def remove_worker(self, worker_id: str) -> None:
        async with self._r.pipeline(transaction=True) as p:
            p.delete(self._worker_key(worker_id))
            p.srem(self._workers_key, worker_id)
            await p.execute()

    # --- tenant counters ----------------------------------------------------------------------
    async def acquire_stream(self, tenant: str, limit: int) -> bool:
        """Take one of `limit` concurrent stream slots; False (nothing taken) if all are in use."""
        return bool(await self._acquire(keys=[self._tenant_key(tenant, "streams")], args=[int(limit)]))

    async def release_stream(self, tenant: str) -> None:
        """Give one stream slot back (never below 0; the key is deleted at 0)."""
        await self.finish_stream(tenant, 0)

    async def streams(self, tenant: str) -> int:
        return int(await self._r.get(self._tenant_key(tenant, "streams")) or 0)

    async def charge_tokens(self, tenant: str, tokens: int, per_minute_limit: int,
                            now: float | None = None) -> tuple[bool, float]:
        """Charge tokens to this minute's window: (True, 0.0), or (False, seconds left in the window)
        with nothing charged. A single charge above per_minute_limit is always refused."""
        return await self._charge_window(tenant, "tokens", tokens, per_minute_limit, now)

    async def admit(self, tenant: str, max_streams: int, requests_per_minute: int,
                    prompt_tokens: int, tokens_per_minute: int,
                    now: float | None = None) -> tuple[str | None, float]:
        """Stream slot + this minute's request + the prompt's tokens, atomically, in one round
        trip. Returns (None, 0.0) when admitted, else (what refused: "streams" | "requests" |
        "tokens", seconds left in the minute window; 0.0 for streams)."""
        if prompt_tokens < 0:
            raise ValueError(f"cannot charge a negative amount ({prompt_tokens})")
        now = time.time() if now is None else now
        left_s = WINDOW_S - now % WINDOW_S
        ttl_ms = math.ceil((left_s + WINDOW_S) * 1000)
        keys = [self._tenant_key(tenant, "streams"), self._window_key(tenant, "requests", now),
                self._window_key(tenant, "tokens", now)]
        code = await self._admit(keys=keys, args=[int(max_streams), int(requests_per_minute),
                                                  int(prompt_tokens), int(tokens_per_minute),
                                                  ttl_ms])
        refused = (None, "streams", "requests", "tokens")[int(code)]
        return refused, (0.0 if refused in (None, "streams") else left_s)

    async def finish_stream(self, tenant: str, output_tokens: int,
                            now: float | None = None) -> None:
        """A stream ended: give its slot back (never below 0; the key is deleted at 0) and charge
        the tokens it generated, uncapped, in one round trip."""
        if output_tokens < 0:
            raise ValueError(f"cannot charge a negative amount ({output_tokens})")
        now = time.time() if now is None else now
        ttl_ms = math.ceil((WINDOW_S - now % WINDOW_S + WINDOW_S) * 1000)
        await self._finish(keys=[self._tenant_key(tenant, "streams"),
                                 self._window_key(tenant, "tokens", now)],
                           args=[int(output_tokens), ttl_ms])

    async def charge_request(self, tenant: str, per_minute_limit: int,
                             now: float | None = None) -> tuple[bool, float]:
        return await self._charge_window(tenant, "requests", 1, per_minute_limit, now)

    async def _charge_window(self, tenant: str, kind: str, amount: int, limit: int,
                             now: float | None) -> tuple[bool, float]:
        if amount < 0:
            raise ValueError(f"cannot charge a negative amount ({amount})")
        now = time.time() if now is None else now
        left_s = WINDOW_S - now % WINDOW_S  # in (0, 60]
        ttl_ms = math.ceil((left_s + WINDOW_S) * 1000)
        key = self._window_key(tenant, kind, now)
        allowed = await self._charge(keys=[key], args=[int(amount), int(limit), ttl_ms])
        return (True, 0.0) if allowed else (False, left_s)

    async def tenant_counters(self, tenant: str, now: float | None = None) -> dict[str, int]:
        """{"streams", "tokens", "requests"}: open streams and this minute's charges."""
        now = time.time() if now is None else now
        keys = [self._tenant_key(tenant, "streams"), self._window_key(tenant, "tokens", now),
                self._window_key(tenant, "requests", now)]
        values = await self._r.mget(keys)
        return {name: int(v or 0) for name, v in zip(("streams", "tokens", "requests"), values)}

    async def reset_tenant(self, tenant: str, now: float | None = None) -> None:
        """Zero the tenant's streams and this minute's windows (older windows are never read)."""
        now = time.time() if now is None else now
        await self._r.delete(self._tenant_key(tenant, "streams"), self._window_key(tenant, "tokens", now),
                             self._window_key(tenant, "requests", now))
