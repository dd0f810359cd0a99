"""Tenant fairness in the router's admission, over real workers and a real Redis: a quiet tenant's
waiter is admitted before a noisy tenant's earlier backlog (services/router/fair_order.py), and a
tenant under its guaranteed minimum KV before every borrower (services/router/admission.py).

The decode pool is full; the noisy tenant queues three documents, then the quiet tenant one. The
fair order puts the quiet tenant's waiter second (its first turn ties the noisy tenant's first,
whose deadline is earlier), ahead of the noisy tenant's second and third. Reservations then free
one at a time; only the head of the queue tries (`wake_width` 1) and only when a capacity
notification comes (the router's retry timers are far), so the admissions follow the order.

The waiters ask as the gateway does (services/gateway/fleet_run.py: an ask on its AdmitStream
call), so that giving one up is a cancel message the router acts on: a story ends its waiters,
sees the router end each (the queue empties), and only then frees the pool. (On unary Admits a
caller's cancel reached the router's handler late or never under load; freeing the pool woke
that waiter, which reserved for no one, and grpc's `context.cancelled()` said False when its
plan went out, so its blocks stayed held until the reservation's lifetime.)"""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import grpc
import pytest
import yaml

from services.engine.config import Tenant
from services.gateway.fleet_run import Channels
from services.protocol import shared_call
from services.protocol.aio import internal_channel
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.protocol.timeouts import Timeouts
from services.router import admission
from services.router.placement import kv_blocks_needed
from services.router.service import RouterServicer
from services.state.fleet_state import FleetState
from services.state.wait_queue import WaitQueue
from tests.harness import running_fleet
from tests.router.test_admission_flow import POLICY, admit, request, until
from tests.router.test_admit import cancel, held
from tests.waiting import wait_until

FAIR = replace(POLICY, wake_width=1, tenants=(Tenant("noisy"), Tenant("quiet")))
NOT_BY_TIMER = replace(Timeouts(), heartbeat_s=600.0, heartbeat_ttl_s=1200.0)


@pytest.fixture(scope="module")
def workers(redis_url, tiny_model_dir, tmp_path_factory):
    """One prefill and one decode worker process that know the two tenants (no router process:
    the test brings its own)."""
    config = tmp_path_factory.mktemp("fair") / "engine.yaml"
    config.write_text(yaml.safe_dump({"scheduler": {"tenants": [
        {"name": t} for t in ("default", "noisy", "quiet")]}}))
    with running_fleet(redis_url, str(tiny_model_dir), "disagg", routers=0,
                       worker_args=("--config", str(config))) as fleet:
        assert wait_until(lambda: len(fleet.workers) == 2 and all(
            fleet.stats(n).kv_blocks_total for n in fleet.workers), 30)
        yield fleet


@pytest.fixture
def settled(workers):
    """Each story starts at S0 with no document waiting and no tenant KV published: an earlier
    story of the session may have left the stage record, a waiter whose caller went just before
    its router closed (pruned at its deadline), or a tenant's share the decode worker still
    published until its next beat (which made a tenant under its minimum look above it)."""
    async def settle():
        async with FleetState(workers.redis_url) as state:
            await state.redis.delete(f"{state.ns}stage")
            await until(lambda: _waiting(WaitQueue(state.redis, state.ns), 0))
            await until(lambda: _no_tenant_kv(state))     # an earlier story's share, published
    asyncio.run(settle())


async def serve_router(fleet, policy=FAIR) -> tuple[pb_grpc.RouterStub, RouterServicer, object,
                                                    str]:
    state = FleetState(fleet.redis_url)
    servicer = RouterServicer(state, "disagg", "r-fair", timeouts=NOT_BY_TIMER, auth=fleet.auth,
                              policy=policy)
    server = grpc.aio.server()
    pb_grpc.add_RouterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = internal_channel(f"127.0.0.1:{port}", fleet.auth)

    async def close():
        await channel.close()
        await server.stop(0)
        await servicer.close()
        await state.close()
    return pb_grpc.RouterStub(channel), servicer, close, f"127.0.0.1:{port}"


