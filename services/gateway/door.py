"""The gateway's front door: a bound on the generation requests this process has in progress, and
a fair share of it per tenant, checked as soon as the API key is read (a local lookup) and before
the body is read, parsed or tokenized and before any Redis call, so a refused request costs the
gateway a header read.

    key read -> Door.enter(tenant) -> Seat ... response ended (finished, error, client gone)
                                              -> Seat.leave()

A request holds its seat from `enter` until its response ends: a streamed one until its stream
closes (Session.close -> GatewayCore._ended), one refused later (quota, router) when that refusal
raises. `leave` is idempotent, so every path that ends a request may call it.

Policy (GatewayConfig.max_in_progress, 0: no bound, the door only counts):
  - a tenant holding its share of seats or more is refused: **429** (`rate_limit_error`, code
    `tenant_share_exceeded`): its own traffic is what is over the limit, and it can slow down;
  - else, a gateway holding all `max_in_progress` seats refuses: **503** (`service_unavailable`,
    code `gateway_full`): nothing this tenant did is over a limit; this gateway has no room, and
    another gateway (or this one, a moment later) may.
  - a tenant's share is its max-min fair level of the seats this gateway does not keep: with C =
    max_in_progress - kept, the level L at which the others' holdings, each counted up to L,
    plus L fill C (water-filling; at least 1). kept = max(1, max_in_progress // KEPT_DIVISOR)
    seats when this gateway has keys of more than one tenant (room for one under its share to get
    in at once while another drains down to a share that just shrank), else 0. A gateway with
    one tenant lets it use every seat; a flooding tenant beside
    idle ones all but the kept seats; beside quiet ones holding a seat each, all but those and the
    kept; beside k - 1 other floods, 1/k of C. A tenant under its share is never refused for
    another's load, only when every seat is held (and then a tenant over its share drains first:
    it gets no seat back until it is under its share again).
  - a critical tenant (engine config `critical: true`) has no share: it is refused only when
    every seat is held, and the kept seats are its headroom (DESIGN section 6).

Both refusals carry `Retry-After` from the measured drain rate: the seats left (of the tenant, or
of the gateway) over the last DRAIN_WINDOW_S, needed / rate, where needed = the leaves that would
let this request in; before any leave was seen in the window, Little's law on the measured mean time
a seat is held (held / mean), before any, DRAIN_PRIOR_S. The refusal names the limit and the
stage (S4_REJECT: the early refusal of DESIGN section 6, decided here, not by the router).
Health probes (/health, /ping, gRPC Health) never pass the door.

Why not uvicorn's `limit_concurrency`: it counts connections and tasks (idle keep-alive
connections and /health included), knows no tenant, answers a plain-text 503 without
Retry-After, and would refuse the health probe first under a flood.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.gateway import errors
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb

DRAIN_WINDOW_S = 10.0      # the drain rate is the leaves of the last this many seconds
DRAIN_PRIOR_S = 1.0        # Retry-After before any seat was ever left
MIN_SPAN_S = 1.0           # a rate is measured over at least this long (less is noise)
MIN_WAIT_S = 0.05          # the least wait an estimate says (the header rounds up to 1 s)
EWMA_WEIGHT = 0.1          # of the mean time a seat is held
# 1/8 of the seats kept out of the shares: 4 of the emulated fleet's 32, where the noisy-neighbor
# workload's three quiet tenants (0.5 req/s each, ~1 s a chat) hold ~1.5 at a time
KEPT_DIVISOR = 8
STAGE = pb.OverloadStage.Name(pb.S4_REJECT)
TENANT_REASON, FULL_REASON = "door_tenant_share", "door_full"


def fair_level(room: int, others: list[int]) -> int:
    """The max-min fair share of `room` seats for one more tenant beside `others` (their
    holdings): each other tenant counts up to the level, the level is what is left over the
    tenants not under it (water-filling)."""
    left, count = room, len(others) + 1
    for held in sorted(others):
        if held * count >= left:          # this one and the rest reach the level: they share
            break
        left, count = left - held, count - 1
    return left // count


class Drain:
    """The rate at which seats are left (per second, over the last DRAIN_WINDOW_S) and the mean
    time one is held."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.leaves: deque[float] = deque()
        self.mean_held_s: float | None = None

    def left(self, now: float, held_s: float) -> None:
        self.leaves.append(now)
        mean = self.mean_held_s
        self.mean_held_s = held_s if mean is None else mean + EWMA_WEIGHT * (held_s - mean)

    def rate(self, now: float) -> float | None:
        while self.leaves and self.leaves[0] < now - DRAIN_WINDOW_S:
            self.leaves.popleft()
        span = max(MIN_SPAN_S, min(DRAIN_WINDOW_S, now - self.started))
        return len(self.leaves) / span if self.leaves else None

    def wait_for(self, needed: int, held: int, now: float) -> tuple[float, str]:
        """(seconds until `needed` more seats are left, how that was estimated)."""
        rate = self.rate(now)
        if rate is not None:
            wait, how = needed / rate, f"{rate:.1f} leaving per second lately"
        elif self.mean_held_s is not None and held > 0:
            wait, how = (needed * self.mean_held_s / held,
                         f"{held} held, {self.mean_held_s:.1f} s each on average")
        else:
            wait, how = DRAIN_PRIOR_S, "nothing measured yet"
        return max(MIN_WAIT_S, wait), how


