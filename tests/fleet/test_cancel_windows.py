"""A request cancelled after the router answered frees its decode reservation at once, wherever the
cancel falls between the router's answer and the decode stream owning the request (docs/
architecture.md, "Cancel windows"). Each story cancels in one window and then sees the decode
worker hold nothing, the tenant's stream lease, decode KV and placements in Redis back to zero,
and nothing waiting in the router's queue, within 15 s. The decode worker's reservations live
300 s here, so only the cancel can be what frees them.

A real disaggregated fleet (Redis, a router, one prefill and one decode worker as processes on the
simulated engine core, 50 ms a step so a stream outlasts each story) and a real gateway process,
which asks the router through a RouterProxy (tests/gateway/router_proxy.py: a real gRPC server that
forwards to the router and can hold a plan on its way back, as a slow network does).

The windows:
  1. the plan on its way back when the client hangs up (REST): the gateway gives the Admit up, the
     router had finished, the plan comes to no one;
  2. a Cancel call (gRPC) while the Admit runs: the run is closed before it has a plan;
  3. the plan's calls opened while the prefill worker's engine core is frozen (SIGSTOP), so the
     prefill is never accepted, when the client hangs up (REST).
After the first token (the KV on its way or landed, decode streaming) a client hanging up is the
"cancel" ending of tests/fleet/test_back_to_zero.py.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading

import grpc
import pytest
import yaml

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from tests.fleet.tenant_books import tenant_books
from tests.gateway.gateway_helpers import ENGINE_CONFIG, key
from tests.gateway.router_proxy import RouterProxy
from tests.harness import Gateway, engine_core_pid, running_fleet, sim_args
from tests.waiting import wait_until

KEY = key("sk-cancel-0001", "acme", streams=4)
AUTH = (("authorization", f"Bearer {KEY['key']}"),)
LONG_LIVED = ("--timeout-reservation-s", "300", "--timeout-reservation-max-s", "300")
SLOW_STEPS = ("--engine", "sim", *sim_args(64, step_ms=50))
PROMPT = "Tell me a long story about the sea"
FREED_S = 15.0               # well inside the reservation's 300 s


@pytest.fixture(scope="module")
def setup(redis_url, tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cancel-windows")
    (tmp / "engine.yaml").write_text(yaml.safe_dump(ENGINE_CONFIG))
    (tmp / "keys.yaml").write_text(yaml.safe_dump([KEY]))
    config = ("--config", str(tmp / "engine.yaml"))
    with running_fleet(redis_url, str(tiny_model_dir), "disagg",
                       worker_args=(*config, *LONG_LIVED, *SLOW_STEPS)) as fleet:
        assert wait_until(lambda: len(fleet.workers) == 2 and fleet.serving(), 60)
        with RouterProxy(fleet) as proxy:
            name = "gw-cancel"
            http = fleet.launcher.start(name, [
                "services.gateway", "--model", str(tiny_model_dir), "--router", proxy.address,
                "--redis-url", fleet.redis_url, *config, "--api-keys", str(tmp / "keys.yaml")])
            line = next(x for x in fleet.launcher.children[name].lines if x.startswith("GRPC "))
            model = str(tiny_model_dir).rstrip("/").rsplit("/", 1)[-1]
            gw = Gateway(http=http, grpc=line.split()[-1], model=model)
            yield fleet, gw, proxy
            proxy.release_all()


@pytest.fixture
def fleet_at_rest(setup):
    """Each story starts with nothing held and no plan held back (whatever ran before)."""
    fleet, gw, proxy = setup
    proxy.release_all()
    assert wait_until(lambda: at_rest(fleet), FREED_S), books(fleet)
    return setup


def held(fleet, name: str) -> int:
    s = fleet.stats(name)
    return s.kv_blocks_used + s.kv_blocks_reserved + s.kv_blocks_held


def books(fleet) -> tuple[int, int, int, int]:
    """(blocks the decode worker holds, the tenant's open stream leases, its decode KV as a router
    reads it from Redis (published shares plus what routers placed since those beats), requests
    waiting in the router's queue)."""
    return (held(fleet, "decode-0"), *asyncio.run(tenant_books(fleet.redis_url, "acme")))


def at_rest(fleet) -> bool:
    return books(fleet) == (0, 0, 0, 0)


def hang_up_later(gw: Gateway, max_tokens: int = 1000) -> socket.socket:
    """A streamed completion sent on a raw connection, so that closing it is the client hanging
    up whenever the story says (an HTTP client would wait for the response's headers)."""
    body = json.dumps({"model": gw.model, "prompt": PROMPT, "stream": True, "ignore_eos": True,
                       "max_tokens": max_tokens}).encode()
    host, port = gw.http.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\n"
                 b"Authorization: Bearer " + KEY["key"].encode() + b"\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def the_held_plan(proxy: RouterProxy) -> str:
    """The request id of the one plan the proxy holds, once it holds it."""
    assert wait_until(lambda: len(proxy.holding) == 1, 30), "no plan came to be held"
    return next(iter(proxy.holding))


def test_a_plan_on_its_way_back_when_the_client_hangs_up_frees_its_reservation(fleet_at_rest):
    fleet, gw, proxy = fleet_at_rest
    proxy.hold = True
    sock = hang_up_later(gw)
    rid = the_held_plan(proxy)
    assert held(fleet, "decode-0") > 0               # the plan's reservation is on the worker
    sock.close()
    assert wait_until(lambda: rid in proxy.cancelled, 10), "the gateway never gave the Admit up"
    proxy.release(rid)                               # the plan comes back to no one
    assert wait_until(lambda: at_rest(fleet), FREED_S), books(fleet)


def test_a_cancel_call_while_the_router_decides_frees_the_plan_it_makes(fleet_at_rest):
    fleet, gw, proxy = fleet_at_rest
    proxy.hold = True
    chunks: list[pb.TokenChunk] = []
    with grpc.insecure_channel(gw.grpc) as channel:
        stub = pb_grpc.GatewayStub(channel)
        stream = stub.Generate(pb.GenerateRequest(
            request_id="windows-2", text=PROMPT,
            params=pb.SamplingParams(max_tokens=1000, ignore_eos=True)), metadata=AUTH,
            timeout=60)
        reader = threading.Thread(target=lambda: chunks.extend(stream), daemon=True)
        reader.start()
        rid = the_held_plan(proxy)
        assert held(fleet, "decode-0") > 0
        assert stub.Cancel(pb.CancelRequest(request_id="windows-2"), metadata=AUTH,
                           timeout=10).cancelled
        assert wait_until(lambda: rid in proxy.cancelled, 10), "the Admit was not given up"
        proxy.release(rid)                           # the plan comes back after the Cancel
        reader.join(30)
        assert not reader.is_alive()
    assert [c.finish_reason for c in chunks] == ["abort"]     # no token was made for it
    assert wait_until(lambda: at_rest(fleet), FREED_S), books(fleet)


def test_a_client_gone_while_the_prefill_worker_is_frozen_frees_the_decode_reservation(
        fleet_at_rest):
    fleet, gw, proxy = fleet_at_rest
    core = engine_core_pid(fleet.launcher.children["prefill-0"].proc.pid)
    os.kill(core, signal.SIGSTOP)            # the prefill worker cannot accept the request
    try:
        before = len(proxy.answered)
        sock = hang_up_later(gw)
        assert wait_until(lambda: len(proxy.answered) > before, 30)      # the plan went back
        assert held(fleet, "decode-0") > 0
        sock.close()
        assert wait_until(lambda: books(fleet)[:2] == (0, 0), FREED_S), books(fleet)
    finally:
        os.kill(core, signal.SIGCONT)
    assert wait_until(lambda: at_rest(fleet), FREED_S), books(fleet)
