"""A Kubernetes gRPC probe asks each kvfleet service `grpc.health.v1.Health/Check` with no fleet token:
a worker, a router and a gateway of a running (simulated) fleet answer SERVING for the server and for
their own service name, NOT_FOUND for a name they do not serve, while the kvfleet calls still demand
the token; and a worker told to stop or to drain says NOT_SERVING to a watching probe before it goes
away."""
from __future__ import annotations

import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2 as hpb
from grpc_health.v1 import health_pb2_grpc as hpb_grpc

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from tests.harness import running_fleet, start_gateway
from tests.waiting import wait_until

SERVING = hpb.HealthCheckResponse.SERVING
NOT_SERVING = hpb.HealthCheckResponse.NOT_SERVING


def probe(address: str, service: str = "") -> int:
    """What a kubelet's gRPC probe gets: a plain channel, no token."""
    with grpc.insecure_channel(address) as channel:
        return hpb_grpc.HealthStub(channel).Check(hpb.HealthCheckRequest(service=service),
                                                  timeout=5).status


def test_every_service_answers_the_standard_probe_without_the_fleet_token(redis_url, tiny_model_dir):
    with running_fleet(redis_url, str(tiny_model_dir), "disagg") as fleet:
        gateway = start_gateway(fleet, str(tiny_model_dir))
        services = {fleet.workers["prefill-0"]: "kvfleet.v1.Worker",
                    fleet.workers["decode-0"]: "kvfleet.v1.Worker",
                    fleet.router: "kvfleet.v1.Router",
                    gateway.grpc: "kvfleet.v1.Gateway"}

        for address, name in services.items():
            assert wait_until(lambda a=address: probe(a) == SERVING, 30), address
            assert probe(address, name) == SERVING
            with pytest.raises(grpc.RpcError) as unknown:
                probe(address, "kvfleet.v1.NoSuchService")
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

        with grpc.insecure_channel(fleet.workers["decode-0"]) as channel:    # no token
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.WorkerStub(channel).Health(pb.HealthRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

        # a worker told to stop (SIGTERM) or to drain (SIGUSR1, `kvfleet rebalance`) says
        # NOT_SERVING to a watching probe before it goes
        assert NOT_SERVING in watch_through_stop(fleet, "prefill-0", signal.SIGTERM)[1:]
        assert NOT_SERVING in watch_through_stop(fleet, "decode-0", signal.SIGUSR1)[1:]


def watch_through_stop(fleet, name: str, how: signal.Signals) -> list[int]:
    """Statuses a Watch on worker `name` streams from SERVING until the worker, sent `how`, ends."""
    with grpc.insecure_channel(fleet.workers[name]) as channel:
        watch = hpb_grpc.HealthStub(channel).Watch(hpb.HealthCheckRequest(service=""), timeout=30)
        seen = [next(watch).status]
        assert seen == [SERVING]
        fleet.launcher.children[name].proc.send_signal(how)
        try:
            for update in watch:
                seen.append(update.status)
        except grpc.RpcError:
            pass          # the server went away after saying it: the stream ends
    return seen
