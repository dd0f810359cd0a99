"""The load test's summary says in which overload stage requests were refused and how long they
waited in the router's wait queue, from what the fleet told the client: a real fleet (`kvfleet
up`, simulated engine cores: gateway, router, prefill and decode workers, a real redis-server)
under the load generator.

The stage is written into the fleet's record by the test, dated ahead so that the routers' stage
keepers hold it (their dwell runs from the record's `since`) while the real signals are calm:

  1. at S1 the batch tenant's requests wait in the router's queue; once the stage is lifted they
     are admitted, and each says how long it waited (`timing.wait_queue_s`), so the summary has
     the batch class's queue time while the chats, admitted at once, waited 0;
  2. at S4 every request is refused early, naming the stage (`x-kvfleet-stage`), so the summary
     counts the refusals under S4_REJECT and its timeline shows stage 4."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from loadtests.arrivals import ArrivalProcess
from loadtests.local_fleet import FleetSetup, local_fleet
from loadtests.metrics import summarize
from loadtests.runner import RunConfig, run_workload
from loadtests.workload import TenantSpec, parse_workload
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.state.fleet_state import FleetState
from services.state.stage_record import StageStore
from services.state.wait_queue import WaitQueue
from tests.waiting import wait_until

CHAT = TenantSpec("acme", "interactive", 1.0, ArrivalProcess("poisson", {"rate_rps": 4}))
NIGHTLY = TenantSpec("nightly", "batch", 1.0, ArrivalProcess("poisson", {"rate_rps": 4}))


@pytest.fixture(scope="module")
def fleet(redis_url, tiny_model_dir):
    with local_fleet([CHAT, NIGHTLY], FleetSetup(mode="disagg", model=str(tiny_model_dir),
                                                 engine="sim"), redis_url=redis_url) as f:
        yield f, redis_url
    asyncio.run(clear_stage(redis_url))


def workload(tenants: dict, requests: int):
    return parse_workload({
        "name": "stages", "duration_s": 2.0, "max_requests": requests,
        "classes": {"interactive": {"slo": {"ttft_s": 5.0}, "prompt_tokens": 40,
                                    "output_tokens": 4},
                    "batch": {"slo": {"ttft_s": 60.0}, "prompt_tokens": 40, "output_tokens": 4}},
        "tenants": tenants})


async def hold_stage(redis_url: str, stage: int) -> None:
    async with FleetState(redis_url) as state:
        store = StageStore(state.redis, state.ns)
        await store.change(await store.read(), stage, time.time() + 3600, "set by the test",
                           "test")


async def clear_stage(redis_url: str) -> None:
    async with FleetState(redis_url) as state:
        await state.redis.delete(f"{state.ns}stage")


async def batch_waiting(redis_url: str) -> int:
    async with FleetState(redis_url) as state:
        return await WaitQueue(state.redis, state.ns).waiting("batch")


def answers_in(fleet, stage: int) -> bool:
    """A chat is answered (or refused) in `stage` (the routers read the record every 0.5 s)."""
    auth = {"Authorization": f"Bearer {fleet.tenant_keys['acme']}"}
    model = httpx.get(f"{fleet.endpoint}/v1/models", headers=auth, timeout=30).json()["data"][0]
    r = httpx.post(f"{fleet.endpoint}/v1/completions", timeout=30, headers=auth,
                   json={"model": model["id"], "prompt": "probe", "max_tokens": 1})
    return r.headers.get("x-kvfleet-stage") == pb.OverloadStage.Name(stage)


def run_in_thread(spec, fleet) -> tuple[threading.Thread, list]:
    out: list = []
    cfg = RunConfig(fleet.endpoint, tenant_keys=fleet.tenant_keys)
    thread = threading.Thread(target=lambda: out.append(asyncio.run(run_workload(spec, cfg))))
    thread.start()
    return thread, out


def test_batch_held_at_s1_reports_its_time_in_the_queue(fleet):
    fleet, redis_url = fleet
    asyncio.run(hold_stage(redis_url, pb.S1_NO_BATCH))
    assert wait_until(lambda: answers_in(fleet, pb.S1_NO_BATCH), 30)
    spec = workload({"nightly": {"class": "batch",
                                 "arrival": {"process": "poisson", "rate_rps": 4}}}, 3)
    thread, out = run_in_thread(spec, fleet)
    try:
        assert wait_until(lambda: asyncio.run(batch_waiting(redis_url)) >= 1, 30)
    finally:
        asyncio.run(clear_stage(redis_url))
        thread.join(120)
    assert not thread.is_alive()
    run = out[0]
    summary = summarize(run)
    assert summary["overall"]["ok"] == 3, [r.detail for r in run.records]
    waited = summary["queue_time_s_by_class"]["batch"]
    assert waited["requests"] == 3 and waited["queued"] >= 1 and waited["p99"] > 0
    assert all(r.stage in ("S0_NORMAL", "S1_NO_BATCH") for r in run.records)
    assert summary["rejections_by_stage"] == {}

    chats = workload({"acme": {"class": "interactive",
                               "arrival": {"process": "poisson", "rate_rps": 4}}}, 3)
    calm = summarize(asyncio.run(run_workload(chats, RunConfig(
        fleet.endpoint, tenant_keys=fleet.tenant_keys))))
    assert calm["queue_time_s_by_class"]["interactive"] == {
        "requests": 3, "queued": 0, "p50": 0.0, "p95": 0.0, "p99": 0.0, "mean": 0.0}


def test_refusals_at_s4_are_counted_by_their_stage(fleet):
    fleet, redis_url = fleet
    asyncio.run(hold_stage(redis_url, pb.S4_REJECT))
    try:
        assert wait_until(lambda: answers_in(fleet, pb.S4_REJECT), 30)
        spec = workload({"acme": {"class": "interactive",
                                  "arrival": {"process": "poisson", "rate_rps": 4}}}, 4)
        run = asyncio.run(run_workload(spec, RunConfig(fleet.endpoint,
                                                       tenant_keys=fleet.tenant_keys)))
    finally:
        asyncio.run(clear_stage(redis_url))
    summary = summarize(run)
    assert summary["overall"]["rejected"] == 4
    assert summary["rejections_by_stage"] == {"S4_REJECT": 4}
    assert {row["stage"] for row in summary["timeline"] if row["sent"]} == {4}
    assert all(r.retry_after_s and r.retry_after_s >= 1 for r in run.records)
