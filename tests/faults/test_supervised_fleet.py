"""The fault suite on a supervised fleet (`kvfleet up`, real processes, real redis-server):

  - a request with max_tokens past the class output cap is served, capped and said so, in both
    modes (it used to kill the engine thread and, with it, the fleet);
  - kill -9 of each process type mid-stream: every client hears how its request ended (a finish,
    an SSE error event, or its connection dropping: never a hang, never a silent `abort`), the
    supervisor restarts the dead process, the fleet serves again, and every KV block,
    reservation and stream slot comes back;
  - SIGSTOP / SIGCONT of a decode worker: new requests are refused with 503 + Retry-After while it
    is frozen (never hang), the frozen streams finish once it runs again.
Assertions are on outcomes, each waited for with a deadline.
"""
from __future__ import annotations

import asyncio
import signal

import httpx
import pytest

from services.worker.faults import ENGINE_STEP_DELAY
from tests.waiting import wait_until
from tests.faults.fault_fleet import (OUTPUT_CAP, engine_config, exit_said, stream_chat,
                                     supervised_fleet)
from tests.harness import holds_nothing, open_streams, serves

CLIENT_TIMEOUT = httpx.Timeout(60.0)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return engine_config(tmp_path_factory.mktemp("faults"))


# Each engine step 25 ms slower: a 48-token stream then lasts over a second, so a kill sent once
# every stream has its first token lands while they all still decode (at the tiny model's own
# pace the streams could all finish before the kill).
STEP_DELAY = {ENGINE_STEP_DELAY: "0.025"}


@pytest.fixture(scope="module")
def fleet(redis_url, tiny_model_dir, config):
    with supervised_fleet(redis_url, str(tiny_model_dir), config, env=STEP_DELAY) as f:
        yield f


@pytest.fixture
def healthy(fleet):
    """Each test starts on a fleet that serves and holds nothing, whatever ran before it."""
    assert serves(fleet, 60), "\n".join(fleet.lines[-30:])
    assert wait_until(lambda: holds_nothing(fleet), 30)
    return fleet


@pytest.mark.parametrize("mode", ["disagg", "colocated"])
def test_max_tokens_past_the_output_cap_is_capped_and_said_so(redis_url, tiny_model_dir, config,
                                                              mode, fleet):
    def ask(f):
        return httpx.post(f"{f.url}/v1/completions", timeout=CLIENT_TIMEOUT, json={
            "model": f.model, "prompt": "hi", "max_tokens": OUTPUT_CAP + 2052, "ignore_eos": True})

    if mode == "disagg":
        responses = [ask(fleet) for _ in range(2)]
        assert serves(fleet, 10) and wait_until(lambda: holds_nothing(fleet), 30)
    else:
        with supervised_fleet(redis_url, str(tiny_model_dir), config, mode="colocated") as colocated:
            responses = [ask(colocated) for _ in range(2)]
            assert serves(colocated, 10) and wait_until(lambda: holds_nothing(colocated), 30)
    for r in responses:
        assert r.status_code == 200, r.text
        assert r.headers["x-kvfleet-output-cap"] == str(OUTPUT_CAP)
        assert r.json()["usage"]["completion_tokens"] == OUTPUT_CAP
        assert r.json()["choices"][0]["finish_reason"] == "length"


async def _streams_then(fleet, n: int, action) -> list:
    """Start n streams; once every one has its first token, run `action`; gather the results."""
    async with httpx.AsyncClient(base_url=fleet.url, timeout=CLIENT_TIMEOUT) as client:
        firsts = [asyncio.Event() for _ in range(n)]
        tasks = [asyncio.ensure_future(stream_chat(client, fleet.model, e)) for e in firsts]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 60)
        action()
        return await asyncio.wait_for(asyncio.gather(*tasks), 90)


