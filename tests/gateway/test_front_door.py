"""The gateway's front door (services/gateway/door.py): a gateway started with --max-in-progress 4
in front of a fleet on the simulated engine (slow steps, so a stream is held for as long as the
story needs it), with keys for four tenants. A tenant past its fair share is refused at once with
429 and a Retry-After, a tenant under it still gets in, a full gateway answers 503, /health
answers throughout, and the seats come back however a request ends."""
from __future__ import annotations

import contextlib

import grpc
import httpx
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.gateway.door import Door, fair_level
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.gateway.errors import GatewayError
from tests.gateway.gateway_helpers import key, metric, openai_error, scrape
from tests.harness import TEST_TTFT_TARGET_S, running_fleet, sim_args, start_gateway
from tests.waiting import wait_until

LIMIT = 4
TENANTS = ("flood", "quiet", "third", "fourth", "metered")
_CLASS = dict(name="interactive", priority=2, max_prompt_tokens=2048,
              ttft_target_s=TEST_TTFT_TARGET_S, itl_target_s=1.0, output_cap=4096,
              predicted_output_tokens=256, aging_s=10.0)
# metered's prompts over 5 tokens are refused by its quota, after the door
KEYS = {t: key(f"sk-door-{t}-0001", t, tpm=(5 if t == "metered" else 10_000_000))
        for t in TENANTS}
