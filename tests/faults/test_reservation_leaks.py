"""Every decode reservation has an owner who frees it, on every way a request can end early.

  - a Reserve the decode worker's engine core answers only after the router gave up on it (the
    core stopped with SIGSTOP past `reserve_s`, then let go): the router's Admit fails, and the
    blocks that Reserve could have taken are free again, with a log line that says so;
  - a burst through the gateway (REST and gRPC) where some requests are refused before their
    first token (their prompt is longer than the prefill worker's context, while the decode
    worker reserved for it) and some are cancelled at their first token: the decode worker's
    reserved blocks are back to 0 long before the reservation's 30-s TTL, and its log has no
    InvalidStateError;
  - requests that end at their first token (max_tokens 1, finished at the prefill worker) free
    their reservations as soon.

A real disaggregated fleet on 127.0.0.1 (redis-server, a router, one prefill worker whose engine
config allows a 128-token context, one decode worker with the gateway's 4096, a gateway), all
processes, KV over tcp. The waits are deadlines, not measurements.
"""
from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from services.cli.launcher import children
from tests.waiting import wait_until
from services.protocol import status
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from tests.harness import Fleet, route_request, running_fleet
from tests.gateway.gateway_helpers import ENGINE_CONFIG, KEYS, bearer
from tests.harness import start_gateway

PREFILL_CONTEXT = 128
SHORT = list(range(10, 42))                  # 32 tokens: served
LONG = list(range(10, 10 + 200))             # 200 tokens: reserved on decode, refused by prefill
FREED_WITHIN_S = 10.0                        # a third of the reservation TTL (30 s)
DECODE = "decode-0"


@pytest.fixture(scope="module")
def fleet(redis_url, tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reservation-leaks")
    wide, narrow, keys = tmp / "wide.yaml", tmp / "narrow.yaml", tmp / "keys.yaml"
    wide.write_text(yaml.safe_dump(ENGINE_CONFIG))
    narrow.write_text(yaml.safe_dump({**ENGINE_CONFIG, "max_model_len": PREFILL_CONTEXT}))
    keys.write_text(yaml.safe_dump(list(KEYS.values())))
    model = str(tiny_model_dir)
    with running_fleet(redis_url, model, "disagg", prefill=0, decode=0, routers=0) as f:
        f.worker("prefill-0", "prefill", model, extra_args=("--config", str(narrow)))
        f.worker(DECODE, "decode", model, extra_args=("--config", str(wide)))
        f.start_router("disagg")
        assert wait_until(lambda: f.router_stub().Health(pb.HealthRequest()).status ==
                          pb.HealthResponse.SERVING, 30)
        f.gateway = start_gateway(f, model, "gateway", "--config", str(wide),
                                  "--api-keys", str(keys))
        yield f


def decode_blocks(fleet: Fleet) -> tuple[int, int, int]:
    """(used, reserved, held) blocks on the decode worker, as its Stats say now."""
    s = fleet.stats(DECODE)
    return s.kv_blocks_used, s.kv_blocks_reserved, s.kv_blocks_held


def all_free(fleet: Fleet) -> bool:
    return decode_blocks(fleet) == (0, 0, 0)


def decode_log(fleet: Fleet) -> str:
    return Path(fleet.launcher.log_path(DECODE)).read_text(errors="replace")


def abandoned(fleet: Fleet) -> float:
    """kvfleet_reservations_abandoned_total on the decode worker's /metrics, all stages."""
    text = httpx.get(fleet.stats(DECODE).metrics_url, timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == "kvfleet_reservations_abandoned_total")


@contextmanager
def stopped_engine_core(fleet: Fleet):
    """The decode worker's engine core process stopped (SIGSTOP) inside the block, resumed after."""
    (core,) = children(fleet.launcher.children[DECODE].proc.pid)
    os.kill(core, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(core, signal.SIGCONT)


def test_a_reserve_the_core_answers_after_the_router_gave_up_holds_no_blocks(fleet):
    assert wait_until(lambda: all_free(fleet), FREED_WITHIN_S)
    before = abandoned(fleet)
    with stopped_engine_core(fleet):
        with pytest.raises(status.CallFailed) as refused:
            list(fleet.generate(route_request("late-reserve-1", SHORT, max_tokens=8)))
    assert refused.value.status.reason == pb.UNAVAILABLE, refused.value.status
    assert "no decode replica" in refused.value.status.message
    # the core runs the Reserve now (or refuses it, past its deadline): nothing stays taken
    assert wait_until(lambda: all_free(fleet), FREED_WITHIN_S), decode_blocks(fleet)
    assert wait_until(lambda: abandoned(fleet) == before + 1, FREED_WITHIN_S)
    assert "late-reserve-1" in decode_log(fleet)
    # and the worker serves the next request as before
    chunks = list(fleet.generate(route_request("after-late-1", SHORT, max_tokens=8)))
    assert sum(len(c.token_ids) for c in chunks) == 8


def rest(fleet: Fleet, prompt: list[int], first_only: bool, max_tokens: int = 16) -> int:
    """One streamed completion through the gateway's REST API: its status; `first_only` drops
    the connection at the first event."""
    g = fleet.gateway
    with httpx.Client(base_url=f"http://{g.http}", timeout=60, headers=bearer("acme")) as c:
        with c.stream("POST", "/v1/completions", json={
                "model": g.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True}) as r:
            if r.status_code == 200:
                for line in r.iter_lines():
                    if line.startswith("data: ") and first_only:
                        break
            else:
                r.read()
            return r.status_code


def grpc_call(fleet: Fleet, prompt: list[int], first_only: bool) -> str:
    """One Generate through the gateway's gRPC API: OK or the status code's name."""
    with grpc.insecure_channel(fleet.gateway.grpc) as channel:
        call = pb_grpc.GatewayStub(channel).Generate(pb.GenerateRequest(
            model=fleet.gateway.model, token_ids=pb.TokenIds(ids=prompt),
            params=pb.SamplingParams(max_tokens=16, ignore_eos=True)),
            metadata=(("authorization", bearer("acme")["Authorization"]),), timeout=60)
        try:
            for _ in call:
                if first_only:
                    call.cancel()
                    break
        except grpc.RpcError as e:
            return e.code().name
        return "OK"


def test_a_burst_with_refusals_and_early_cancels_frees_every_reservation_at_once(fleet):
    assert wait_until(lambda: all_free(fleet), FREED_WITHIN_S)
    jobs = [(call, prompt, first_only) for call in (rest, grpc_call)
            for prompt, first_only in ((LONG, False), (SHORT, True), (SHORT, False))] * 4
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda job: job[0](fleet, job[1], job[2]), jobs))
    refused = [r for (_, prompt, _), r in zip(jobs, results) if prompt is LONG]
    served = [r for (_, prompt, _), r in zip(jobs, results) if prompt is SHORT]
    assert refused and all(r not in (200, "OK") for r in refused), results
    assert all(r in (200, "OK") for r in served), results
    assert wait_until(lambda: all_free(fleet), FREED_WITHIN_S), decode_blocks(fleet)
    assert "InvalidStateError" not in decode_log(fleet)


def test_requests_finished_at_their_first_token_free_their_reservations_at_once(fleet):
    """max_tokens 1: the prefill worker ends the request, no KV moves, and the client reads no
    further than that last chunk."""
    assert wait_until(lambda: all_free(fleet), FREED_WITHIN_S)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: rest(fleet, SHORT, False, max_tokens=1), range(8)))
    assert results == [200] * 8
    assert wait_until(lambda: all_free(fleet), FREED_WITHIN_S), decode_blocks(fleet)
