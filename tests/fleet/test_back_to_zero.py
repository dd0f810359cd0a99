"""However requests end, the fleet's books come back to zero: a real disaggregated fleet (Redis,
a router, one prefill and four decode workers as processes on the simulated engine core, the
gateway with a keyed tenant) serves streamed completions that end at random (hypothesis) by
finishing, by the client hanging up after its first token, or by an error: the decode worker
serving the stream is killed (-9) mid-stream. After each, the tenant's stream leases in Redis,
its decode KV as every router reads it from Redis (the workers' published tenant shares plus what
routers placed since those beats: the count its guaranteed minimum is judged by), the router's
wait queue and every live decode worker's reservations are back to zero, and the fleet serves the
next request.

(Waiters that leave the wait queue by being served, by their caller or by their router going
away: tests/router/test_admission_flow.py; a killed gateway's leases: tests/faults/
test_gateway_leases.py.)"""
from __future__ import annotations

import asyncio

import httpx
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings, strategies as st

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from tests.fleet.tenant_books import tenant_books
from tests.gateway.gateway_helpers import ENGINE_CONFIG, key
from tests.harness import running_fleet, start_gateway
from tests.waiting import wait_until

KEY = key("sk-zero-0001", "acme", streams=8)
DECODE = 4                   # one for every kill the examples may make (3), and one more


@pytest.fixture(scope="module")
def setup(redis_url, tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero")
    (tmp / "engine.yaml").write_text(yaml.safe_dump(ENGINE_CONFIG))
    (tmp / "keys.yaml").write_text(yaml.safe_dump([KEY]))
    config = ("--config", str(tmp / "engine.yaml"))
    with running_fleet(redis_url, str(tiny_model_dir), "disagg", decode=DECODE,
                       worker_args=config) as fleet:
        assert wait_until(lambda: len(fleet.workers) == 1 + DECODE, 60)
        gw = start_gateway(fleet, str(tiny_model_dir), "gateway", *config,
                           "--api-keys", str(tmp / "keys.yaml"))
        yield fleet, gw


def held(fleet, name: str) -> int:
    s = fleet.stats(name)
    return s.kv_blocks_used + s.kv_blocks_reserved


def live_decoders(fleet) -> list[str]:
    return [n for n in fleet.workers if n.startswith("decode")
            and fleet.launcher.children[n].proc.poll() is None]


def listed(fleet, name: str) -> bool:
    """Whether the router still lists `name` among its live workers (its heartbeat)."""
    return name in fleet.router_stub().Health(pb.HealthRequest()).detail


async def books(redis_url: str) -> tuple[int, int, int]:
    """(the tenant's open stream leases, its decode KV blocks fleet-wide, requests waiting in the
    router's queue)."""
    return await tenant_books(redis_url, "acme")


def one_stream(fleet, gw, ending: str) -> None:
    body = {"model": gw.model, "prompt": "Tell me a long story", "stream": True,
            "ignore_eos": True, "max_tokens": 6 if ending == "finish" else 4000}
    with httpx.Client(base_url=f"http://{gw.http}", timeout=60,
                      headers={"Authorization": f"Bearer {KEY['key']}"}) as client, \
            client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        if ending == "finish":
            assert list(lines)[-1] == "data: [DONE]"
            return
        next(lines)                                           # the first token came
        assert wait_until(lambda: asyncio.run(books(fleet.redis_url))[1] > 0, 10)  # its KV counts
        if ending == "error":
            victim = next(n for n in live_decoders(fleet) if held(fleet, n))
            fleet.launcher.kill(victim)
            rest = list(lines)                 # an error event, then [DONE]
            assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2], rest[-3:]
            assert wait_until(lambda: not listed(fleet, victim), 15)
        # "cancel": leaving the block hangs up


@settings(max_examples=2, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(endings=st.lists(st.sampled_from(["finish", "cancel", "error"]), min_size=1, max_size=4)
       .filter(lambda e: e.count("error") <= 1))
@example(endings=["cancel", "error", "finish"])     # every ending, whatever hypothesis draws
def test_every_count_comes_back_to_zero_however_streams_end(setup, endings):
    fleet, gw = setup
    for ending in endings:
        one_stream(fleet, gw, ending)
        assert wait_until(lambda: asyncio.run(books(fleet.redis_url)) == (0, 0, 0), 15), \
            (ending, asyncio.run(books(fleet.redis_url)))
        assert wait_until(lambda: all(held(fleet, n) == 0 for n in live_decoders(fleet)), 15), \
            (ending, {n: held(fleet, n) for n in live_decoders(fleet)})
