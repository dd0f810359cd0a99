"""Tenant quotas in Redis (services/state/fleet_state.py): concurrent streams, requests per minute,
tokens per minute. Counters are per tenant (shared by every gateway), limits are per API key.

`admit` is one atomic Redis script: stream slot, then the request, then the prompt's tokens; a
refusal at a later step takes no slot (FleetState.admit); a refusal's error is tagged
`quota_streams|quota_requests|quota_tokens|quota_too_large|quota_unavailable` (kvfleet_rejections).
Generated tokens (those sent to the client, core.Session) are charged when the request ends,
however it ends (`finish`), so a tenant that overruns its token budget is refused from then until the
minute window rolls over.

Stream slots are leases: `admit` takes one named `{gateway_id}/{n}`, this gateway renews every
lease it holds (`renew_forever`, a task of services/gateway/server.py) until `finish` drops it. A
gateway that dies stops renewing, so its slots come back within the lease TTL; a lease that Redis
lost (an empty Redis after a restart) is added back at the next renewal.

Redis outages: every call goes through one `Outage` (services/state/outage.py). While Redis is
down a request is refused at once with 503 "quota store unavailable" and a Retry-After of the
time until Redis is tried again (at least 1 s); a stream that ends meanwhile cannot drop its lease,
which then lapses within the TTL (its generated tokens go uncharged). The renewer keeps probing
with backoff, so the gateway notices Redis is back within `Backoff.cap_s` (2 s) even without traffic.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from services.state.fleet_state import Admission, FleetState, LeaseTerms, StreamLease
from services.state.outage import UNREACHABLE, Outage
from services.gateway import errors
from services.gateway.config import ApiKey

log = logging.getLogger(__name__)

# Until this gateway has seen one of a tenant's streams end, its streams are assumed to last this
# long (a chat completion of a few hundred tokens); see StreamDurations.
STREAM_DURATION_PRIOR_S = 10.0
EWMA_WEIGHT = 0.2
MIN_PROBE_S = 0.05


class StreamDurations:
    """Per tenant, an exponentially weighted mean of how long this gateway's streams lasted: the
    basis of a streams 429's Retry-After when no slot's expiry is known (all holders are alive)."""

    def __init__(self, prior_s: float = STREAM_DURATION_PRIOR_S) -> None:
        self.prior_s = prior_s
        self._mean: dict[str, float] = {}

    def record(self, tenant: str, seconds: float) -> None:
        mean = self._mean.get(tenant)
        self._mean[tenant] = seconds if mean is None else mean + EWMA_WEIGHT * (seconds - mean)

    def first_end_in(self, tenant: str, open_streams: int) -> float:
        """An estimate, not a promise: the expected wait until the first of `open_streams` streams
        ends, if a stream's remaining time were memoryless with the measured mean (mean / n)."""
        return self._mean.get(tenant, self.prior_s) / max(1, open_streams)


