"""The router's decision, read directly: Admit answers with a plan (prefill worker and a fallback,
decode worker, the reservation's KV target and deadline) and keeps nothing of the request; two
routers over one Redis decide alike; a full fleet is refused with OVERLOADED and a retry hint, a
fleet missing a role with UNAVAILABLE.

Real worker processes and a real redis-server; the routers under test run in this process
(RouterServicer, called through a real gRPC server on 127.0.0.1).
"""
from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from tests.waiting import eventually, wait_until
from services.protocol import status
from services.protocol.aio import internal_channel
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.engine.config import BATCH, DOCUMENT, INTERACTIVE
from services.router.admission import AdmissionConfig
from services.router.service import RouterServicer
from services.state.fleet_state import FleetState
from tests.harness import route_request, running_fleet

PROMPT = list(range(100, 166))          # 66 tokens: 5 blocks of 16


@pytest.fixture(scope="module")
def workers(redis_url, tiny_model_dir):
    """One prefill and one decode worker process (no router process: the tests bring theirs)."""
    # the production TTFT targets: what these tests admit or refuse is the claim
    with running_fleet(redis_url, str(tiny_model_dir), "disagg", routers=0,
                       targets="production") as fleet:
        assert wait_until(lambda: len(fleet.workers) == 2 and all(
            fleet.stats(n).kv_blocks_total for n in fleet.workers), 30)
        yield fleet


def held(stats: pb.WorkerStats) -> int:
    """Blocks a worker holds for requests (a decode reservation allocates its blocks)."""
    return stats.kv_blocks_used + stats.kv_blocks_reserved


