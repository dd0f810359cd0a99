"""Tenant quotas are enforced in Redis (and a tenant whose slots this gateway already holds is
refused before its request's body is read), and a stream's slot always comes back: when it finishes,
and when its client goes away mid-stream, which also frees its KV on the worker within a second.
(A gateway that dies gives its slots back too, when their leases lapse: tests/faults/.)"""
from __future__ import annotations

import asyncio
import time

import httpx

from services.state.fleet_state import FleetState
from tests.waiting import wait_until
from tests.gateway.gateway_helpers import openai_error, slots_free

LONG = {"prompt": "Tell me a long story", "max_tokens": 2000, "ignore_eos": True, "stream": True}


def open_streams(fleet, tenant: str) -> int:
    """The tenant's open streams as Redis counts them (its live stream leases)."""
    async def read() -> int:
        async with FleetState(fleet.redis_url) as state:
            return await state.streams(tenant)
    return asyncio.run(read())


def _next_event(lines) -> str:
    """Reads up to the next SSE event. Keep `lines` (the response's iter_lines()) referenced: httpx
    closes the connection when that iterator is dropped mid-body, which is a disconnect."""
    return next(line for line in lines if line.startswith("data: "))


def test_a_second_concurrent_stream_is_429_until_the_first_ends(gateway, fleet):
    slots_free(fleet.redis_url, "solo")              # "solo" may hold one stream at a time
    with gateway.client("solo") as c:
        with c.stream("POST", "/v1/completions", json={"model": gateway.model, **LONG}) as first:
            assert first.status_code == 200, first.read()
            lines = first.iter_lines()
            _next_event(lines)
            second = c.post("/v1/completions", json={"model": gateway.model, "prompt": "hi"})
            error = openai_error(second, 429)
            assert error["code"] == "rate_limit_exceeded" and "max_concurrent_streams" in error["message"]
            # the holder is alive, so when a slot frees is an estimate, and the message says so
            assert "estimated" in error["message"] and int(second.headers["Retry-After"]) >= 1
            assert open_streams(fleet, "solo") == 1
            # this gateway holds the tenant's only slot: the next is refused before its body is
            # read (a body that is not JSON at all gets the 429, not a 400)
            unread = c.post("/v1/completions", content=b"not json",
                            headers={"content-type": "application/json"})
            assert "max_concurrent_streams" in openai_error(unread, 429)["message"]
            assert open_streams(fleet, "solo") == 1
        assert wait_until(lambda: open_streams(fleet, "solo") == 0, 2.0)
        third = c.post("/v1/completions", json={"model": gateway.model, "prompt": "hi", "max_tokens": 2})
        assert third.status_code == 200, third.text


def test_requests_per_minute_over_the_limit_is_429_with_retry_after(gateway):
    if time.time() % 60 > 57:              # keep all three requests inside one minute window
        time.sleep(60 - time.time() % 60 + 0.1)
    req = {"model": gateway.model, "prompt": "hi", "max_tokens": 1}
    with gateway.client("metered") as c:
        statuses = [c.post("/v1/completions", json=req) for _ in range(3)]
    assert [s.status_code for s in statuses[:2]] == [200, 200]
    error = openai_error(statuses[2], 429)
    assert "requests per minute" in error["message"]
    assert 1 <= int(statuses[2].headers["Retry-After"]) <= 60


def test_tokens_per_minute_count_the_prompt_first_and_the_output_when_it_ends(gateway):
    if time.time() % 60 > 57:
        time.sleep(60 - time.time() % 60 + 0.1)
    with gateway.client("frugal") as c:
        too_large = c.post("/v1/completions", json={"model": gateway.model, "prompt": [7] * 41})
        fits = c.post("/v1/completions", json={"model": gateway.model, "prompt": [7] * 10,
                                               "max_tokens": 25, "ignore_eos": True})
        over = c.post("/v1/completions", json={"model": gateway.model, "prompt": [7] * 10})
    assert "request too large" in openai_error(too_large, 429)["message"]
    assert fits.status_code == 200                      # 10 prompt + 25 output = 35 of 40
    assert "tokens per minute" in openai_error(over, 429)["message"]
    assert 1 <= int(over.headers["Retry-After"]) <= 60


def test_client_disconnect_mid_stream_frees_the_worker_and_the_slot(gateway, fleet):
    with gateway.client("leaver") as c:
        with c.stream("POST", "/v1/chat/completions", json={
                "model": gateway.model, "messages": [{"role": "user", "content": "go on"}], **{
                    k: v for k, v in LONG.items() if k != "prompt"}}) as response:
            lines = response.iter_lines()
            for _ in range(3):                     # still streaming: nothing has been let go
                _next_event(lines)
            assert fleet.stats("mixed-0").kv_blocks_reserved > 0
            assert open_streams(fleet, "leaver") == 1
    # leaving both blocks closed the connection mid-stream
    assert wait_until(lambda: (lambda s: s.kv_blocks_used == 0 and s.kv_blocks_reserved == 0)(
        fleet.stats("mixed-0")), 1.0)
    assert wait_until(lambda: open_streams(fleet, "leaver") == 0, 1.0)


def test_a_client_that_gives_up_on_a_non_streamed_request_frees_it_too(gateway, fleet):
    with gateway.client("leaver", timeout=0.5) as c:
        try:
            c.post("/v1/completions", json={"model": gateway.model, **LONG, "stream": False})
        except httpx.ReadTimeout:
            pass                                   # httpx closes the connection
    assert wait_until(lambda: (lambda s: s.kv_blocks_used == 0 and s.kv_blocks_reserved == 0)(
        fleet.stats("mixed-0")), 1.0)
    assert wait_until(lambda: open_streams(fleet, "leaver") == 0, 1.0)
