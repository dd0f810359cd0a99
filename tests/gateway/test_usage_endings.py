"""Usage accounting is right on every ending: the tokens a client was sent, and only those, are
charged to its tenant, in Redis (the tenant's token window the quotas keep, which also holds the
prompt charged at admission) and in kvfleet_generation_tokens_total, whether the request
finished, the client cancelled it or went away, the fleet failed it, or its worker died.

Each story counts the tokens the client received, from the stream itself (completion events
with logprobs name each token; gRPC chunks carry their ids), and compares the three counts.
"""
from __future__ import annotations

import asyncio
import json
import socket
import time

import grpc
import httpx
import pytest

from tests.waiting import wait_until
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.state.fleet_state import FleetState
from tests.harness import running_fleet, start_gateway
from tests.gateway.gateway_helpers import bearer, metric, scrape
from tests.state.state_helpers import tenant_counters

PROMPT = [7] * 10                 # token ids: the prompt's charge is exactly 10
LONG = {"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True, "logprobs": 1}


class Ledger:
    """What a tenant has been charged since it was opened: its Redis token windows (this minute's
    and the next, so a request that crosses a minute boundary is still counted whole) and the
    gateway's generation-tokens counter."""

    def __init__(self, redis_url: str, gateway_http: str, tenant: str) -> None:
        self.redis_url, self.http, self.tenant = redis_url, gateway_http, tenant
        self.minute = time.time()
        self._redis0 = self.redis_tokens()
        self._metric0 = self.metric_tokens()

    def redis_tokens(self) -> int:
        async def read() -> int:
            async with FleetState(self.redis_url) as state:
                windows = [await tenant_counters(state, self.tenant, now=self.minute + 60 * k)
                           for k in (0, 1)]
            return sum(w.tokens for w in windows)
        return asyncio.run(read())

    def metric_tokens(self) -> float:
        return metric(scrape(self.http), "kvfleet_generation_tokens_total", tenant=self.tenant)

    def charged(self) -> tuple[int, float]:
        """(generated tokens charged in Redis, in the metric) since the ledger was opened."""
        return (self.redis_tokens() - self._redis0 - len(PROMPT),
                self.metric_tokens() - self._metric0)

    def settles_at(self, tokens: int) -> bool:
        """Both counts reach `tokens` (the charge is made as the request's session closes)."""
        return wait_until(lambda: self.charged() == (tokens, tokens), 5.0)


def tokens_in(payloads: list[str]) -> int:
    """Generated tokens in SSE payloads of completion events (with logprobs, each is named)."""
    total = 0
    for payload in payloads:
        if payload.startswith("{"):
            event = json.loads(payload)
            for choice in event.get("choices", []):
                total += len((choice.get("logprobs") or {}).get("tokens", []))
    return total


def data_lines(lines) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def read_events(lines, n: int) -> list[str]:
    """The next `n` data payloads (keep `lines` referenced: dropping it disconnects)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            out.append(line.removeprefix("data: "))
            if len(out) == n:
                return out
    return out


# ------------------------------------------------------------------------------ the stories
def test_a_finished_stream_is_charged_every_token_it_sent(gateway, fleet):
    ledger = Ledger(fleet.redis_url, gateway.http, "acme")
    with gateway.client("acme") as c:
        with c.stream("POST", "/v1/completions", json={
                "model": gateway.model, **LONG, "max_tokens": 12}) as response:
            received = tokens_in(data_lines(response.iter_lines()))
    assert received == 12
    assert ledger.settles_at(12), ledger.charged()


def test_a_client_that_cancels_is_charged_what_it_received(gateway, fleet):
    ledger = Ledger(fleet.redis_url, gateway.http, "acme")
    auth = (("authorization", bearer("acme")["Authorization"]),)
    with grpc.insecure_channel(gateway.grpc) as channel:
        stub = pb_grpc.GatewayStub(channel)
        call = stub.Generate(pb.GenerateRequest(
            request_id="usage-cancel-1", token_ids=pb.TokenIds(ids=PROMPT),
            params=pb.SamplingParams(max_tokens=2000, ignore_eos=True)), metadata=auth)
        chunks = iter(call)
        received = sum(len(next(chunks).token_ids) for _ in range(3))
        assert stub.Cancel(pb.CancelRequest(request_id="usage-cancel-1"), metadata=auth).cancelled
        rest = list(chunks)                     # what was on its way, then the abort
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    received += sum(len(c.token_ids) for c in rest)
    assert 3 <= received < 2000
    assert ledger.settles_at(received), (received, ledger.charged())


def test_a_client_that_goes_away_is_charged_what_was_sent_before_it_left(gateway, fleet):
    """The client half-closes its connection after a few events (the server sees it leave) and
    still reads what the server had sent until then, so it knows exactly what it was sent."""
    ledger = Ledger(fleet.redis_url, gateway.http, "leaver")
    host, port = gateway.http.rsplit(":", 1)
    body = json.dumps({"model": gateway.model, **LONG}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\n"
                     b"Authorization: " + bearer("leaver")["Authorization"].encode() + b"\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        received = b""
        while received.count(b"data: {") < 5:  # a few events: the stream is under way
            received += sock.recv(65536)
        sock.shutdown(socket.SHUT_WR)           # gone, as far as the server can tell
        while part := sock.recv(65536):
            received += part
    lines = received.decode().split("\r\n")
    payloads = [p for line in lines for p in data_lines(line.split("\n"))]
    assert "[DONE]" not in payloads             # it did leave mid-stream
    sent = tokens_in(payloads)
    assert 5 <= sent < 2000
    assert ledger.settles_at(sent), (sent, ledger.charged())


def test_a_stream_the_fleet_fails_is_charged_what_was_sent(gateway, fleet):
    """A worker ends the request itself (here: a Cancel sent to it directly, as an operator or a
    router would): the client gets an error event, and pays for the tokens before it."""
    ledger = Ledger(fleet.redis_url, gateway.http, "acme")
    with gateway.client("acme") as c:
        with c.stream("POST", "/v1/completions", json={"model": gateway.model, **LONG}) as response:
            lines = response.iter_lines()
            payloads = read_events(lines, 3)
            with fleet.channel(fleet.workers["mixed-0"]) as ch:
                assert pb_grpc.WorkerStub(ch).Cancel(pb.CancelRequest(
                    request_id=response.headers["x-request-id"]), timeout=5).cancelled
            payloads += data_lines(lines)
    assert payloads[-1] == "[DONE]" and "error" in json.loads(payloads[-2])
    sent = tokens_in(payloads)
    assert 3 <= sent < 2000
    assert ledger.settles_at(sent), (sent, ledger.charged())


@pytest.fixture(scope="module")
def mortal(redis_url, tiny_model_dir, configs):
    """A fleet of its own (its worker gets killed), with a gateway that has the API keys."""
    engine_yaml, keys_yaml = configs
    with running_fleet(redis_url, str(tiny_model_dir), "colocated", decode=0) as fleet:
        fleet.worker("mixed-0", "mixed", str(tiny_model_dir), extra_args=("--config", engine_yaml))
        assert fleet.serving()
        yield fleet, start_gateway(fleet, str(tiny_model_dir), "gateway", "--config",
                                   engine_yaml, "--api-keys", keys_yaml)


def test_a_stream_whose_worker_dies_is_charged_what_was_sent(mortal):
    fleet, gw = mortal
    ledger = Ledger(fleet.redis_url, gw.http, "acme")
    with httpx.Client(base_url=f"http://{gw.http}", headers=bearer("acme"), timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"model": gw.model, **LONG}) as response:
            lines = response.iter_lines()
            payloads = read_events(lines, 3)
            fleet.launcher.kill("mixed-0")
            payloads += data_lines(lines)
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2])["error"]["type"] == "service_unavailable"
    sent = tokens_in(payloads)
    assert 3 <= sent < 2000
    assert ledger.settles_at(sent), (sent, ledger.charged())
    assert metric(scrape(gw.http), "kvfleet_requests_total", tenant="acme", outcome="error") == 1

    # with no worker left the router refuses the next request: a rejection by its reason and
    # stage, and no request is left counted as active
    assert wait_until(lambda: fleet.router_stub().Health(pb.HealthRequest()).status ==
                      pb.HealthResponse.NOT_SERVING, 5)
    with httpx.Client(base_url=f"http://{gw.http}", headers=bearer("acme"), timeout=30) as c:
        assert c.post("/v1/completions", json={"model": gw.model, "prompt": PROMPT}
                      ).status_code == 503
    samples = scrape(gw.http)
    assert metric(samples, "kvfleet_rejections_total", reason="UNAVAILABLE",
                  stage="S0_NORMAL", traffic_class="interactive") == 1
    assert metric(samples, "kvfleet_requests_total", tenant="acme", outcome="rejected") == 1
    assert metric(samples, "kvfleet_tenant_active_requests", tenant="acme") == 0
    # no generated token is charged for it; its prompt was, at quota admission (quota.py)
    assert ledger.charged() == (sent + len(PROMPT), sent)
