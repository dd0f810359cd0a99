"""What tests read and do to a tenant's quota state in Redis that no service needs: its counters
in one round trip, a direct token charge, and a reset (as an empty Redis would be)."""
from __future__ import annotations

import time
from dataclasses import dataclass

from services.state.fleet_state import FleetState, _ms


@dataclass(frozen=True)
class TenantCounters:
    streams: int      # live leases
    tokens: int       # this minute's window
    requests: int     # this minute's window


async def tenant_counters(fs: FleetState, tenant: str, now: float | None = None) -> TenantCounters:
    """Open streams (live leases) and this minute's charges, read in one round trip."""
    now = time.time() if now is None else now
    async with fs._r.pipeline(transaction=False) as p:
        p.zcount(fs._leases_key(tenant), f"({_ms(now)}", "+inf")
        p.mget([fs._window_key(tenant, "tokens", now), fs._window_key(tenant, "requests", now)])
        streams, (tokens, requests) = await p.execute()
    return TenantCounters(int(streams), _count(tokens), _count(requests))


def _count(value: str | None) -> int:
    """A window's count as read; one kvfleet did not write (not an integer) reads as 0."""
    try:
        return max(0, int(value or 0))
    except ValueError:
        return 0


async def charge_tokens(fs: FleetState, tenant: str, tokens: int, per_minute_limit: int,
                        now: float | None = None) -> tuple[bool, float]:
    """Charge tokens to this minute's window: (True, 0.0), or (False, seconds left in the window)
    with nothing charged. A single charge above per_minute_limit is always refused."""
    return await fs._charge_window(tenant, "tokens", tokens, per_minute_limit, now)


async def reset_tenant(fs: FleetState, tenant: str, now: float | None = None) -> None:
    """Drop the tenant's leases and this minute's windows (older windows are never read)."""
    now = time.time() if now is None else now
    await fs._r.delete(fs._leases_key(tenant), fs._window_key(tenant, "tokens", now),
                       fs._window_key(tenant, "requests", now))