LONG = {"prompt": "Tell me a long story", "max_tokens": 2000, "ignore_eos": True, "stream": True}
SHORT = {"prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def door_gateway(redis_url, tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("door")
    engine = folder / "engine.yaml"
    engine.write_text(yaml.safe_dump({"max_model_len": 4096, "scheduler": {
        "classes": [_CLASS], "tenants": [{"name": t} for t in TENANTS]}}))
    keys = folder / "keys.yaml"
    keys.write_text(yaml.safe_dump(list(KEYS.values())))
    model = str(tiny_model_dir)
    # 50 ms a step: a 2,000-token stream is held ~100 s, longer than any story here
    with running_fleet(redis_url, model, "colocated", decode=0) as f:
        f.worker("mixed-0", "mixed", model, extra_args=(
            "--engine", "sim", *sim_args(64, step_ms=50), "--config", str(engine)))
        assert f.serving()
        yield start_gateway(f, model, "gateway-door", "--config", str(engine), "--api-keys",
                            str(keys), "--max-in-progress", str(LIMIT))


def client(gw, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=f"http://{gw.http}", timeout=30.0,
                        headers={"Authorization": f"Bearer {KEYS[tenant]['key']}"})


def in_progress(gw) -> float:
    return metric(scrape(gw.http), "kvfleet_gateway_in_progress")


@contextlib.contextmanager
def held_streams(gw, tenant: str, n: int):
    """`n` streams of `tenant`, each past its first token (so each holds a seat), closed (the
    client goes away) on exit."""
    kept = []         # each body's line iterator: httpx closes a stream whose iterator is dropped
    with contextlib.ExitStack() as stack:
        c = stack.enter_context(client(gw, tenant))
        for _ in range(n):
            r = stack.enter_context(c.stream("POST", "/v1/completions",
                                             json={"model": gw.model, **LONG}))
            assert r.status_code == 200, r.read()
            kept.append(r.iter_lines())
            next(line for line in kept[-1] if line.startswith("data: "))
        yield


def test_a_flooding_tenant_is_refused_at_its_share_while_a_quiet_one_is_served(door_gateway):
    gw = door_gateway
    assert wait_until(lambda: in_progress(gw) == 0, 15.0)
    # flood's share beside idle tenants: the door less the seat kept out of the shares, 3 of 4
    with held_streams(gw, "flood", 3), client(gw, "flood") as c:
        refused = c.post("/v1/completions", json={"model": gw.model, **SHORT})
        error = openai_error(refused, 429)
        assert error["code"] == "tenant_share_exceeded" and error["type"] == "rate_limit_error"
        assert "fair share (3 of max_in_progress 4" in error["message"]
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.headers["x-kvfleet-stage"] == "S4_REJECT"
        # refused before its body is read: a body that is not JSON gets the same 429
        unread = c.post("/v1/completions", content=b"not json",
                        headers={"content-type": "application/json"})
        assert openai_error(unread, 429)["code"] == "tenant_share_exceeded"
        assert httpx.get(f"http://{gw.http}/health", timeout=30).status_code == 200
        with client(gw, "quiet") as q:
            served = q.post("/v1/completions", json={"model": gw.model, **SHORT})
        assert served.status_code == 200, served.text
        samples = scrape(gw.http)
        assert metric(samples, "kvfleet_gateway_shed_total", reason="door_tenant_share",
                      tenant="flood") >= 2
        assert metric(samples, "kvfleet_rejections_total", reason="door_tenant_share",
                      stage="S4_REJECT") >= 2
        assert metric(samples, "kvfleet_gateway_in_progress", tenant="flood") == 3
    assert wait_until(lambda: in_progress(gw) == 0, 15.0)


def test_a_full_gateway_answers_503_to_a_tenant_under_its_share(door_gateway):
    gw = door_gateway
    assert wait_until(lambda: in_progress(gw) == 0, 15.0)
    # shares as they fill: flood 3 (one seat kept), quiet 1 (3 // 2 beside flood's 3): every
    # seat held, and third (0 of its share 1) finds none
    with held_streams(gw, "flood", 3), held_streams(gw, "quiet", 1), client(gw, "third") as c:
        full = c.post("/v1/completions", json={"model": gw.model, **SHORT})
        error = openai_error(full, 503)
        assert error["code"] == "gateway_full" and "max_in_progress 4" in error["message"]
        assert int(full.headers["Retry-After"]) >= 1
        assert httpx.get(f"http://{gw.http}/health", timeout=30).status_code == 200
    assert wait_until(lambda: in_progress(gw) == 0, 15.0)
    with client(gw, "third") as c:
        assert c.post("/v1/completions", json={"model": gw.model, **SHORT}).status_code == 200


def test_grpc_refuses_past_the_share_with_retry_after_and_serves_under_it(door_gateway):
    gw = door_gateway
    assert wait_until(lambda: in_progress(gw) == 0, 15.0)
    request = pb.GenerateRequest(model=gw.model, text="hi", params=pb.SamplingParams(max_tokens=2))
    bearer = lambda t: (("authorization", f"Bearer {KEYS[t]['key']}"),)      # noqa: E731
    with held_streams(gw, "flood", 3), grpc.insecure_channel(gw.grpc) as channel:
        stub = pb_grpc.GatewayStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request, metadata=bearer("flood")))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "fair share" in refused.value.details()
        trailing = dict(refused.value.trailing_metadata())
        assert int(trailing["retry-after"]) >= 1 and trailing["x-kvfleet-stage"] == "S4_REJECT"
        assert stub.Health(pb.HealthRequest()).status == pb.HealthResponse.SERVING
        chunks = list(stub.Generate(request, metadata=bearer("quiet")))
        assert chunks[-1].finished
    assert wait_until(lambda: in_progress(gw) == 0, 15.0)


ENDINGS = ("finished", "streamed", "disconnected", "bad_body", "quota_refused")


def _end_one(gw, how: str) -> None:
    tenant = "metered" if how == "quota_refused" else "quiet"
    with client(gw, tenant) as c:
        if how == "finished":
            assert c.post("/v1/completions", json={"model": gw.model, **SHORT}).status_code == 200
        elif how == "streamed":
            with c.stream("POST", "/v1/completions",
                          json={"model": gw.model, **SHORT, "stream": True}) as r:
                assert r.status_code == 200 and r.read()
        elif how == "disconnected":
            with held_streams(gw, "quiet", 1):
                pass
        elif how == "bad_body":
            openai_error(c.post("/v1/completions", content=b"{", headers={
                "content-type": "application/json"}), 400)
        else:     # more prompt tokens than its tokens_per_minute: the quota's refusal
            error = openai_error(c.post("/v1/completions", json={
                "model": gw.model, "prompt": [7] * 10, "max_tokens": 2}), 429)
            assert "request too large" in error["message"]


