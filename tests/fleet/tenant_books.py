"""What a fleet's shared state says a tenant still holds, as the back-to-zero stories read it."""
from __future__ import annotations

from services.router import admission
from services.state.fleet_state import FleetState
from services.state.wait_queue import WaitQueue

CLASSES = ("interactive", "document", "batch")


async def tenant_books(redis_url: str, tenant: str) -> tuple[int, int, int]:
    """(the tenant's open stream leases, its decode KV blocks fleet-wide as a router reads them
    from Redis: published shares plus what routers placed since those beats, requests waiting in
    the router's queue, every class)."""
    async with FleetState(redis_url) as state:
        queue = WaitQueue(state.redis, state.ns)
        waiting = sum([await queue.waiting(c) for c in CLASSES])
        workers = await state.live_workers()
        placed = await state.placed([(w.worker_id, w.updated_at_unix_s) for w in workers])
        by_tenant: dict[str, int] = {}
        for row in placed:
            for t, n in row.tenants.items():
                by_tenant[t] = by_tenant.get(t, 0) + n
        kv = admission.tenant_kv(workers, by_tenant).get(tenant, 0)
        return await state.streams(tenant), kv, waiting
