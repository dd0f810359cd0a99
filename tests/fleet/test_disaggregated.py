"""A disaggregated fleet (router, prefill and decode worker processes, real Redis, KV over TCP or
NIXL) serves the in-process engine's greedy tokens, the first from the prefill worker and the rest
from the decode worker (the router relays none); cancellation frees everything on both workers;
killed workers end streams with an error and the fleet keeps serving."""
from __future__ import annotations

import time

import pytest

from tests.waiting import wait_until
from services.protocol import status
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.engine.engine import LLMEngine, engine_config
from services.engine.sampling_params import SamplingParams
from tests.harness import engine_flags, listening_sockets, route_request, running_fleet

PROMPT = [4080, 39, 72, 311, 464, 68] + list(range(600, 660))   # 66 tokens: 5 blocks of 16


def reference(model_dir: str, n: int) -> list[int]:
    engine = LLMEngine(engine_config(model_dir, kv_cache_mib=8))
    (out,) = engine.generate([PROMPT], SamplingParams(max_tokens=n, temperature=0.0,
                                                      ignore_eos=True))
    return out.token_ids


def serving(fleet) -> bool:
    return fleet.router_stub().Health(pb.HealthRequest()).status == pb.HealthResponse.SERVING


def idle(fleet, *names) -> bool:
    stats = [fleet.stats(n) for n in names]
    return all(s.kv_blocks_used == 0 and s.kv_blocks_reserved == 0 for s in stats)


@pytest.mark.real_model("the fleet's tokens equal the in-process engine's greedy tokens")
@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_greedy_tokens_through_the_fleet_equal_the_engine(redis_url, tiny_model_dir, backend):
    with running_fleet(redis_url, str(tiny_model_dir), "disagg", kv_backend=backend,
                       engine="real") as fleet:
        assert wait_until(lambda: serving(fleet), 10)
        chunks = list(fleet.generate(
            route_request(f"d-{backend}", PROMPT, 16, ignore_eos=True)))
        assert chunks[0].served_by == "prefill-0" and len(chunks[0].token_ids) == 1
        assert {c.served_by for c in chunks[1:]} == {"decode-0"}
        assert chunks[-1].finished and chunks[-1].finish_reason == "length"
        assert [t for c in chunks for t in c.token_ids] == reference(str(tiny_model_dir), 16)
        assert all(c.text == "" for c in chunks)       # ids only: the gateway makes the text
        assert wait_until(lambda: idle(fleet, "prefill-0", "decode-0"), 1.0)


@pytest.fixture(scope="module")
def fleet(redis_url, tiny_model_dir):
    # on the simulated core, 50 ms steps: a 3000-token prompt's 12 prefill chunks take a while,
    # as on the tiny model, so a test can cancel during its prefill
    with running_fleet(redis_url, str(tiny_model_dir), "disagg", prefill=2, decode=2,
                       worker_args=engine_flags(64, step_ms=50)) as f:
        assert wait_until(lambda: serving(f) and len(f.workers) == 4, 10)
        yield f


ALL = ("prefill-0", "prefill-1", "decode-0", "decode-1")


def test_cancel_during_decode_frees_both_workers(fleet):
    call = fleet.generate(route_request("cancel-decode", PROMPT, 3000,
                                                      ignore_eos=True))
    stream = iter(call)
    next(stream), next(stream)                           # first token, then decode tokens
    call.cancel()
    assert wait_until(lambda: idle(fleet, *ALL), 1.0)


def test_cancel_during_prefill_frees_both_workers(fleet):
    long_prompt = list(range(100, 3100))                  # ~3000 tokens: prefill takes a while
    call = fleet.generate(route_request("cancel-prefill", long_prompt, 10))
    call.start()                                          # admitted: reserved, prefill under way
    assert wait_until(lambda: any(fleet.stats(n).num_running or fleet.stats(n).num_queued
                                  for n in ("prefill-0", "prefill-1")), 5.0)
    call.cancel()
    assert wait_until(lambda: idle(fleet, *ALL), 1.0)


def test_cancel_right_after_the_first_token_during_the_kv_transfer_frees_both_workers(fleet):
    # the prefill worker streams the first token, then writes the prompt's KV (here ~8 MB for
    # 4,000 tokens) into the decode reservation: a client that hangs up on the first token
    # cancels while that transfer runs or before decode starts
    long_prompt = [100 + i % 3900 for i in range(4000)]
    call = fleet.generate(route_request("cancel-kv", long_prompt, 50,
                                                      ignore_eos=True))
    first = next(iter(call))
    assert first.served_by.startswith("prefill") and len(first.token_ids) == 1
    call.cancel()
    assert wait_until(lambda: idle(fleet, *ALL), 1.0)


def test_an_answer_that_ends_at_the_first_token_releases_the_reservation(fleet):
    chunks = list(fleet.generate(route_request("one", PROMPT, 1)))
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert sum(len(c.token_ids) for c in chunks) == 1
    assert wait_until(lambda: idle(fleet, *ALL), 1.0)