class FullPool:
    """A router of its own over the module's workers with the decode pool full of long documents
    (`fill`); tenants' documents then join the wait queue (`join`); `free_one` cancels one fill
    plan and returns the waiter admitted next. Leaving it cancels every waiter and plan. The
    waiters ask on a gateway's AdmitStream call (`Channels`), the fills on unary Admits."""

    def __init__(self, workers, policy=FAIR):
        self.workers, self.policy = workers, policy
        stats = workers.stats("decode-0")
        self.long = list(range(100, 100 + min(stats.max_model_len - 64, 2000)))
        self.need = kv_blocks_needed(stats, len(self.long), pb.SamplingParams(max_tokens=32))
        self.fill = stats.kv_blocks_total // self.need
        self.plans, self.waiters = [], {}

    async def __aenter__(self) -> "FullPool":
        self.router, self.servicer, self._close, address = await serve_router(self.workers,
                                                                              self.policy)
        self.channels = Channels(self.workers.auth)
        self.admits = self.channels.admit_call(address)
        self.state = FleetState(self.workers.redis_url)
        self.queue = WaitQueue(self.state.redis, self.state.ns)
        for i in range(self.fill):                              # the decode pool is full
            self.plans.append(await admit(self.router, request(f"fill-{i}", self.long, 32,
                                                               "document")))
        return self

    async def __aexit__(self, *exc) -> None:
        """The waiters go first, and the pool frees only once the router has ended each of them
        (they left the queue), so freeing it wakes no waiter whose caller went."""
        for w in self.waiters.values():
            w.cancel()
        ended = await asyncio.gather(*self.waiters.values(), return_exceptions=True)
        self.plans += [p for p in ended if isinstance(p, pb.Plan)]    # admitted as it went
        await until(lambda: _waiting(self.queue, 0))
        for p in self.plans:
            await cancel(self.workers, p)
        await self.channels.close()        # after the releases of plans that came to no one
        await self.state.close()
        await self._close()

    async def join(self, rid: str, tenant: str) -> None:
        """`tenant`'s document `rid` asks, and waits in the queue."""
        self.waiters[rid] = asyncio.ensure_future(shared_call.admit(
            self.admits, request(rid, self.long, 32, "document", tenant), 30.0))
        n = len(self.waiters)
        await until(lambda: _queued(self.queue, n, self.waiters[rid]))

    async def order(self, *rids: str) -> list[int | None]:
        """Each waiter's place in the fair order (its tenant is its id's prefix)."""
        return [await self.queue.position(rid, "document", time.time(), rid.split("-")[0])
                for rid in rids]

    async def free_one(self) -> str:
        await cancel(self.workers, self.plans.pop(0))
        admitted = await _next_admitted(self.waiters, self.queue)
        self.plans.append(await self.waiters.pop(admitted))
        return admitted


def test_a_quiet_tenants_waiter_is_admitted_before_a_noisy_tenants_earlier_backlog(workers, settled):
    async def story():
        async with FullPool(workers) as pool:
            for rid in ("noisy-1", "noisy-2", "noisy-3"):
                await pool.join(rid, "noisy")
            await pool.join("quiet-1", "quiet")
            assert await pool.order("noisy-1", "quiet-1", "noisy-2", "noisy-3") == [0, 1, 2, 3]
            # two reservations free, one at a time
            assert [await pool.free_one(), await pool.free_one()] == ["noisy-1", "quiet-1"]
            assert not any(w.done() for w in pool.waiters.values())   # noisy-2, noisy-3 wait on
    asyncio.run(story())
    assert wait_until(lambda: held(workers.stats("decode-0")) == 0, 10)


def test_a_tenant_under_its_guaranteed_kv_is_admitted_ahead_of_borrowers_then_borrows(workers,
                                                                                     settled):
    """quiet is guaranteed the KV of one long document. The pool is full; noisy queues two, then
    quiet one: under its minimum, quiet's waiter stands first and takes the first freed
    reservation. quiet's second document would take it past its minimum: it is a borrower like
    noisy's and waits its fair turn, behind noisy's first (their start tags tie; noisy's deadline
    is earlier). The count that tells is fleet-wide: the tenant shares the decode worker publishes
    (here, once they show quiet's first; within one beat, what routers placed for the tenant since
    it: tests/router/test_placements.py)."""
    need = FullPool(workers).need
    guaranteed = replace(FAIR, tenants=(Tenant("noisy"), Tenant("quiet", min_kv_blocks=need)))

    async def story():
        async with FullPool(workers, guaranteed) as pool:
            for rid in ("noisy-1", "noisy-2", "quiet-1"):
                await pool.join(rid, rid.split("-")[0])
            assert await pool.order("quiet-1", "noisy-1", "noisy-2") == [0, 1, 2]
            assert await pool.free_one() == "quiet-1"

            async def quiet_counted() -> bool:       # the router's list shows its share
                live = await pool.servicer.live_workers()
                return admission.tenant_kv(live).get("quiet", 0) >= need

            await until(quiet_counted)
            await pool.join("quiet-2", "quiet")                 # past its minimum: it borrows
            assert await pool.order("noisy-1", "quiet-2", "noisy-2") == [0, 1, 2]
            assert await pool.free_one() == "noisy-1"
    asyncio.run(story())
    assert wait_until(lambda: held(workers.stats("decode-0")) == 0, 10)


async def _queued(queue: WaitQueue, n: int, waiter: asyncio.Future) -> bool:
    """Whether `n` wait in the queue; a waiter that was decided instead says how."""
    if waiter.done():
        raise AssertionError(f"decided without waiting: {waiter.result()}")
    return await _waiting(queue, n)


async def _no_tenant_kv(state: FleetState) -> bool:
    """No decode KV is published for any tenant (a beat after an earlier story freed its own)."""
    return not any(admission.tenant_kv(await state.live_workers()).values())


async def _waiting(queue: WaitQueue, n: int) -> bool:
    return (await queue.depth("document", time.time())).waiting == n


async def _next_admitted(waiters: dict[str, asyncio.Future], queue: WaitQueue,
                         timeout_s: float = 30.0) -> str:
    """The waiter admitted next. The decode worker's notification may reach the head before its
    heartbeat shows the freed blocks (the head then misses on stats and waits for the next
    notification): the test repeats the notification until someone is admitted."""
    end = time.monotonic() + timeout_s
    while not (done := [rid for rid, w in waiters.items() if w.done()]):
        assert time.monotonic() < end, "no waiter was admitted in time"
        await queue.notify(1)
        await asyncio.wait(list(waiters.values()), timeout=0.2,
                           return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1, done
    return done[0]