class Quotas:
    def __init__(self, state: FleetState, holder: str, terms: LeaseTerms = LeaseTerms(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.state = state
        self.holder = holder                  # this gateway's id, the prefix of its lease ids
        self.terms = terms
        self.redis = Outage("gateway quota store", log)
        self.durations = StreamDurations()
        self._clock = clock
        self._seq = itertools.count(1)
        # Every lease this gateway holds -> when its stream started. Invariant: a lease is here
        # from its admission until its stream ends (finish), so it is renewed exactly that long.
        self._held: dict[StreamLease, float] = {}
        self._by_tenant: dict[str, int] = {}      # the same leases, counted by tenant

    @property
    def held(self) -> int:
        return len(self._held)

    def refuse_early(self, key: ApiKey) -> None:
        """429 at once, before the request's body is read, when this gateway alone already holds
        every stream slot of the key's tenant (the fleet-wide count in Redis can only be higher,
        so `admit` would refuse it too): a tenant flooding past its quota costs the gateway a
        header read, not a body parse, a tokenization and a Redis call per request."""
        mine = self._by_tenant.get(key.tenant, 0)
        if mine >= key.max_concurrent_streams:
            estimate = self.durations.first_end_in(key.tenant, mine)
            raise errors.rate_limited(
                f"tenant {key.tenant!r} already has {key.max_concurrent_streams} concurrent "
                f"streams (max_concurrent_streams); retry when one ends (estimated in "
                f"{estimate:.1f} s)", estimate).tagged("quota_streams_early")

    async def admit(self, key: ApiKey, prompt_tokens: int) -> StreamLease:
        """Take a stream slot and charge the request and its prompt, or raise 429 having taken no slot
        (the request counter keeps a refused request, as OpenAI counts them), or 503 if Redis is down."""
        if prompt_tokens > key.tokens_per_minute:
            raise errors.rate_limited(
                f"request too large for tenant {key.tenant!r}: {prompt_tokens} prompt tokens, "
                f"tokens_per_minute limit {key.tokens_per_minute}", None).tagged("quota_too_large")
        try:
            admission = await self.redis.call(
                self.state.admit, key.tenant, key.max_concurrent_streams, key.requests_per_minute,
                prompt_tokens, key.tokens_per_minute, lease_id=f"{self.holder}/{next(self._seq)}",
                terms=self.terms)
        except UNREACHABLE as e:
            raise self.unavailable(e) from None
        if admission.lease is None:
            raise self._refusal(key, admission).tagged(f"quota_{admission.refused}")
        self._held[admission.lease] = self._clock()
        self._by_tenant[key.tenant] = self._by_tenant.get(key.tenant, 0) + 1
        return admission.lease

    def unavailable(self, e: BaseException) -> errors.GatewayError:
        return errors.unavailable(f"quota store unavailable (Redis): {e}",
                                  max(1.0, self.redis.retry_in())).tagged("quota_unavailable")

    def _refusal(self, key: ApiKey, admission: Admission) -> errors.GatewayError:
        t = key.tenant
        if admission.refused == "requests":
            return errors.rate_limited(f"tenant {t!r} exceeded {key.requests_per_minute} "
                                       "requests per minute", admission.retry_after_s)
        if admission.refused == "tokens":
            return errors.rate_limited(f"tenant {t!r} exceeded {key.tokens_per_minute} "
                                       "tokens per minute", admission.retry_after_s)
        busy = (f"tenant {t!r} already has {key.max_concurrent_streams} concurrent streams "
                "(max_concurrent_streams)")
        if admission.retry_after_s is not None:
            return errors.rate_limited(
                f"{busy}; a slot held by a gateway that stopped renewing it frees in "
                f"{admission.retry_after_s:.1f} s", admission.retry_after_s)
        estimate = self.durations.first_end_in(t, key.max_concurrent_streams)
        return errors.rate_limited(f"{busy}; retry when one ends (estimated in {estimate:.1f} s)",
                                   estimate)

    async def finish(self, lease: StreamLease, output_tokens: int) -> None:
        """Give the stream slot back and charge what was generated. Never raises: if Redis cannot be
        reached the lease lapses within the TTL, since nobody renews it any more."""
        started = self._held.pop(lease, None)
        if started is not None:
            self.durations.record(lease.tenant, self._clock() - started)
            left = self._by_tenant.pop(lease.tenant, 0) - 1
            if left > 0:
                self._by_tenant[lease.tenant] = left
        try:
            await self.redis.call(self.state.finish_stream, lease, output_tokens)
        except UNREACHABLE as e:
            log.debug("lease %s of tenant %s lapses instead: %s", lease.lease_id, lease.tenant, e)
        except RedisError:
            log.exception("could not release the stream slot of tenant %s", lease.tenant)

    async def check(self) -> str | None:
        """None if the quota store answers, else why not (health)."""
        try:
            await self.redis.call(self.state.ping)
        except RedisError as e:
            return f"quota store unavailable (Redis): {e}"
        return None

    # --- lease renewal ------------------------------------------------------------------------
    async def renew_forever(self) -> None:
        """Renew this gateway's leases every ~renew_every_s; while Redis is down, probe it with
        backoff instead (so the gateway notices recovery without traffic). Runs until cancelled."""
        while True:
            await asyncio.sleep(await self.renew_once())

    async def renew_once(self) -> float:
        """One renewal (or probe); returns the seconds to wait before the next one."""
        leases = list(self._held)
        try:
            if leases:
                await self._release_ended(
                    await self.redis.call(self.state.renew_leases, leases, self.terms))
            elif self.redis.down:
                await self.redis.call(self.state.ping)
        except UNREACHABLE:
            return max(self.redis.retry_in(), MIN_PROBE_S)
        except Exception:  # noqa: BLE001 - a bug must not stop renewals: the slots would lapse
            log.exception("renewing %d stream leases failed", len(leases))
        # jittered down, never up: a live lease always keeps more than lapsed_below_s left
        return self.terms.renew_every_s * (0.8 + 0.2 * random.random())

    async def _release_ended(self, restored: list[StreamLease]) -> None:
        """Leases Redis had lost are back. Any whose stream ended while the renewal was on its way
        (its finish ran first, so the renewal put it back) is dropped again at once: that is the
        ordinary race of a renewal and a finish, not a loss, so only the others are logged."""
        ended = [lease for lease in restored if lease not in self._held]
        lost = len(restored) - len(ended)
        if lost:
            log.info("redis had lost %d of this gateway's stream leases: added back", lost)
        for lease in ended:
            await self.state.finish_stream(lease, 0)