@settings(max_examples=4, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(ENDINGS), min_size=1, max_size=5))
def test_the_seats_come_back_however_requests_end(door_gateway, endings):
    gw = door_gateway
    for how in endings:
        _end_one(gw, how)
    assert wait_until(lambda: in_progress(gw) == 0, 15.0), f"seats left after {endings}"


# ------------------------------------------------------------------ the door's own bookkeeping

class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(("enter", "leave", "leave twice", "tick")),
                          st.sampled_from(TENANTS[:4])), max_size=60))
def test_the_door_counts_back_to_zero_and_refuses_only_past_a_share_or_when_full(steps):
    clock = Clock()
    door = Door(LIMIT, TENANTS[:4], clock=clock)
    seats = []
    for op, tenant in steps:
        if op == "enter":
            mine, share, total = door.held.get(tenant, 0), door.share(tenant), door.in_progress
            try:
                seats.append(door.enter(tenant))
                assert mine < share and total < LIMIT
            except GatewayError as e:
                assert (e.status, mine >= share) in ((429, True), (503, False))
                assert e.status == 429 or total >= LIMIT
                assert e.retry_after > 0 and "max_in_progress 4" in e.message
        elif op.startswith("leave") and seats:
            seat = seats.pop(0)
            seat.leave()
            if op == "leave twice":
                seat.leave()
        elif op == "tick":
            clock.now += 0.7
        assert door.in_progress == sum(door.held.values()) == len(seats) <= LIMIT
    for seat in seats:
        seat.leave()
    assert door.in_progress == 0 and door.held == {}
    assert all(s.value == 0 for m in door.metrics.in_progress.collect() for s in m.samples)


@given(st.integers(0, 200), st.lists(st.integers(1, 100), max_size=8))
def test_a_share_is_the_max_min_fair_level(room, others):
    level = fair_level(room, others)
    filled = lambda lv: sum(min(h, lv) for h in others) + lv      # noqa: E731
    assert filled(level) <= room < filled(level + 1)


def test_a_flood_beside_quiet_tenants_keeps_what_they_do_not_use():
    assert fair_level(28, []) == 28               # alone (4 of 32 kept out of the shares)
    assert fair_level(28, [1, 1, 1]) == 25        # three quiet tenants hold a seat each
    assert fair_level(28, [28]) == 14             # a second flood: half each
    assert fair_level(28, [2, 20]) == 13          # (28 - 2) / 2


def test_a_critical_tenant_has_no_share_only_the_bound():
    door = Door(LIMIT, ("flood", "ops"), critical=("ops",))
    seats = [door.enter("flood") for _ in range(3)]          # its share: 4 less 1 kept
    with pytest.raises(GatewayError) as over:
        door.enter("flood")
    assert over.value.status == 429
    seats.append(door.enter("ops"))                          # the kept seat
    with pytest.raises(GatewayError) as full:
        door.enter("ops")
    assert full.value.status == 503 and full.value.code == "gateway_full"
    seats.pop().leave()
    seats.append(door.enter("ops"))
    for seat in seats:
        seat.leave()
    assert door.in_progress == 0


def test_retry_after_follows_the_measured_drain_rate():
    clock = Clock()
    door = Door(2, ("a",), clock=clock)
    first, second = door.enter("a"), door.enter("a")
    with pytest.raises(GatewayError) as cold:
        door.enter("a")
    assert "nothing measured yet" in cold.value.message
    clock.now += 4.0
    first.leave()                         # held 4 s
    again = door.enter("a")
    with pytest.raises(GatewayError) as slow:
        door.enter("a")
    clock.now += 1.0
    second.leave()
    third = door.enter("a")
    clock.now += 0.1
    again.leave()
    door.enter("a")
    with pytest.raises(GatewayError) as fast:
        door.enter("a")
    # more leaves in the window: a shorter wait, from the rate, not a constant
    assert fast.value.retry_after < slow.value.retry_after
    assert "leaving per second" in fast.value.message
    third.leave()