async def serve_routers(fleet, n: int, mode: str = "disagg", policy=None, timeouts=None):
    """n routers over the fleet's Redis, each behind its own gRPC server; -> (stubs, closer)."""
    servers, states, channels, stubs, servicers = [], [], [], [], []
    for i in range(n):
        state = FleetState(fleet.redis_url)
        server = grpc.aio.server()
        servicers.append(RouterServicer(state, mode, f"r{i}", auth=fleet.auth, policy=policy,
                                        timeouts=timeouts))
        pb_grpc.add_RouterServicer_to_server(servicers[-1], server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = internal_channel(f"127.0.0.1:{port}", fleet.auth)
        servers.append(server), states.append(state), channels.append(channel)
        stubs.append(pb_grpc.RouterStub(channel))

    async def close():
        for c in channels:
            await c.close()
        for s in servers:
            await s.stop(0)
        for r in servicers:
            await r.close()
        for s in states:
            await s.close()
    return stubs, close


async def cancel(fleet, plan: pb.Plan) -> None:
    async with internal_channel(plan.decode.address, fleet.auth) as ch:
        assert (await pb_grpc.WorkerStub(ch).Cancel(
            pb.CancelRequest(request_id=plan.request_id), timeout=5)).cancelled


def test_a_plan_names_both_workers_and_holds_a_reservation_on_the_decode_worker(workers):
    async def story():
        (router,), close = await serve_routers(workers, 1)
        try:
            plan = await router.Admit(route_request("p1", PROMPT, 8), timeout=10)
            assert plan.mode == pb.Plan.DISAGGREGATED and plan.router_id == "r0"
            assert [w.worker_id for w in plan.prefill] == ["prefill-0"]
            assert plan.prefill[0].address == workers.workers["prefill-0"]
            assert plan.decode.worker_id == "decode-0"
            assert plan.target.worker_id == "decode-0" and len(plan.target.block_ids) == 5
            assert plan.deadline_unix_s > 0
            # the reservation lives on the decode worker, not in the router
            assert held(workers.stats("decode-0")) == 5
            await cancel(workers, plan)
        finally:
            await close()
    asyncio.run(story())
    assert wait_until(lambda: held(workers.stats("decode-0")) == 0, 5)


def test_an_admit_whose_caller_goes_after_its_reservation_leaves_nothing_held(workers):
    """The caller goes (cancelled, or past its deadline) after the decode worker reserved for its
    request but before the plan reached it: nobody will use or cancel that reservation, so the
    router ends it then, rather than leave its blocks and its tenant's KV share held until its
    deadline (30 s and more on). Here the router is held once its plan is made (its queue left,
its tenant charged: the awaits where a caller's cancel lands after the Reserve)."""
    async def story():
        state = FleetState(workers.redis_url)
        router = RouterServicer(state, "disagg", "r-gone", auth=workers.auth)
        reserved, never = asyncio.Event(), asyncio.Event()
        decide = router._admit

        async def decide_then_hold(*args):
            plan = await decide(*args)
            reserved.set()
            await never.wait()               # the plan is on its way when the caller goes
            return plan
        router._admit = decide_then_hold
        server = grpc.aio.server()
        pb_grpc.add_RouterServicer_to_server(router, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with internal_channel(f"127.0.0.1:{port}", workers.auth) as channel:
                call = pb_grpc.RouterStub(channel).Admit(route_request("gone-1", PROMPT, 8),
                                                         timeout=30)
                await asyncio.wait_for(reserved.wait(), 30)
                assert held(workers.stats("decode-0")) == 5          # reserved for it
                call.cancel()                                         # the caller goes
                with pytest.raises(asyncio.CancelledError):
                    await call

            async def nothing_held() -> bool:
                return held(await asyncio.to_thread(workers.stats, "decode-0")) == 0
            # ended by the router, long before the reservation's own deadline would free it
            assert await eventually(nothing_held, 10)
        finally:
            await server.stop(0)
            await router.close()
            await state.close()
    asyncio.run(story())


def test_two_routers_over_one_redis_place_alike(workers):
    async def story():
        routers, close = await serve_routers(workers, 2)
        try:
            plans = [await r.Admit(route_request(f"twin-{i}", PROMPT, 8), timeout=10)
                     for i, r in enumerate(routers)]
            assert {p.router_id for p in plans} == {"r0", "r1"}
            assert {(p.prefill[0].worker_id, p.decode.worker_id) for p in plans} == {
                ("prefill-0", "decode-0")}
            for p in plans:
                await cancel(workers, p)
        finally:
            await close()
    asyncio.run(story())


def test_a_full_decode_pool_is_refused_overloaded_with_a_retry_hint(workers):
    stats = workers.stats("decode-0")
    long = list(range(100, 100 + min(stats.max_model_len - 64, 2000)))
    most = stats.kv_blocks_total // (len(long) // stats.block_size) + 2

    # the router judges document by a target no prefill backlog here can break (the workers
    # keep theirs): only the decode pool refuses it
    roomy = dataclasses.replace(DOCUMENT, ttft_target_s=60.0)
    policy = AdmissionConfig(classes=(INTERACTIVE, roomy, BATCH),
                             headroom_kv_fraction=0.0, headroom_slot_fraction=0.0)

    async def story():
        (router,), close = await serve_routers(workers, 1, policy=policy)
        plans = []
        try:
            for i in range(most):                  # reserve until the decode pool is full
                r = route_request(f"fill-{i}", long, 32)
                r.traffic_class = "document"
                try:
                    plans.append(await router.Admit(r, timeout=10))
                except grpc.aio.AioRpcError as e:
                    return plans, e
            return plans, None
        finally:
            for p in plans:
                await cancel(workers, p)
            await close()
    plans, error = asyncio.run(story())
    assert plans and error is not None, f"{len(plans)} reservations and no refusal"
    st = status.of(error)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and st.reason == pb.OVERLOADED
    # it waited as long as the call allowed (10 s less admit_s), then said why: the decode slot it
    # waited for (predicted from the worker's free blocks and drain rate), or the worker's refusal
    assert st.retry_after_s > 0 and ("decode slot" in st.message or (
        "decode-0" in st.message and "blocks available" in st.message)), st.message
    assert "vs target 60 s" in st.message and "in the queue" in st.message
    assert wait_until(lambda: held(workers.stats("decode-0")) == 0, 5)


def test_a_fleet_without_a_mixed_worker_is_unavailable_to_a_colocated_router(workers):
    async def story():
        (router,), close = await serve_routers(workers, 1, mode="colocated")
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await router.Admit(route_request("nomixed", PROMPT, 4), timeout=10)
            return info.value
        finally:
            await close()
    error = asyncio.run(story())
    st = status.of(error)
    assert error.code() == grpc.StatusCode.UNAVAILABLE and st.reason == pb.UNAVAILABLE
    assert "no healthy mixed worker" in st.message and st.retry_after_s >= 1
