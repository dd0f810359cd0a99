"""Internal calls are authenticated: a process on the host that calls the router or a worker
directly, skipping the gateway (its API keys and quotas), gets UNAUTHENTICATED and is served
nothing. The fleet itself, which `Launcher` hands one token, serves end to end; the token shows
up in no log and no command line.

A real disaggregated fleet on 127.0.0.1 (redis-server, prefill, decode, router), shared by the
module.
"""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import ExitStack

import grpc
import pytest

from services.protocol import fleet_token
from services.protocol.fleet_token import FleetAuth, FleetTokenError
from services.cli.launcher import Launcher
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from tests.harness import route_request, running_fleet, token_channel

PROMPT = list(range(1, 40))
NO_TOKEN = FleetAuth()                       # a caller that presents none
WRONG = FleetAuth(fleet_token.generate())    # a caller that guesses


@pytest.fixture(scope="module")
def fleet(redis_url, tiny_model_dir):
    with running_fleet(redis_url, str(tiny_model_dir), "disagg") as f:
        yield f


def reserve(rid: str) -> pb.ReserveRequest:
    return pb.ReserveRequest(request_id=rid, prompt_token_ids=PROMPT,
                             params=pb.SamplingParams(max_tokens=8, temperature=0))


def nothing_held(fleet) -> bool:
    return all(fleet.stats(name).kv_blocks_reserved == 0 and fleet.stats(name).num_running == 0
               for name in fleet.workers)


# ------------------------------------------------------------------------------------- gRPC
@pytest.mark.parametrize("caller", [NO_TOKEN, WRONG], ids=["no-token", "wrong-token"])
def test_every_grpc_method_of_the_router_and_the_workers_asks_for_the_fleet_token(fleet, caller):
    with ExitStack() as stack:
        def stub(kind, address):
            return kind(stack.enter_context(token_channel(address, caller)))
        router = stub(pb_grpc.RouterStub, fleet.router)
        decode = stub(pb_grpc.WorkerStub, fleet.workers["decode-0"])
        prefill = stub(pb_grpc.WorkerStub, fleet.workers["prefill-0"])
        calls = {
            "router Health": lambda: router.Health(pb.HealthRequest(), timeout=5),
            "router Admit": lambda: router.Admit(route_request("in", PROMPT, 4), timeout=5),
            "decode Health": lambda: decode.Health(pb.HealthRequest(), timeout=5),
            "decode Stats": lambda: decode.Stats(pb.StatsRequest(), timeout=5),
            "decode Reserve": lambda: decode.Reserve(reserve("in"), timeout=5),
            "decode DecodeStream": lambda: list(decode.DecodeStream(
                iter([pb.DecodeSubscribe(request_id="in")]), timeout=5)),
            "decode Cancel": lambda: decode.Cancel(pb.CancelRequest(request_id="in"), timeout=5),
            "prefill Health": lambda: prefill.Health(pb.HealthRequest(), timeout=5),
            "prefill Prefill": lambda: list(prefill.Prefill(pb.PrefillRequest(), timeout=5)),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            why = "wrong fleet token" if caller is WRONG else "no fleet token presented"
            assert why in e.value.details(), (name, e.value.details())
    assert nothing_held(fleet)                       # no Reserve or Generate got through


# ------------------------------------------------------------------------- the fleet itself
def test_the_fleet_serves_end_to_end_with_its_token_and_shows_it_nowhere(fleet):
    chunks = list(fleet.generate(route_request("own", PROMPT, 6, ignore_eos=True)))
    assert sum(len(c.token_ids) for c in chunks) == 6
    token = fleet.auth.token
    for child in fleet.launcher.children.values():
        with open(f"/proc/{child.proc.pid}/cmdline", "rb") as f:
            assert token.encode() not in f.read(), child.name
        assert not any(token in line for line in child.lines), child.name
    for log in os.listdir(fleet.launcher.log_dir):
        with open(os.path.join(fleet.launcher.log_dir, log), errors="replace") as f:
            assert token not in f.read(), log
    assert token not in repr(fleet.auth)


def environment_without_a_token() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")}


def test_a_router_or_worker_with_no_token_refuses_to_start(redis_url, tiny_model_dir):
    for command in (["services.router", "--redis-url", redis_url],
                    ["services.cli.cli", "serve", "decode", "--model", str(tiny_model_dir)]):
        proc = subprocess.run([sys.executable, "-m", *command], env=environment_without_a_token(),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and "READY" not in proc.stdout, command
        assert "no fleet token" in proc.stderr and "--insecure-internal" in proc.stderr, command


def test_insecure_internal_is_an_explicit_opt_out_that_serves_any_local_caller(redis_url):
    launcher = Launcher()
    try:
        router = launcher.start("router", ["services.router", "--redis-url", redis_url,
                                           "--insecure-internal"])
        with token_channel(router, NO_TOKEN) as ch:
            pb_grpc.RouterStub(ch).Health(pb.HealthRequest(), timeout=5)
    finally:
        launcher.stop_all()


# ----------------------------------------------------------------- where the token comes from
def test_the_token_comes_from_the_environment_or_a_file_and_a_weak_one_is_refused(tmp_path):
    token = fleet_token.generate()
    assert FleetAuth.from_env({fleet_token.ENV_TOKEN: token}).token == token
    path = tmp_path / "token"
    path.write_text(token + "\n")
    assert FleetAuth.from_env({}, token_file=str(path)).token == token
    assert FleetAuth.from_env({fleet_token.ENV_TOKEN_FILE: str(path)}).token == token
    assert FleetAuth.from_env({}).token is None
    with pytest.raises(FleetTokenError, match="at least 16"):
        FleetAuth.from_env({fleet_token.ENV_TOKEN: "secret"})
    # Launcher children share the caller's token, or one made for them
    assert fleet_token.child_env({fleet_token.ENV_TOKEN: token}) == {fleet_token.ENV_TOKEN: token}
    assert len(fleet_token.child_env({})[fleet_token.ENV_TOKEN]) >= 40
    assert token not in repr(FleetAuth(token)) and token not in str(FleetAuth(token))
