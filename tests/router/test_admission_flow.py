"""The router's own admission over real workers and a real Redis: a request the full decode pool
cannot take waits in the wait queue and is admitted when a reservation frees (woken by the decode
worker's capacity notification, long before the safety-net timer); a request whose best case
misses its target is refused at once, saying which term and by how much; the fleet's stage
decides what happens to everyone but critical tenants.

The routers under test run in this process (RouterServicer behind a real gRPC server); the
workers are real processes (tests/router/test_admit.py's fleet)."""
from __future__ import annotations

import asyncio
import itertools
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.waiting import wait_until
from services.engine.config import BATCH, DOCUMENT, INTERACTIVE, Tenant, TrafficClass
from services.protocol import status
from services.protocol.aio import internal_channel
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.protocol.timeouts import Timeouts
from services.router.admission import AdmissionConfig
from services.router.placement import kv_blocks_needed
from services.router.service import RouterServicer
from services.router.stages import S1, S2, S4, StageConfig
from services.router.waiting import RETRY_MIN_S, DrainRate
from services.state.fleet_state import FleetState
from services.state.stage_record import StageStore
from services.state.wait_queue import WaitQueue
from tests.harness import route_request
from tests.router.test_admit import PROMPT, cancel, held, serve_routers, workers  # noqa: F401

TIGHT = TrafficClass("tight", priority=2, ttft_target_s=1e-6, itl_target_s=0.1,
                     max_prompt_tokens=8192, output_cap=64, predicted_output_tokens=16, aging_s=10)
POLICY = AdmissionConfig(
    classes=(INTERACTIVE, DOCUMENT, BATCH, TIGHT),
    retry_s=600.0,                       # the safety net is far: only a notification wakes a waiter
    headroom_kv_fraction=0.0, headroom_slot_fraction=0.0, s2_output_cap=16,
    stages=StageConfig(min_dwell_s=3600.0))   # a stage the test writes stays


def request(rid: str, ids, max_tokens: int, cls: str, tenant: str = "") -> pb.WorkRequest:
    r = route_request(rid, ids, max_tokens)
    r.traffic_class, r.tenant = cls, tenant
    return r


async def admit(router, r: pb.WorkRequest, timeout: float = 30.0) -> pb.Plan:
    return await router.Admit(r, timeout=timeout)


async def refusal(router, r: pb.WorkRequest, timeout: float = 30.0) -> pb.CallStatus:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await router.Admit(r, timeout=timeout)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    return status.of(e.value)


async def until(predicate, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < end, "the condition did not come true in time"
        await asyncio.sleep(0.05)


async def set_stage(redis_url: str, stage: int) -> None:
    async with FleetState(redis_url) as state:
        store = StageStore(state.redis, state.ns)
        await store.change(await store.read(), stage, time.time(), "set by the test", "test")


@pytest.fixture
def normal_stage(workers):  # noqa: F811
    """The fleet's stage record starts and ends absent (S0) around the test."""
    async def clear():
        async with FleetState(workers.redis_url) as state:
            await state.redis.delete(f"{state.ns}stage")
    asyncio.run(clear())
    yield
    asyncio.run(clear())


def test_a_request_waits_for_a_full_pool_and_is_admitted_when_a_reservation_frees(
        workers, normal_stage):  # noqa: F811
    stats = workers.stats("decode-0")
    long = list(range(100, 100 + min(stats.max_model_len - 64, 2000)))
    fill = stats.kv_blocks_total // kv_blocks_needed(stats, len(long),
                                                     pb.SamplingParams(max_tokens=32))

    async def story():
        (router,), close = await serve_routers(workers, 1, policy=POLICY)
        plans = []
        try:
            for i in range(fill):                       # the decode pool is full
                plans.append(await admit(router, request(f"fill-{i}", long, 32, "document")))
            waiter = asyncio.ensure_future(admit(router, request("waiter", long, 32, "document")))
            async with FleetState(workers.redis_url) as state:
                queue = WaitQueue(state.redis, state.ns)
                await until(lambda: _waiting(queue, "document", 1))
                assert not waiter.done()
                await cancel(workers, plans.pop(0))      # a reservation frees: the worker says so
                plan = await waiter
                assert plan.decode.worker_id == "decode-0"
                assert plan.queue_wait_s > 0 and plans[0].queue_wait_s == 0   # it says it waited
                plans.append(plan)
                assert await _waiting(queue, "document", 0)
        finally:
            for p in plans:
                await cancel(workers, p)
            await close()
    asyncio.run(story())
    assert wait_until(lambda: held(workers.stats("decode-0")) == 0, 10)


async def _waiting(queue: WaitQueue, cls: str, n: int) -> bool:
    return (await queue.depth(cls, time.time())).waiting == n


