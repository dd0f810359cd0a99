"""What the router tells an operator: its /metrics count every decision (admitted or rejected, by
reason, stage and class), the time it took, its TTFT prediction, live workers and placements; a
plan carries the predicted TTFT and the stage; the router process registers itself in Redis with
a metrics URL that answers, and its spans continue the caller's trace (`router.admit`, with one
`router.reserve` per Reserve under it).

Real decode worker process and a real redis-server. The prefill side is a hand-written WorkerStats
record (named `prefill-synthetic`): the router only ranks prefill workers, it never calls one, so
a record with a chosen backlog and rate is all the prediction needs.
"""
from __future__ import annotations

import asyncio
import os

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.cli.launcher import Launcher
from tests.waiting import wait_until
from services.protocol import status
from services.protocol.aio import internal_channel
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.router.predict import PATH_S, predict
from services.router.service import RouterServicer
from services.state.fleet_state import FleetState
from services.state.records import RecordSeal
from services.telemetry import exposition
from services.telemetry.receiver import OtlpReceiver
from tests.harness import route_request, running_fleet

PROMPT = list(range(100, 166))          # 66 tokens
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@pytest.fixture(scope="module")
def decode_only(redis_url, tiny_model_dir):
    """One real decode worker with a small KV pool (a prompt can be too big for all of it)."""
    # the production TTFT targets: the refusals and predictions are the claim
    with running_fleet(redis_url, str(tiny_model_dir), "disagg", prefill=0, decode=1, routers=0,
                       worker_args=("--kv-cache-mib", "4"), targets="production") as fleet:
        assert wait_until(lambda: fleet.stats("decode-0").kv_blocks_total > 0, 30)
        yield fleet


def synthetic_prefill(rate: float, queued: int = 500) -> pb.WorkerStats:
    return pb.WorkerStats(worker_id="prefill-synthetic", role="prefill", kv_backend="tcp",
                          grpc_address="127.0.0.1:1", block_size=16, kv_blocks_total=100,
                          kv_blocks_free=100, queued_prefill_tokens=queued,
                          prefill_tokens_per_s=rate, model="tiny")


