"""A cold fleet's first burst is admitted only as far as the prior allows: a worker that has
measured nothing is predicted at the prior's prefill rate, the prompts a router placed since the
worker's beat count as its queue, and once the queue term breaks the class target the rest wait
and are refused with the reason, never admitted blind.

A co-located router (no worker call on its path) over a real Redis holding one mixed worker's
published stats; the router behind a real gRPC server."""
from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

from services.protocol import status
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.router.admission import AdmissionConfig
from services.router.placements import PlacedPrompt, with_placed_prompts
from services.router.predict import PATH_S, Prior, predict
from services.router.service import RouterServicer
from services.state.fleet_state import FleetState

PROMPT = list(range(480))               # 0.24 s at the prior's 2000 tokens/s
COLD = pb.WorkerStats(worker_id="mixed-0", role="mixed", kv_blocks_total=10_000,
                      kv_blocks_free=10_000, block_size=16, max_model_len=4096,
                      grpc_address="127.0.0.1:1", model="tiny", kv_backend="local")


@contextlib.asynccontextmanager
async def router_beside(redis_url: str, redis_ns: str, stats: pb.WorkerStats, **policy):
    """A co-located router behind a real gRPC server, over a Redis holding `stats` as the one
    worker's beat (stamped now); yields (the servicer, a stub to it)."""
    state = FleetState(redis_url, redis_ns)
    beat = pb.WorkerStats()
    beat.CopyFrom(stats)
    beat.updated_at_unix_s = time.time()
    await state.heartbeat(beat, 60.0)
    servicer = RouterServicer(state, "colocated", "r0", **policy)
    server = grpc.aio.server()
    pb_grpc.add_RouterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield servicer, pb_grpc.RouterStub(ch)
    finally:
        await server.stop(0)
        await servicer.close()
        await state.close()


def test_a_cold_fleets_first_burst_is_admitted_only_as_far_as_the_prior_allows(redis_url,
                                                                               redis_ns):
    async def story():
        prior = AdmissionConfig(prior=Prior(prefill_tokens_per_s=2000.0))
        async with router_beside(redis_url, redis_ns, COLD, policy=prior) as (servicer, router):
            plans = []
            for i in range(4):        # 0.24 s more each (+ the hops): within the 1-s target
                r = pb.WorkRequest(request_id=f"b{i}", traffic_class="interactive",
                                   prompt_token_ids=PROMPT, params=pb.SamplingParams(max_tokens=8))
                plans.append(await router.Admit(r, timeout=30))
            assert [round(p.predicted_ttft_s, 2) for p in plans] == [
                round(PATH_S + 0.24 * k, 2) for k in (1, 2, 3, 4)]
            r = pb.WorkRequest(request_id="b4", traffic_class="interactive",
                               prompt_token_ids=PROMPT, params=pb.SamplingParams(max_tokens=8))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await router.Admit(r, timeout=30)
            st = status.of(e.value)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            expected = f"queue: predicted TTFT {PATH_S + 1.2:.3g} s vs target 1 s"
            assert st.message.startswith(expected)
            assert "in the queue" in st.message                  # it waited before refusing
            depth = await servicer.queue.depth("interactive", time.time())
            assert depth.waiting == 0                             # and left the queue
    asyncio.run(story())


WARM = pb.WorkerStats(worker_id="mixed-0", role="mixed", kv_blocks_total=10_000,
                      kv_blocks_free=10_000, block_size=16, max_model_len=4096,
                      grpc_address="127.0.0.1:1", model="tiny", kv_backend="local",
                      token_budget=512, chunk_size=256, prefill_s_per_token=5e-4,
                      prefill_drain_tokens_per_s=2000.0,
                      # an idle worker that publishes its queue by class: nothing ahead of any
                      queued_prefill_tokens_ahead={"interactive": 0, "document": 0, "batch": 0},
                      prefill_step_tokens_ahead={"interactive": 0, "document": 0, "batch": 0})


def test_a_burst_within_one_beat_sees_its_own_backlog_ahead_of_its_class(redis_url, redis_ns):
    """A warm worker's beat says no prompt of any class is queued. Twelve chats arrive at once,
    within one beat: each is counted as queued there the moment it is predicted (before the
    router's awaits, where the others' admissions run), and each next chat's prediction counts
    those ahead of it in its class (the worker's own per-class count, a beat late), so the
    predictions grow and the burst is refused once they break the 1-s target. With the beat's
    empty class queue alone every chat was predicted alike, and the fleet admitted a burst whose
    chats waited 2-4x their predictions."""
    async def story():
        async with router_beside(redis_url, redis_ns, WARM) as (_, router):
            answers = await asyncio.gather(*(router.Admit(pb.WorkRequest(
                request_id=f"c{i}", traffic_class="interactive", prompt_token_ids=PROMPT,
                params=pb.SamplingParams(max_tokens=8)), timeout=30) for i in range(12)),
                return_exceptions=True)
        predicted = sorted(a.predicted_ttft_s for a in answers if isinstance(a, pb.Plan))
        refused = [a for a in answers if isinstance(a, grpc.aio.AioRpcError)]
        assert predicted[-1] > 2 * predicted[0]
        assert refused and all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                               and "vs target 1 s" in status.of(e).message for e in refused)
    asyncio.run(story())


def test_documents_of_one_burst_are_each_predicted_behind_the_ones_placed_before_it(redis_url,
                                                                                    redis_ns):
    """A warm worker at rest; four documents arrive at once, within one beat. Each is queued
    where the engine puts it the moment it is predicted (at the back of its tenant's document
    queue), so each next one is predicted with the documents placed before it sharing its
    steps: the four predictions are the worker's beat stepped forward with 0, 1, 2 and 3 of
    them queued. (Queued only in the totals, the stepping gave up and all four were priced
    alike: docs/benchmarks.md, a9doc.)"""
    doc = list(range(1000))
    async def story():
        async with router_beside(redis_url, redis_ns, WARM) as (servicer, router):
            plans = await asyncio.gather(*(router.Admit(pb.WorkRequest(
                request_id=f"d{i}", traffic_class="document", prompt_token_ids=doc,
                params=pb.SamplingParams(max_tokens=8)), timeout=30) for i in range(4)))
            return plans, servicer.policy
    plans, policy = asyncio.run(story())
    tenant = policy.tenant("").name
    before = [PlacedPrompt("document", tenant, len(doc))]
    expected = [predict(with_placed_prompts(WARM, before * k, policy.classes), len(doc),
                        traffic_class="document", tenant=tenant, classes=policy.classes).total_s
                for k in range(4)]
    assert all(a < b for a, b in zip(expected, expected[1:]))
    assert sorted(p.predicted_ttft_s for p in plans) == pytest.approx(expected)