def test_a_request_whose_best_case_misses_its_target_is_refused_at_once_saying_why(
        workers, normal_stage):  # noqa: F811
    async def story():
        (router,), close = await serve_routers(workers, 1, policy=POLICY)
        try:
            st = await refusal(router, request("tight-1", PROMPT, 8, "tight"))
            assert st.reason == pb.OVERLOADED and st.stage == pb.S0_NORMAL
            assert st.message.startswith("prefill: predicted TTFT ")
            assert "vs target 1e-06 s (stage S0_NORMAL)" in st.message
            assert st.HasField("retry_after_s") and st.retry_after_s > 0
        finally:
            await close()
    asyncio.run(story())
    assert held(workers.stats("decode-0")) == 0          # nothing was reserved for it


def test_a_request_whose_kv_could_not_land_while_its_reservation_holds_is_refused_at_once(
        workers, normal_stage):  # noqa: F811
    # the KV moves after the first token, so it is no part of the TTFT; but a write may take at
    # most kv_transfer_s, here far less than any prompt's KV takes over loopback
    async def story():
        (router,), close = await serve_routers(workers, 1, policy=POLICY,
                                               timeouts=Timeouts(kv_transfer_s=1e-9))
        try:
            st = await refusal(router, request("kv-slow-1", PROMPT, 8, "interactive"))
            assert st.reason == pb.OVERLOADED and st.stage == pb.S0_NORMAL
            assert st.message.startswith("kv transfer: predicted ")
            assert "to move the KV vs the 1e-09 s its decode reservation allows" in st.message
        finally:
            await close()
    asyncio.run(story())
    assert held(workers.stats("decode-0")) == 0          # nothing was reserved for it


def test_at_s4_only_critical_tenants_are_admitted(workers, normal_stage):  # noqa: F811
    # the workers know one tenant, "default": here it is the critical one
    critical_default = AdmissionConfig(tenants=(Tenant("default", critical=True),),
                                       stages=StageConfig(min_dwell_s=3600.0))

    async def story():
        await set_stage(workers.redis_url, S4)
        routers, close = await serve_routers(workers, 2, policy=critical_default)
        try:
            st = await refusal(routers[0], request("s4-a", PROMPT, 8, "interactive", "acme"))
            assert st.stage == pb.S4_REJECT and "early refusal" in st.message
            assert st.HasField("retry_after_s")
            plan = await admit(routers[1], request("s4-ops", PROMPT, 8, "interactive", "default"))
            assert plan.stage == pb.S4_REJECT          # both routers read the fleet's one stage
            await cancel(workers, plan)
        finally:
            await close()
    asyncio.run(story())


def test_at_s2_a_degradable_class_is_capped_and_the_plan_says_so(
        workers, normal_stage):  # noqa: F811
    async def story():
        await set_stage(workers.redis_url, S2)
        (router,), close = await serve_routers(workers, 1, policy=POLICY)
        try:
            capped = await admit(router, request("s2-chat", PROMPT, 200, "interactive"))
            assert capped.stage == pb.S2_CAP_OUTPUT and capped.output_cap == 16
            whole = await admit(router, request("s2-doc", PROMPT, 200, "document"))
            assert whole.output_cap == 0                   # document is not degradable
            for p in (capped, whole):
                await cancel(workers, p)
        finally:
            await close()
    asyncio.run(story())


def test_at_s1_batch_waits_in_the_queue_and_is_refused_when_its_wait_ends(
        workers, normal_stage):  # noqa: F811
    async def story():
        await set_stage(workers.redis_url, S1)
        (router,), close = await serve_routers(workers, 1, policy=POLICY)
        try:
            # the call's deadline leaves admit_s (5 s) to place it: it may wait about 1 s
            st = await refusal(router, request("s1-batch", PROMPT, 8, "batch"), timeout=6.0)
            assert st.stage == pb.S1_NO_BATCH and "S1: batch waits" in st.message
            assert "in the queue" in st.message
            chat = await admit(router, request("s1-chat", PROMPT, 8, "interactive"))
            await cancel(workers, chat)
        finally:
            await close()
    asyncio.run(story())


def test_a_waiter_whose_caller_goes_away_leaves_the_queue_and_holds_nothing(
        workers, normal_stage):  # noqa: F811
    stats = workers.stats("decode-0")
    long = list(range(100, 100 + min(stats.max_model_len - 64, 2000)))
    fill = stats.kv_blocks_total // kv_blocks_needed(stats, len(long),
                                                     pb.SamplingParams(max_tokens=32))

    async def story():
        (router,), close = await serve_routers(workers, 1, policy=POLICY)
        plans = []
        try:
            for i in range(fill):
                plans.append(await admit(router, request(f"full-{i}", long, 32, "document")))
            async with FleetState(workers.redis_url) as state:
                queue = WaitQueue(state.redis, state.ns)
                waiters = [asyncio.ensure_future(admit(router, request(f"w{i}", long, 32,
                                                                      "document")))
                           for i in range(3)]
                await until(lambda: _waiting(queue, "document", 3))
                for w in waiters:                  # every caller goes away
                    w.cancel()
                await until(lambda: _waiting(queue, "document", 0))
        finally:
            for p in plans:
                await cancel(workers, p)
            await close()
    asyncio.run(story())
    assert wait_until(lambda: held(workers.stats("decode-0")) == 0, 10)


