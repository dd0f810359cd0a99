"""The fleet's overload stage in Redis: one record every router and gateway reads, so they agree.

Key: `{ns}stage`, a hash {stage, since, why, by, version} with no TTL. `version` counts changes:
a router that decided a change writes it only if the version is still the one it decided from
(a compare-and-set in one Lua script), so two routers deciding at once change the stage once,
and the dwell (services/router/stages.py) is measured from the change that won.

Times are unix seconds (routers on one host or with synchronized clocks: the dwell is seconds,
far above clock skew). A missing record is S0 since the epoch (a new fleet starts normal).
"""
from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb

S0 = pb.S0_NORMAL
NUM_STAGES = len(pb.OverloadStage.values())


@dataclass(frozen=True, slots=True)
class StageRecord:
    stage: int = S0
    since_unix_s: float = 0.0
    why: str = ""
    by: str = ""
    version: int = 0


# KEYS[1] the stage hash; ARGV expected version, stage, since, why, by. 1 if written.
_CAS_LUA = """
local v = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if v ~= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'stage', ARGV[2], 'since', ARGV[3], 'why', ARGV[4], 'by', ARGV[5],
           'version', v + 1)
return 1
"""


class StageStore:
    def __init__(self, redis: aioredis.Redis, namespace: str = "kvfleet:") -> None:
        """`redis` must decode responses (str)."""
        self._r = redis
        self.key = f"{namespace}stage"
        self._cas = redis.register_script(_CAS_LUA)

    async def read(self) -> StageRecord:
        h = await self._r.hgetall(self.key)
        if not h:
            return StageRecord()
        return parse(h)

    async def change(self, seen: StageRecord, stage: int, now_unix_s: float, why: str,
                     by: str) -> StageRecord | None:
        """Write `stage` if the record is still `seen` (its version); the new record, or None
        when another router changed it first (re-read and decide again)."""
        if not S0 <= stage < NUM_STAGES:
            raise ValueError(f"stage {stage} is not one of S0..S{NUM_STAGES - 1}")
        ok = await self._cas(keys=[self.key],
                             args=[seen.version, stage, repr(now_unix_s), why[:200], by])
        if not ok:
            return None
        return StageRecord(stage, now_unix_s, why[:200], by, seen.version + 1)


def parse(h: dict[str, str]) -> StageRecord:
    """A stored record; a field that does not parse counts as S0 (logged by the caller), never
    as a stage past S4."""
    try:
        stage = int(h.get("stage", S0))
        record = StageRecord(stage if S0 <= stage < NUM_STAGES else S0,
                             float(h.get("since", 0.0)), h.get("why", ""), h.get("by", ""),
                             int(h.get("version", 0)))
    except ValueError:
        return StageRecord(version=_int_or_zero(h.get("version")))
    return record


def _int_or_zero(text: str | None) -> int:
    try:
        return int(text or 0)
    except ValueError:
        return 0
