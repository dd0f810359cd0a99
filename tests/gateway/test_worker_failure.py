"""A worker that dies: a stream it was serving ends with an error event and [DONE]; with no worker
left the gateway answers 503 and /health says so; the tenant's stream slots all come back."""
from __future__ import annotations

import json

import httpx
import pytest
import redis

from tests.waiting import wait_until
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from tests.harness import running_fleet, start_gateway
from tests.gateway.gateway_helpers import openai_error, stream_counter


@pytest.fixture(scope="module")
def doomed(redis_url, tiny_model_dir, configs):
    """A fleet of its own (its worker gets killed), with an unauthenticated loopback gateway."""
    with running_fleet(redis_url, str(tiny_model_dir), "colocated", decode=0) as fleet:
        fleet.worker("mixed-0", "mixed", str(tiny_model_dir), extra_args=("--config", configs[0]))
        assert fleet.serving()
        yield fleet, start_gateway(fleet, str(tiny_model_dir), "gateway", "--config", configs[0])


def test_a_dead_worker_ends_the_stream_with_an_error_then_503(doomed):
    fleet, gw = doomed
    r = redis.Redis.from_url(fleet.redis_url)
    with httpx.Client(base_url=f"http://{gw.http}", timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={
                "model": gw.model, "prompt": "keep going", "max_tokens": 2000, "ignore_eos": True,
                "stream": True}) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            fleet.launcher.kill("mixed-0")
            rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["error"]["type"] == "service_unavailable"
        assert wait_until(lambda: fleet.router_stub().Health(pb.HealthRequest()).status ==
                          pb.HealthResponse.NOT_SERVING, 5)
        refused = c.post("/v1/completions", json={"model": gw.model, "prompt": "hi"})
        health = c.get("/health")
    error = openai_error(refused, 503)
    assert error["type"] == "service_unavailable" and "no healthy mixed worker" in error["message"]
    assert refused.headers["Retry-After"] == "2"
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    assert wait_until(lambda: stream_counter(r, "default") == 0, 1.0)
