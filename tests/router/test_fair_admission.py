"""Tenant fairness in the router's admission, over real workers and a real Redis: a quiet tenant's
waiter is admitted before a noisy tenant's earlier backlog (services/router/fair_order.py).

The decode pool is full; the noisy tenant queues three documents, then the quiet tenant one. The
fair order puts the quiet tenant's waiter second (its first turn ties the noisy tenant's first,
whose deadline is earlier), ahead of the noisy tenant's second and third. Reservations then free
one at a time; only the head of the queue tries (`wake_width` 1) and only when a capacity
notification comes (the router's retry timers are far), so the admissions follow the order."""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import grpc
import pytest
import yaml

from services.engine.config import Tenant
from services.protocol.aio import internal_channel
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.protocol.timeouts import Timeouts
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


async def serve_router(fleet) -> tuple[pb_grpc.RouterStub, RouterServicer, object]:
    state = FleetState(fleet.redis_url)
    servicer = RouterServicer(state, "disagg", "r-fair", timeouts=NOT_BY_TIMER, auth=fleet.auth,
                              policy=FAIR)
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
    return pb_grpc.RouterStub(channel), servicer, close


def test_a_quiet_tenants_waiter_is_admitted_before_a_noisy_tenants_earlier_backlog(workers):
    stats = workers.stats("decode-0")
    long = list(range(100, 100 + min(stats.max_model_len - 64, 2000)))
    fill = stats.kv_blocks_total // kv_blocks_needed(stats, len(long),
                                                     pb.SamplingParams(max_tokens=32))

    async def story():
        router, servicer, close = await serve_router(workers)
        plans, waiters = [], {}
        try:
            for i in range(fill):                               # the decode pool is full
                plans.append(await admit(router, request(f"fill-{i}", long, 32, "document")))
            async with FleetState(workers.redis_url) as state:
                queue = WaitQueue(state.redis, state.ns)

                async def join(rid: str, tenant: str) -> None:
                    waiters[rid] = asyncio.ensure_future(
                        admit(router, request(rid, long, 32, "document", tenant)))
                    n = len(waiters)
                    await until(lambda: _queued(queue, n, waiters[rid]))

                for rid in ("noisy-1", "noisy-2", "noisy-3"):
                    await join(rid, "noisy")
                await join("quiet-1", "quiet")

                order = [await queue.position(rid, "document", time.time(), rid.split("-")[0])
                         for rid in ("noisy-1", "quiet-1", "noisy-2", "noisy-3")]
                assert order == [0, 1, 2, 3]

                admitted = []
                for _ in range(2):                  # two reservations free, one at a time
                    await cancel(workers, plans.pop(0))
                    admitted.append(await _next_admitted(waiters, queue))
                    plans.append(await waiters.pop(admitted[-1]))
                assert admitted == ["noisy-1", "quiet-1"]
                assert not any(w.done() for w in waiters.values())   # noisy-2, noisy-3 wait on
        finally:
            for w in waiters.values():
                w.cancel()
            await asyncio.gather(*waiters.values(), return_exceptions=True)
            for p in plans:
                await cancel(workers, p)
            await close()
    asyncio.run(story())
    assert wait_until(lambda: held(workers.stats("decode-0")) == 0, 10)


async def _queued(queue: WaitQueue, n: int, waiter: asyncio.Future) -> bool:
    """Whether `n` wait in the queue; a waiter that was decided instead says how."""
    if waiter.done():
        raise AssertionError(f"decided without waiting: {waiter.result()}")
    return await _waiting(queue, n)


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