_ids = itertools.count()


@settings(max_examples=3, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(endings=st.lists(st.sampled_from(["served", "caller_gone", "router_gone"]),
                        min_size=1, max_size=3))
def test_queue_entries_and_reservations_come_back_to_zero_however_waiters_end(
        workers, normal_stage, endings):  # noqa: F811
    """Waiters behind a full pool end by being served (a reservation frees), by their caller going
    away, or by their router going away: the queue and the decode worker end empty."""
    stats = workers.stats("decode-0")
    long = list(range(100, 100 + min(stats.max_model_len - 64, 2000)))
    fill = stats.kv_blocks_total // kv_blocks_needed(stats, len(long),
                                                     pb.SamplingParams(max_tokens=32))
    run = next(_ids)

    async def story():
        (router,), close = await serve_routers(workers, 1, policy=POLICY)
        plans, closed = [], False
        try:
            for i in range(fill):
                plans.append(await admit(router, request(f"f{run}-{i}", long, 32, "document")))
            async with FleetState(workers.redis_url) as state:
                queue = WaitQueue(state.redis, state.ns)
                for i, ending in enumerate(endings):
                    waiter = asyncio.ensure_future(
                        admit(router, request(f"w{run}-{i}", long, 32, "document")))
                    await until(lambda: _waiting(queue, "document", 1))
                    if ending == "served":
                        await cancel(workers, plans.pop(0))
                        plans.append(await waiter)
                    elif ending == "caller_gone":
                        waiter.cancel()
                    else:
                        await close()
                        closed = True
                        await asyncio.gather(waiter, return_exceptions=True)
                    await until(lambda: _waiting(queue, "document", 0))
                    if closed:
                        break
        finally:
            for p in plans:
                await cancel(workers, p)
            if not closed:
                await close()
    asyncio.run(story())
    assert wait_until(lambda: held(workers.stats("decode-0")) == 0, 10)


def test_a_refusals_retry_after_follows_the_fleets_drain_rate(workers, normal_stage):  # noqa: F811
    """At S4 a refusal prices its Retry-After as the blocks the request needs over the decode
    blocks the fleet freed per second (the workers' capacity notifications through Redis, over
    the router's 10-s window, on a clock the test holds): nothing freed yet, the floor; 1x its
    blocks freed, 10 s; 5x, 2 s; once the window has passed, the floor again."""
    stats = workers.stats("decode-0")
    blocks = kv_blocks_needed(stats, len(PROMPT), pb.SamplingParams(max_tokens=8))
    now = [0.0]

    async def story():
        await set_stage(workers.redis_url, S4)
        state = FleetState(workers.redis_url)
        servicer = RouterServicer(state, "disagg", "r-drain", auth=workers.auth, policy=POLICY)
        servicer.wakeups.drain = DrainRate(window_s=10.0, clock=lambda: now[0])
        server = grpc.aio.server()
        pb_grpc.add_RouterServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = internal_channel(f"127.0.0.1:{port}", workers.auth)
        router = pb_grpc.RouterStub(channel)
        ids = itertools.count()

        async def retry_after() -> float:
            st = await refusal(router, request(f"drain-{next(ids)}", PROMPT, 8, "interactive"))
            assert st.stage == pb.S4_REJECT
            return st.retry_after_s

        async def freed(n: int) -> None:
            before = servicer.wakeups.drain.blocks_per_s()
            async with FleetState(workers.redis_url) as notifier:
                await WaitQueue(notifier.redis, notifier.ns).notify(n)

            async def counted() -> bool:
                return servicer.wakeups.drain.blocks_per_s() > before
            await until(counted)
        try:
            assert await retry_after() == pytest.approx(RETRY_MIN_S)     # nothing freed yet
            await asyncio.wait_for(servicer.wakeups.subscribed.wait(), 30)
            await freed(blocks)                      # blocks / 10 s: the request's in 10 s
            assert await retry_after() == pytest.approx(10.0)
            await freed(4 * blocks)                  # five times as fast: 2 s
            assert await retry_after() == pytest.approx(2.0)
            now[0] += 10.5                           # the window forgets both
            assert await retry_after() == pytest.approx(RETRY_MIN_S)
        finally:
            await channel.close()
            await server.stop(0)
            await servicer.close()
            await state.close()
    asyncio.run(story())
