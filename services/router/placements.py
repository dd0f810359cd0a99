"""What routers placed on each worker since the beat they rank by (placement.Placed), so that a burst
within one beat spreads instead of taking the same best replica every time.

    own:   this router's placements, counted at once (before any await, so the next admission on this
           event loop ranks with it), per (worker, beat); a newer beat starts at 0, as it reflects them
    fleet: every router's, in Redis (FleetState.placed / add_placed: a hash per worker and beat, 10 s TTL),
           read in one pipeline per ranking (with the class's wait-queue count:
           `read_with_waiting`), written behind: an admission does not wait for Redis to have it
    used:  the larger of the two: never counts a placement twice; while Redis does not answer, own alone

A placement whose Reserve is refused, or fails, is taken back (both counts). One that ends before the next
beat stays counted until that beat: the beat is what says it ended. The Redis writes are
increments, so an add and its take-back may land in either order (a reader may see a count below
zero for that instant; the own count, never below zero, is what ranks then); `flush` waits for
those in flight.

Each placement's KV blocks are also counted under its tenant (`tenant_blocks`), so a tenant's
decode KV fleet-wide is what the workers published at their beats (their tenant shares, which
count reservations) plus what routers placed since: a tenant's burst within one beat reaches its
guaranteed minimum (admission.protected) as it is placed, not a beat later. Nothing of it outlives
the beat it is keyed to, so when requests finish, are cancelled or fail, the next beats say so and
the count comes back to zero.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from services.engine.config import TrafficClass
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.router.placement import NOTHING, Placed
from services.state.fleet_state import FleetState, PlacedCounts
from services.state.outage import UNREACHABLE, Outage

log = logging.getLogger(__name__)

PLACED_TTL_S = 10.0   # well past a beat (heartbeat_s 0.5 s): a count outlives the beat it is keyed to


class PlacementLedger:
    def __init__(self, state: FleetState, redis: Outage) -> None:
        self._state, self._redis = state, redis
        self._own: dict[str, tuple[float, Placed]] = {}   # worker id -> (beat, placed since it)
        self._fleet: dict[str, tuple[float, Placed]] = {}  # worker id -> (beat, last Redis read)
        self._own_t: dict[str, tuple[float, dict[str, int]]] = {}    # the same, blocks by tenant
        self._fleet_t: dict[str, tuple[float, dict[str, int]]] = {}
        self.turn = 0                                     # where ties start (placement.ring)
        self._writes: set[asyncio.Future] = set()          # Redis counts not yet written

    def own(self, w: pb.WorkerStats) -> Placed:
        beat, placed = self._own.get(w.worker_id, (None, NOTHING))
        return placed if beat == w.updated_at_unix_s else NOTHING

    async def read(self, workers: Sequence[pb.WorkerStats]) -> dict[str, Placed]:
        """Placed on each worker since its beat, by worker id."""
        return (await self.read_with_waiting(workers, ""))[0]

    async def read_with_waiting(self, workers: Sequence[pb.WorkerStats],
                                queue_key: str) -> tuple[dict[str, Placed], int]:
        """`read`, and the members of the sorted set `queue_key` (the request's class in the wait
        queue: WaitQueue.members_key), in one round trip. Redis down: peers' placements unknown,
        nobody waiting."""
        try:
            rows, waiting = await self._redis.call(
                self._state.placed_and_members,
                [(w.worker_id, w.updated_at_unix_s) for w in workers], queue_key)
        except UNREACHABLE:
            rows, waiting = [PlacedCounts()] * len(workers), 0
        for w, row in zip(workers, rows):
            self._fleet[w.worker_id] = (w.updated_at_unix_s, Placed(row.blocks, row.streams))
            self._fleet_t[w.worker_id] = (w.updated_at_unix_s, dict(row.tenants))
        return self.now(workers), waiting

    def tenant_blocks(self, workers: Sequence[pb.WorkerStats]) -> dict[str, int]:
        """KV blocks placed on `workers` since their beats, by tenant, as this router knows it now
        (the last fleet read for each beat, or its own count where larger)."""
        out: dict[str, int] = {}
        for w in workers:
            fleet = _at_beat(self._fleet_t, w)
            own = _at_beat(self._own_t, w)
            for t in fleet.keys() | own.keys():
                n = max(fleet.get(t, 0), own.get(t, 0))
                if n > 0:
                    out[t] = out.get(t, 0) + n
        return out

    def now(self, workers: Sequence[pb.WorkerStats]) -> dict[str, Placed]:
        """Placed on each worker as this router knows it at this instant, without awaiting: the
        last fleet read for that beat, and this router's own count as it is now. Admissions on one
        event loop interleave at their awaits, so the final choice ranks with this just before
        `add`, not with a `read` taken before other admissions placed."""
        out = {}
        for w in workers:
            beat, fleet = self._fleet.get(w.worker_id, (None, NOTHING))
            fleet = fleet if beat == w.updated_at_unix_s else NOTHING
            own = self.own(w)
            out[w.worker_id] = Placed(max(fleet.blocks, own.blocks), max(fleet.streams, own.streams))
        return out

    def add(self, w: pb.WorkerStats, blocks: int, tenant: str = "") -> asyncio.Future:
        """Count a placement: this router's count at once, the fleet's in Redis behind it (the
        future is done once Redis has it, or did not answer; an admission does not wait)."""
        self.turn += 1
        return self._count(w, blocks, 1, tenant)

    def take_back(self, w: pb.WorkerStats, blocks: int, tenant: str = "") -> asyncio.Future:
        return self._count(w, -blocks, -1, tenant)

    async def flush(self, timeout_s: float | None = None) -> None:
        """Wait for the Redis writes in flight (at most `timeout_s`)."""
        if self._writes:
            await asyncio.wait(list(self._writes), timeout=timeout_s)

    def _count(self, w: pb.WorkerStats, blocks: int, streams: int, tenant: str) -> asyncio.Future:
        mine = self.own(w)
        self._own[w.worker_id] = (w.updated_at_unix_s, Placed(max(0, mine.blocks + blocks),
                                                              max(0, mine.streams + streams)))
        if tenant:
            by_tenant = dict(_at_beat(self._own_t, w))
            by_tenant[tenant] = max(0, by_tenant.get(tenant, 0) + blocks)
            self._own_t[w.worker_id] = (w.updated_at_unix_s, by_tenant)
        write = asyncio.ensure_future(self._write(w.worker_id, w.updated_at_unix_s, blocks,
                                                  streams, tenant))
        self._writes.add(write)
        write.add_done_callback(self._writes.discard)
        return write

    async def _write(self, worker_id: str, beat: float, blocks: int, streams: int,
                     tenant: str) -> None:
        try:
            await self._redis.call(self._state.add_placed, worker_id, beat, blocks, streams,
                                   PLACED_TTL_S, tenant)
        except UNREACHABLE:
            pass  # peers rank without it until the next beat; self._redis logged the outage
        except Exception:  # noqa: BLE001 - nobody awaits a write behind: say it here
            log.exception("could not count a placement on %s in Redis", worker_id)


def _at_beat(counts: dict[str, tuple[float, dict[str, int]]], w: pb.WorkerStats) -> dict[str, int]:
    beat, by_tenant = counts.get(w.worker_id, (None, {}))
    return by_tenant if beat == w.updated_at_unix_s else {}


@dataclass(frozen=True, slots=True)
class PlacedPrompt:
    """A prompt a router placed on a prefill (or mixed) worker since its beat."""

    traffic_class: str
    tenant: str
    tokens: int         # to prefill: the prompt less its cached prefix on that worker
    cached: int = 0     # the prefix it holds (where the prompt's first chunk starts)


class PlacedPrompts:
    """The prompts this router placed on each prefill worker since that worker's beat, in the
    order it placed them: each counted from its prediction on (before any await, so a burst's
    concurrent admissions see it ahead of them), taken back when it ends without a plan; a newer
    beat starts from none (it lists them in its own queues)."""

    def __init__(self) -> None:
        self._placed: dict[str, tuple[float, list[PlacedPrompt]]] = {}  # id -> (beat, prompts)

    def since_beat(self, w: pb.WorkerStats) -> list[PlacedPrompt]:
        beat, placed = self._placed.get(w.worker_id, (None, []))
        return placed if beat == w.updated_at_unix_s else []

    def add(self, w: pb.WorkerStats, prompt: PlacedPrompt) -> None:
        placed = self.since_beat(w)
        self._placed[w.worker_id] = (w.updated_at_unix_s, [*placed, prompt])

    def take_back(self, w: pb.WorkerStats, prompt: PlacedPrompt) -> None:
        """Take back a prompt `add` counted that was not placed after all (unless a newer beat has
        already started the count afresh)."""
        placed = self.since_beat(w)
        if prompt in placed:
            placed.remove(prompt)

    def onto(self, w: pb.WorkerStats, classes: Sequence[TrafficClass]) -> pb.WorkerStats:
        """`w` with the prompts placed on it since its beat queued there: `with_placed_prompts`."""
        return with_placed_prompts(w, self.since_beat(w), classes)


def with_placed_prompts(w: pb.WorkerStats, placed: Sequence[PlacedPrompt],
                        classes: Sequence[TrafficClass]) -> pb.WorkerStats:
    """`w` with the prompts a router placed on it since its beat (`placed`, in the order it
    placed them) counted as queued there, as the worker's scheduler counts its own queue: in its
    total; per class it publishes, in the tokens a new request of that class waits behind (the
    placed prompts of its own and higher priorities: Scheduler.prefill_tokens_ahead) and in what
    they take of one step (each at most its chunk: prefill_step_tokens_ahead); and each at the
    back of its tenant's queue (`prefill_queues`, none of it computed), where the scheduler puts
    it, so the router's step-ahead (step_ahead.py) steps it with the rest, in the engine's order.
    A burst within one beat so sees its own backlog ahead of each prompt, not an empty queue."""
    if not placed:
        return w
    out = pb.WorkerStats()
    out.CopyFrom(w)
    out.queued_prefill_tokens += sum(p.tokens for p in placed)
    chunk = w.chunk_size
    priority = {c.name: c.priority for c in classes}
    for c in classes:
        above = [p.tokens for p in placed
                 if priority.get(p.traffic_class, c.priority) >= c.priority]
        if c.name in out.queued_prefill_tokens_ahead:
            out.queued_prefill_tokens_ahead[c.name] += sum(above)
        if c.name in out.prefill_step_tokens_ahead:
            out.prefill_step_tokens_ahead[c.name] += sum(min(n, chunk or n) for n in above)
    for p in placed:
        _queue_last(_tenant_queue(out, p.traffic_class, p.tenant), p.tokens, p.cached)
    return out


def _tenant_queue(w: pb.WorkerStats, traffic_class: str, tenant: str) -> pb.TenantQueue:
    for q in w.prefill_queues:
        if q.traffic_class == traffic_class and q.tenant == tenant:
            return q
    return w.prefill_queues.add(traffic_class=traffic_class, tenant=tenant)


def _queue_last(q: pb.TenantQueue, tokens: int, cached: int) -> None:
    """Queue a prompt of `tokens` to compute after `cached` behind everything in `q`: behind its
    unlisted tail too (a worker lists its first PUBLISHED_PROMPTS prompts; the rest of its tokens
    come after them, none computed), which so becomes a listed prompt of its own before it."""
    unlisted = q.tokens - sum(q.prompts)
    for n, done in ((unlisted, 0),) * (unlisted > 0) + ((tokens, cached),):
        if len(q.computed) == len(q.prompts):   # positions kept in step (empty: older build)
            q.computed.append(done)
        q.prompts.append(n)
    q.tokens += tokens
