"""A worker is assembled by one function, build_worker(config, role), from the role the serve
entry picks by name (services/cli/serve_cmd.py): the roles name the calls they answer, the worker
answers any other of its role calls WRONG_ROLE, and its Health says whether the role can take
calls. A real engine core process behind a real gRPC server on 127.0.0.1."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.cli.serve_cmd import ROLES, role_named
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol import status
from services.worker.build import build_worker
from services.worker.config import ROLES as CONFIG_ROLES
from services.worker.config import WorkerConfig
from services.worker.role import RoleCalls
from tests.harness import in_process_worker

# which of the Worker service's role calls each role answers
ANSWERS = {"prefill": {"prefill"}, "decode": {"reserve", "decode_stream"}, "mixed": {"generate", "decode_stream"}}


def answered(calls: RoleCalls) -> set[str]:
    return {name for name, handler in vars(calls).items() if handler is not None}


def test_every_role_the_entry_knows_answers_its_own_calls_and_no_other():
    assert set(ROLES) == set(CONFIG_ROLES)
    for name in ROLES:
        role = role_named(name)
        assert role.name == name
        assert role.moves_kv == (name != "mixed")
        assert answered(role.calls()) == ANSWERS[name]
        assert role.readiness() == "starting"      # not started: Health says NOT_SERVING


def test_an_unknown_role_name_is_a_clear_error():
    with pytest.raises(ValueError, match="no worker role 'router'; the roles are prefill"):
        role_named("router")


def test_what_is_not_a_role_is_refused_with_a_clear_error():
    with pytest.raises(TypeError, match="build_worker needs a Role .* got str"):
        build_worker(WorkerConfig("w-0", "mixed"), "mixed")


def test_a_role_that_is_not_the_configured_one_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="configured as 'decode' but was given the 'mixed' role"):
        build_worker(WorkerConfig("w-0", "decode"), role_named("mixed"))


def test_a_built_worker_serves_its_role_refuses_the_others_and_stops(tiny_model_dir):
    async def story():
        mixed = await in_process_worker(str(tiny_model_dir), "mixed", engine="sim")
        try:
            health = await mixed.stub.Health(pb.HealthRequest(), timeout=10)
            assert health.status == pb.HealthResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await mixed.stub.Reserve(pb.ReserveRequest(request_id="r-0"), timeout=10)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            failure = status.of(refused.value)
            assert failure.reason == pb.WRONG_ROLE
            assert "has role mixed, which does not answer Reserve" in failure.message
            stats = await mixed.stub.Stats(pb.StatsRequest(), timeout=10)
            assert (stats.role, stats.grpc_address) == ("mixed", mixed.address)
        finally:
            await mixed.close()
        assert mixed.built.role.readiness() == "stopping"
        assert mixed.engine.failure is None          # closed, not failed

    asyncio.run(story())