@pytest.mark.parametrize("victim", ["decode-0", "prefill-0", "router-0", "gateway"])
def test_kill_9_mid_stream_is_heard_by_every_client_and_the_fleet_heals(healthy, victim):
    fleet = healthy
    old_pid = fleet.pid(victim)
    results = asyncio.run(_streams_then(fleet, 4, lambda: fleet.signal(victim, signal.SIGKILL)))
    for r in results:
        assert r.finish_reason != "abort", r
        ended = r.finish_reason in ("stop", "length") or r.error is not None or r.broken
        assert ended, r                           # every client heard an ending
        if r.error is not None:
            assert r.done and r.error["type"] == "service_unavailable", r   # error event, [DONE]
    if victim == "decode-0":                      # decoding streams cannot survive their worker
        assert all(r.error is not None for r in results), results
    if victim == "gateway":                       # the clients' connections were the gateway's
        assert all(r.broken or r.error for r in results), results
    assert wait_until(lambda: fleet.pid(victim) not in (None, old_pid), 30), \
        "\n".join(fleet.lines[-20:])              # the supervisor restarted it
    said = exit_said(fleet, victim)
    assert f"{victim} exited with status -9 " in said, "\n".join(fleet.lines[-20:])
    assert serves(fleet, 60), "\n".join(fleet.lines[-30:])
    assert wait_until(lambda: holds_nothing(fleet), 30)    # every block and reservation came back
    assert wait_until(lambda: open_streams(fleet.redis_url) == 0, 10)   # ... and every stream slot


def test_a_frozen_decode_worker_is_skipped_then_resumes_its_streams(healthy):
    fleet = healthy
    refused: list[httpx.Response] = []

    def freeze_and_ask() -> None:
        fleet.signal("decode-0", signal.SIGSTOP)
        try:
            # a Reserve it cannot answer times out (RESERVE_TIMEOUT_S), and its heartbeat goes
            # stale within ~1.5 s: either way the router has no decode worker to place on, and
            # the request is refused with 503, not held until the worker thaws
            def refused_now() -> bool:
                r = httpx.post(f"{fleet.url}/v1/completions", timeout=15, json={
                    "model": fleet.model, "prompt": "anyone?", "max_tokens": 2})
                refused.append(r)
                return r.status_code == 503
            assert wait_until(refused_now, 20)
        finally:
            fleet.signal("decode-0", signal.SIGCONT)

    results = asyncio.run(_streams_then(fleet, 3, freeze_and_ask))
    last = refused[-1]
    assert last.status_code == 503 and last.headers["Retry-After"] == "2"
    assert "no decode replica" in last.json()["error"]["message"]
    assert all(r.finish_reason == "length" and r.completion_tokens == OUTPUT_CAP
               for r in results), results
    assert serves(fleet, 30) and wait_until(lambda: holds_nothing(fleet), 30)


def test_an_engine_exception_fails_its_requests_loudly_and_the_worker_is_restarted(
        redis_url, tiny_model_dir, config):
    """An exception inside an engine step (injected: the 25th step raises) used to kill the engine
    thread silently: Health said SERVING, clients hung. Now its streams end with an error event,
    the worker exits 70, `kvfleet up` restarts it, and the fleet serves again."""
    with supervised_fleet(redis_url, str(tiny_model_dir), config, mode="colocated",
                    env={"KVFLEET_FAULT_ENGINE_STEP": "25"}) as fleet:
        old_pid = fleet.pid("mixed-0")
        results = asyncio.run(_streams_then(fleet, 3, lambda: None))
        for r in results:
            assert r.error is not None and r.done, r
            assert r.error["type"] == "service_unavailable"
            assert "InjectedFault" in r.error["message"], r
        assert wait_until(lambda: fleet.pid("mixed-0") not in (None, old_pid), 90)
        said = exit_said(fleet, "mixed-0")
        assert "mixed-0 exited with status 70 " in said, "\n".join(fleet.lines[-30:])
        assert serves(fleet, 60)            # the new worker serves (until its own 25th step)
        assert wait_until(lambda: holds_nothing(fleet), 30)
        assert wait_until(lambda: open_streams(fleet.redis_url) == 0, 10)