def test_a_request_id_can_be_reserved_again_once_its_reservation_was_released(fleet):
    """A released reservation gives up its KV expectation too: a client-chosen id may come back."""
    with fleet.channel(fleet.workers["decode-0"]) as ch:
        worker = pb_grpc.WorkerStub(ch)
        ask = pb.ReserveRequest(request_id="again", prompt_token_ids=PROMPT,
                                params=pb.SamplingParams(max_tokens=4))
        for _ in range(2):
            assert worker.Reserve(ask, timeout=10).accepted
            assert worker.Cancel(pb.CancelRequest(request_id="again"), timeout=10).cancelled
    assert wait_until(lambda: idle(fleet, *ALL), 1.0)


def test_bad_request_is_invalid_argument_with_the_engines_code(fleet):
    with pytest.raises(status.CallFailed) as info:
        list(fleet.generate(route_request("bad", [1, 999999], 4)))
    st = info.value.status
    assert st.reason == pb.INVALID_REQUEST and st.code == "token_out_of_vocab"
    assert "token" in st.message


def test_the_plan_names_the_workers_and_the_router_is_on_no_token_path(fleet):
    call = fleet.generate(route_request("planned", PROMPT, 6, ignore_eos=True))
    chunks = list(call)
    plan = call.run.plan
    assert plan.mode == pb.Plan.DISAGGREGATED and plan.router_id == "router"
    assert plan.decode.worker_id in ("decode-0", "decode-1") and plan.target.block_ids
    assert chunks[0].served_by == plan.prefill[0].worker_id
    assert {c.served_by for c in chunks[1:]} == {plan.decode.worker_id}


def test_nothing_listens_off_loopback(fleet):
    list(fleet.generate(route_request("warm", PROMPT, 4)))   # KV has moved
    pids = [child.proc.pid for child in fleet.launcher.children.values()]
    listening = listening_sockets(pids)
    assert listening, "found no listening socket at all: the /proc parsing is broken"
    ports = {int(a.rsplit(":", 1)[1]) for a in [*fleet.routers, *fleet.workers.values()]}
    assert ports <= {port for _, port in listening}
    assert {ip for ip, _ in listening} == {"127.0.0.1"}   # gRPC and KV receivers alike


# The kill tests start fleets of their own: no test depends on another's order or on a fleet
# another test killed.

def test_a_killed_decode_worker_ends_the_stream_with_an_error_and_the_fleet_goes_on(
        redis_url, tiny_model_dir):
    with running_fleet(redis_url, str(tiny_model_dir), "disagg", prefill=1, decode=2) as fleet:
        assert wait_until(lambda: serving(fleet) and len(fleet.workers) == 3, 10)
        call = fleet.generate(route_request("victim", PROMPT, 3000, ignore_eos=True))
        stream = iter(call)
        victim = next(c.served_by for c in stream if c.served_by.startswith("decode"))
        fleet.launcher.kill(victim)
        with pytest.raises(status.CallFailed) as info:
            for _ in stream:
                pass
        assert info.value.status.reason == pb.UNAVAILABLE
        survivors = [n for n in fleet.workers if n != victim]
        assert wait_until(lambda: idle(fleet, *survivors), 2.0)
        # the dead worker's heartbeat goes stale; new requests are served by the rest
        assert wait_until(lambda: victim not in fleet.router_stub().Health(
            pb.HealthRequest()).detail, 5.0)
        chunks = list(fleet.generate(route_request("after", PROMPT, 8, ignore_eos=True)))
        assert chunks[-1].finished and sum(len(c.token_ids) for c in chunks) == 8
        assert victim not in {c.served_by for c in chunks}


def test_a_killed_prefill_worker_is_retried_on_the_plans_fallback_before_the_first_token(
        redis_url, tiny_model_dir):
    # a long heartbeat TTL keeps the dead prefill-0 listed, and it is the router's first choice
    # (equal cost, lowest id): the plan names it, its call fails, the fallback serves
    slow_ttl = ("--timeout-heartbeat-ttl-s", "20", "--timeout-engine-stall-s", "20")
    with running_fleet(redis_url, str(tiny_model_dir), "disagg", prefill=2, decode=1,
                       worker_args=slow_ttl) as fleet:
        assert wait_until(lambda: serving(fleet) and len(fleet.workers) == 3, 10)
        fleet.launcher.kill("prefill-0")
        call = fleet.generate(route_request("retry", PROMPT, 6, ignore_eos=True))
        chunks = list(call)
        assert [w.worker_id for w in call.run.plan.prefill] == ["prefill-0", "prefill-1"]
        assert chunks[0].served_by == "prefill-1"
        assert chunks[-1].finished and sum(len(c.token_ids) for c in chunks) == 6
