"""Stream slots are leases: a gateway killed with -9 while it holds a tenant's streams gives them
back when its leases lapse, at most the lease TTL after its last renewal, and another gateway then
admits the tenant. Meanwhile the other gateway's 429 says when the slot frees: an estimate while
the holder renews (it is alive), the dead lease's expiry once the lease has missed a renewal.

A real co-located fleet on 127.0.0.1 (its own redis-server, router, one mixed worker, two
gateways), with a lease TTL of 3 s (renewed every 0.6 s, lapsed below 1.8 s left).
"""
from __future__ import annotations

import math
import time
from contextlib import ExitStack

import httpx
import pytest
import yaml

from services.cli.launcher import Launcher
from tests.waiting import wait_until
from tests.harness import Fleet, Gateway, start_gateway
from tests.faults.test_redis_outage import RedisOnOnePort, open_streams
from tests.gateway.gateway_helpers import key, openai_error, write_configs

TTL_S = 3.0
RENEW_S = TTL_S / 5
PAIR = key("sk-pair-0001", "acme", streams=2)        # a tenant with two concurrent streams
LONG = {"prompt": "Tell me a long story", "max_tokens": 2000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    redis = RedisOnOnePort()
    launcher = Launcher()
    try:
        redis.start()
        f = Fleet(launcher, redis.url)
        f.start_router("colocated")
        tmp = tmp_path_factory.mktemp("lease-config")
        engine_yaml, _ = write_configs(tmp)
        (tmp / "pair.yaml").write_text(yaml.safe_dump([PAIR]))
        f.worker("mixed-0", "mixed", str(tiny_model_dir), extra_args=("--config", engine_yaml))
        assert f.serving()
        f.gateway_args = ("--config", engine_yaml, "--api-keys", str(tmp / "pair.yaml"),
                          "--timeout-lease-ttl-s", str(TTL_S), "--timeout-lease-renew-s", str(RENEW_S))
        yield f
    finally:
        launcher.stop_all()
        redis.stop()


def client(gateway: Gateway) -> httpx.Client:
    return httpx.Client(base_url=f"http://{gateway.http}", timeout=30,
                        headers={"Authorization": f"Bearer {PAIR['key']}"})


def short(gateway: Gateway) -> httpx.Response:
    with client(gateway) as c:
        return c.post("/v1/completions", json={"model": gateway.model, "prompt": "hi",
                                               "max_tokens": 2})


def test_a_killed_gateways_slots_come_back_when_its_leases_lapse(fleet, tiny_model_dir):
    model = str(tiny_model_dir)
    doomed = start_gateway(fleet, model, "gateway-doomed", *fleet.gateway_args)
    other = start_gateway(fleet, model, "gateway-other", *fleet.gateway_args)
    with ExitStack() as stack:
        c = stack.enter_context(client(doomed))
        responses = [stack.enter_context(c.stream("POST", "/v1/completions",
                                                  json={"model": doomed.model, **LONG}))
                     for _ in range(2)]
        assert [r.status_code for r in responses] == [200, 200]
        assert open_streams(fleet.redis_url, "acme") == 2

        busy = openai_error(short(other), 429)       # the holder is alive: an estimate
        assert "max_concurrent_streams" in busy["message"] and "estimated" in busy["message"]

        fleet.launcher.kill("gateway-doomed")
        killed_at = time.monotonic()
        lapsing = []                                 # (seconds after the kill, Retry-After)
        while True:
            sent = time.monotonic() - killed_at
            response = short(other)
            if response.status_code == 200:
                break
            error = openai_error(response, 429)
            if "stopped renewing" in error["message"]:
                lapsing.append((sent, int(response.headers["Retry-After"])))
            assert sent < TTL_S + 3.0, "the dead gateway's slots never came back"
            time.sleep(0.1)
        freed_after = time.monotonic() - killed_at

    # Its last renewal was at most RENEW_S before the kill: the slots free TTL_S after it.
    assert TTL_S - RENEW_S - 0.2 <= freed_after <= TTL_S + 1.0
    # Once a lease has missed a renewal, the 429 names its expiry (whole seconds, rounded up).
    assert lapsing, "no 429 named the dead lease's expiry"
    for sent, retry_after in lapsing:
        assert 1 <= retry_after <= max(1, math.ceil(TTL_S - sent)) + 1
    assert wait_until(lambda: open_streams(fleet.redis_url, "acme") == 0, 2.0)
    fleet.launcher.stop("gateway-other")


def test_a_gateway_that_stops_cleanly_gives_its_slots_back_at_once(fleet, tiny_model_dir):
    gateway = start_gateway(fleet, str(tiny_model_dir), "gateway-clean", *fleet.gateway_args)
    with client(gateway) as c, c.stream("POST", "/v1/completions",
                                        json={"model": gateway.model, **LONG}) as response:
        assert response.status_code == 200
        assert open_streams(fleet.redis_url, "acme") == 1
        stopped_at = time.monotonic()
        fleet.launcher.stop("gateway-clean")          # SIGTERM: live requests end as aborted
        assert open_streams(fleet.redis_url, "acme") == 0
        assert time.monotonic() - stopped_at < TTL_S  # given back, not left to lapse