def samples(url: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a /metrics page: (name, labels) -> value."""
    text = httpx.get(url, timeout=5).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(page: dict, name: str, **labels) -> float | None:
    return page.get((name, frozenset(labels.items())))


async def with_router(fleet, story, prefill_rate: float):
    """`story(stub, metrics_url)` against an in-process router over the fleet's Redis, with the
    synthetic prefill record registered at `prefill_rate` tokens/s."""
    state = FleetState(fleet.redis_url)
    await state.heartbeat(synthetic_prefill(prefill_rate), ttl_s=60)
    servicer = RouterServicer(state, "disagg", "r-tel", auth=fleet.auth)
    metrics = exposition.serve(servicer.metrics.registry, 0)
    server = grpc.aio.server()
    pb_grpc.add_RouterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = internal_channel(f"127.0.0.1:{port}", fleet.auth)
    try:
        return await story(pb_grpc.RouterStub(channel), metrics.url)
    finally:
        await channel.close()
        await server.stop(0)
        await servicer.close()
        await state.remove_worker("prefill-synthetic")
        await state.close()
        metrics.close()


async def cancel(fleet, plan: pb.Plan) -> None:
    async with internal_channel(plan.decode.address, fleet.auth) as ch:
        await pb_grpc.WorkerStub(ch).Cancel(pb.CancelRequest(request_id=plan.request_id), timeout=5)


def ask(request_id: str, prompt: list[int]) -> pb.WorkRequest:
    request = route_request(request_id, prompt, 8)
    request.tenant, request.traffic_class = "default", "interactive"
    return request


def too_big_for_the_pool(fleet) -> list[int]:
    stats = fleet.stats("decode-0")
    return list(range(stats.kv_blocks_total * stats.block_size + 32))


def test_the_prediction_is_the_backlog_and_the_prompt_at_the_measured_rate():
    assert predict(synthetic_prefill(rate=1000.0, queued=500), 66).total_s == pytest.approx(0.566 + PATH_S)
    assert predict(synthetic_prefill(rate=0.0, queued=500), 66).total_s > 0   # the prior: not 0


def test_metrics_count_an_admission_and_a_refusal_by_decision_reason_and_stage(decode_only):
    too_big = too_big_for_the_pool(decode_only)

    async def story(router, metrics_url):
        plan = await router.Admit(ask("tel-1", PROMPT), timeout=10)
        await cancel(decode_only, plan)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await router.Admit(ask("tel-2", too_big), timeout=10)
        return plan, status.of(refused.value), samples(metrics_url)
    plan, refusal, page = asyncio.run(with_router(decode_only, story, prefill_rate=1000.0))

    # the plan says what the router predicted, and in which stage it decided
    assert plan.prefill[0].worker_id == "prefill-synthetic" and plan.decode.worker_id == "decode-0"
    assert plan.predicted_ttft_s == pytest.approx((500 + len(PROMPT)) / 1000.0 + PATH_S)
    assert plan.stage == pb.S0_NORMAL
    # so does the refusal: nobody can hold that prompt's KV
    assert refusal.reason != pb.REASON_UNSPECIFIED and refusal.stage == pb.S0_NORMAL
    reason = pb.Reason.Name(refusal.reason)

    # one admission and one rejection, by decision, reason and stage
    assert value(page, "kvfleet_admissions_total", decision="admitted", reason="OK",
                 stage="S0_NORMAL", traffic_class="interactive") == 1
    assert value(page, "kvfleet_admissions_total", decision="rejected", reason=reason,
                 stage="S0_NORMAL", traffic_class="interactive") == 1
    assert value(page, "kvfleet_admission_seconds_count", traffic_class="interactive") == 2
    assert value(page, "kvfleet_predicted_ttft_seconds_count", traffic_class="interactive") == 1
    assert value(page, "kvfleet_predicted_ttft_seconds_sum", traffic_class="interactive") == \
        pytest.approx(plan.predicted_ttft_s)
    assert value(page, "kvfleet_overload_stage") == 0
    assert value(page, "kvfleet_router_live_workers", role="decode") == 1
    assert value(page, "kvfleet_router_live_workers", role="prefill") == 1
    assert value(page, "kvfleet_placements_total", role="decode", worker="decode-0") == 1
    assert value(page, "kvfleet_placements_total", role="prefill", worker="prefill-synthetic") == 1


def test_a_worker_with_no_measured_rate_is_predicted_from_a_prior_not_as_0(decode_only):
    async def story(router, metrics_url):
        plan = await router.Admit(ask("tel-3", PROMPT), timeout=10)
        await cancel(decode_only, plan)
        return plan, samples(metrics_url)
    plan, page = asyncio.run(with_router(decode_only, story, prefill_rate=0.0))
    assert plan.predicted_ttft_s > 0 and plan.predicted_wait_s > 0   # 500 tokens queued
    # the KV transfer (a term of the plan) is not one of its TTFT: the first token leaves first
    assert plan.predicted_ttft_s == pytest.approx(
        PATH_S + plan.predicted_wait_s + plan.predicted_prefill_s + plan.predicted_decode_wait_s)
    assert value(page, "kvfleet_predicted_ttft_seconds_count", traffic_class="interactive") == 1
    assert value(page, "kvfleet_admissions_total", decision="admitted", reason="OK",
                 stage="S0_NORMAL", traffic_class="interactive") == 1


def test_the_router_process_registers_serves_metrics_and_continues_the_callers_trace(decode_only):
    fleet = decode_only
    with OtlpReceiver() as rx:
        launcher = Launcher(env={**fleet.launcher.env, **OtlpReceiver.env(rx.endpoint)})
        try:
            address = launcher.start("router-tel", ["services.router", "--redis-url",
                                                    fleet.redis_url, "--router-id", "router-tel"])
            # the synthetic worker it registers must be signed with the fleet's key to be read
            state = FleetState(fleet.redis_url, seal=RecordSeal.from_token(fleet.auth.token))
            try:
                asyncio.run(_registered_then_traced(fleet, state, address, rx))
            finally:
                launcher.stop_all()
            # stopped: its record is gone at once, not only when its TTL runs out
            assert asyncio.run(_services(fleet.redis_url)) == []
        finally:
            launcher.stop_all()


async def _services(redis_url: str) -> list[pb.ServiceRecord]:
    async with FleetState(redis_url) as state:
        return await state.live_services()


async def registered(state: FleetState, service_id: str, timeout_s: float = 10.0):
    """The live records once `service_id`'s first heartbeat landed (it beats right after READY)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        found = await state.live_services()
        if any(s.service_id == service_id for s in found):
            return found
        assert loop.time() < deadline, f"{service_id} never registered: {found}"
        await asyncio.sleep(0.05)


async def _registered_then_traced(fleet, state: FleetState, address: str, rx: OtlpReceiver):
    try:
        (record,) = await registered(state, "router-tel")
        assert (record.service_id, record.role, record.address) == ("router-tel", "router", address)
        assert record.pid > 0 and record.pid != os.getpid()
        assert "kvfleet_overload_stage 0.0" in httpx.get(record.metrics_url, timeout=5).text
        # idle (no Admit yet), the router still follows the fleet: its decode worker is counted
        live = lambda: value(samples(record.metrics_url), "kvfleet_router_live_workers",  # noqa: E731
                             role="decode")
        assert await asyncio.to_thread(wait_until, lambda: live() == 1.0, 10), live()

        await state.heartbeat(synthetic_prefill(1000.0), ttl_s=60)
        async with internal_channel(address, fleet.auth) as ch:
            plan = await pb_grpc.RouterStub(ch).Admit(
                ask("traced-1", PROMPT), timeout=10,
                metadata=(("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"),))
        await cancel(fleet, plan)
    finally:
        await state.remove_worker("prefill-synthetic")
        await state.close()

    def both(spans):
        return {"router.admit", "router.reserve"} <= {s.name for s in spans}
    spans = await asyncio.to_thread(rx.wait_for, both, 20)
    admit = next(s for s in spans if s.name == "router.admit")
    reserve = next(s for s in spans if s.name == "router.reserve")
    assert (admit.trace_id, admit.parent_span_id) == (CLIENT_TRACE, CLIENT_SPAN)
    assert (reserve.trace_id, reserve.parent_span_id) == (CLIENT_TRACE, admit.span_id)
    assert admit.service == "kvfleet-router" and admit.instance == "router-tel"
    assert admit.attributes["kvfleet.admission.decision"] == "admitted"
    assert admit.attributes["kvfleet.reason"] == "OK"
    assert admit.attributes["kvfleet.overload_stage"] == "S0_NORMAL"
    assert admit.attributes["kvfleet.predicted_ttft_s"] == pytest.approx(plan.predicted_ttft_s)
    assert admit.attributes["kvfleet.replica"] == "router-tel"
    assert admit.attributes["kvfleet.request_id"] == "traced-1"
    assert reserve.attributes["kvfleet.worker_id"] == "decode-0"
