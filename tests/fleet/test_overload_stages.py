"""The fleet's overload stage as a client sees it, over real processes (workers, a router, the
gateway, Redis): at S2 an interactive response is capped to the stage's output cap and says so
(headers and the body's `admission` field); at S4 a request is refused early with 429, the stage
and a Retry-After, while /health still answers; every response names its stage.

The stage is written into the fleet's record by the test, dated ahead so that the routers' stage
keepers hold it (their dwell runs from the record's `since`) while the real signals are calm."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.state.fleet_state import FleetState
from services.state.stage_record import StageStore
from tests.harness import running_fleet, start_gateway

S2_CAP = 256            # AdmissionConfig.s2_output_cap, the router's default


@pytest.fixture(scope="module")
def setup(redis_url, tiny_model_dir):
    # the production TTFT targets: the stages' caps and refusals are the claim
    with running_fleet(redis_url, str(tiny_model_dir), "disagg", targets="production") as fleet:
        yield fleet, start_gateway(fleet, str(tiny_model_dir))


def hold_stage(fleet, stage: int) -> None:
    async def write():
        async with FleetState(fleet.redis_url) as state:
            store = StageStore(state.redis, state.ns)
            await store.change(await store.read(), stage, time.time() + 3600, "set by the test",
                               "test")
    asyncio.run(write())


def reads_stage(fleet, stage: int, gw) -> bool:
    """A request is answered in `stage` (the routers read the record every 0.5 s)."""
    with httpx.Client(base_url=f"http://{gw.http}", timeout=30) as client:
        r = client.post("/v1/completions", json={"model": gw.model, "prompt": "probe",
                                                 "max_tokens": 1})
        return r.headers.get("x-kvfleet-stage") == pb.OverloadStage.Name(stage)


def wait_for(predicate, timeout_s: float = 30.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_stages_as_a_client_sees_them(setup):
    fleet, gw = setup
    with httpx.Client(base_url=f"http://{gw.http}", timeout=60) as client:
        r = client.post("/v1/completions", json={"model": gw.model, "prompt": "hello",
                                                 "max_tokens": 4})
        assert r.status_code == 200 and r.headers["x-kvfleet-stage"] == "S0_NORMAL"
        assert r.json()["admission"] == {"stage": "S0_NORMAL"}

        hold_stage(fleet, pb.S2_CAP_OUTPUT)
        assert wait_for(lambda: reads_stage(fleet, pb.S2_CAP_OUTPUT, gw))
        r = client.post("/v1/completions", json={"model": gw.model, "prompt": "hello",
                                                 "max_tokens": 400, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.headers["x-kvfleet-stage"] == "S2_CAP_OUTPUT"
        assert r.headers["x-kvfleet-output-cap"] == str(S2_CAP)
        body = r.json()
        assert body["admission"] == {"stage": "S2_CAP_OUTPUT", "output_cap": S2_CAP}
        assert body["usage"]["completion_tokens"] == S2_CAP
        assert body["choices"][0]["finish_reason"] == "length"

        hold_stage(fleet, pb.S4_REJECT)
        seen = []

        def refused() -> bool:
            probe = client.post("/v1/completions", json={"model": gw.model, "prompt": "x",
                                                          "max_tokens": 1})
            seen.append((probe.status_code, probe.headers.get("x-kvfleet-stage"), probe.text[:200]))
            return probe.status_code == 429
        assert wait_for(refused), seen[-3:]
        r = client.post("/v1/completions", json={"model": gw.model, "prompt": "hi",
                                                 "max_tokens": 4})
        assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded"
        assert r.headers["x-kvfleet-stage"] == "S4_REJECT" and int(r.headers["Retry-After"]) >= 1
        assert "S4" in r.json()["error"]["message"]
        assert client.get("/health").status_code == 200

    async def clear():
        async with FleetState(fleet.redis_url) as state:
            await state.redis.delete(f"{state.ns}stage")
    asyncio.run(clear())