class Seat:
    """One request's place inside the door; `leave` gives it back (idempotent)."""

    __slots__ = ("door", "tenant", "entered", "_left")

    def __init__(self, door: Door, tenant: str, entered: float) -> None:
        self.door, self.tenant, self.entered, self._left = door, tenant, entered, False

    def leave(self) -> None:
        if not self._left:
            self._left = True
            self.door._leave(self)


class DoorMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        kw = {"registry": registry if registry is not None else CollectorRegistry()}
        self.in_progress = Gauge(
            "kvfleet_gateway_in_progress",
            "Generation requests this gateway holds now (its front door's seats), by tenant",
            ["tenant"], **kw)
        self.shed = Counter(
            "kvfleet_gateway_shed",
            "Generation requests refused at the gateway's front door, by reason: "
            f"{TENANT_REASON} (429: the tenant's fair share) or {FULL_REASON} (503: every seat)",
            ["reason", "tenant"], **kw)


class Door:
    def __init__(self, max_in_progress: int, tenants: Iterable[str],
                 registry: CollectorRegistry | None = None, critical: Iterable[str] = (),
                 label: Callable[[str], str] = str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = max_in_progress
        self.known = frozenset(tenants)
        self.critical = frozenset(critical)       # tenants with no share (only the bound)
        self._clock = clock
        self._label = label                       # a tenant's bounded metric label
        self.metrics = DoorMetrics(registry)
        # Invariant: held[t] = seats entered by t and not left; only tenants with > 0 are keys.
        self.held: dict[str, int] = {}
        self.in_progress = 0                      # = sum(held.values())
        now = clock()
        self._drain = Drain(now)
        self._tenant_drain: dict[str, Drain] = {}

    def share(self, tenant: str) -> int:
        """The seats `tenant` may hold now (module docstring)."""
        room = self.limit - (max(1, self.limit // KEPT_DIVISOR) if len(self.known) > 1 else 0)
        return max(1, fair_level(room, [n for t, n in self.held.items() if t != tenant]))

    def enter(self, tenant: str) -> Seat:
        """A seat for a request of `tenant`, or the refusal (GatewayError) to send at once."""
        now = self._clock()
        if self.limit:
            mine = self.held.get(tenant, 0)
            share = self.share(tenant)
            if mine >= share and tenant not in self.critical:
                raise self._over_share(tenant, mine, share, now)
            if self.in_progress >= self.limit:
                raise self._full(tenant, now)
        self.held[tenant] = self.held.get(tenant, 0) + 1
        self.in_progress += 1
        self.metrics.in_progress.labels(self._label(tenant)).inc()
        return Seat(self, tenant, now)

    def _leave(self, seat: Seat) -> None:
        now = self._clock()
        left = self.held[seat.tenant] - 1
        if left:
            self.held[seat.tenant] = left
        else:
            del self.held[seat.tenant]
        self.in_progress -= 1
        self.metrics.in_progress.labels(self._label(seat.tenant)).dec()
        self._drain.left(now, now - seat.entered)
        self._tenant(seat.tenant, now).left(now, now - seat.entered)

    def _tenant(self, tenant: str, now: float) -> Drain:
        drain = self._tenant_drain.get(tenant)
        if drain is None:
            drain = self._tenant_drain[tenant] = Drain(now)
        return drain

    def _over_share(self, tenant: str, mine: int, share: int, now: float) -> errors.GatewayError:
        wait, how = self._tenant(tenant, now).wait_for(mine - share + 1, mine, now)
        self.metrics.shed.labels(TENANT_REASON, self._label(tenant)).inc()
        return errors.GatewayError(
            429, f"tenant {tenant!r} holds {mine} of this gateway's requests in progress, its "
                 f"fair share ({share} of max_in_progress {self.limit} beside "
                 f"{len(self.held) - (tenant in self.held)} other busy tenants); retry in "
                 f"~{wait:.1f} s (its requests: {how})",
            code="tenant_share_exceeded", retry_after=wait).tagged(TENANT_REASON, STAGE)

    def _full(self, tenant: str, now: float) -> errors.GatewayError:
        wait, how = self._drain.wait_for(self.in_progress - self.limit + 1,
                                         self.in_progress, now)
        self.metrics.shed.labels(FULL_REASON, self._label(tenant)).inc()
        return errors.GatewayError(
            503, f"this gateway holds {self.in_progress} requests in progress, its limit "
                 f"(max_in_progress {self.limit}); retry in ~{wait:.1f} s "
                 f"(its requests: {how})",
            code="gateway_full", retry_after=wait).tagged(FULL_REASON, STAGE)
