"""A worker record forged in Redis gets no call: someone who can write to Redis registers a
"worker" at a gRPC server of their own, as attractive as a worker can look (idle, all its KV
free). Unsigned, or signed with another key, the router ignores it, logs it and counts it
(`kvfleet_redis_records_rejected_total`), and the foreign server sees nothing: no Reserve, no
Prefill, no fleet token, no prompt. Clients are served by the real worker.

A real co-located fleet on 127.0.0.1 (the session's password-protected redis-server, a router,
one mixed worker, a gateway); the forgery is written with a plain redis client.
"""
from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import httpx
import pytest
import redis

from services.cli.launcher import Launcher
from tests.waiting import wait_until
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.state.records import RecordSeal, record_key
from tests.harness import Fleet, Gateway, start_gateway
from tests.gateway.gateway_helpers import scrape, write_configs

NS = "kvfleet:"            # the fleet's namespace (the default)


class ForeignServer:
    """A gRPC server on 127.0.0.1 that is not part of the fleet: it records every call it gets
    (method and metadata) and answers none."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2),
                                  handlers=[self._Recorder(self)])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"

    class _Recorder(grpc.GenericRpcHandler):
        def __init__(self, outer: "ForeignServer") -> None:
            self.outer = outer

        def service(self, details):
            with self.outer._lock:
                self.outer.calls.append((details.method, dict(details.invocation_metadata)))
            return None                      # UNIMPLEMENTED

    def __enter__(self) -> "ForeignServer":
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop(0).wait()


def forged_stats(worker_id: str, address: str) -> pb.WorkerStats:
    """The most attractive worker a router could see: idle, every KV block free."""
    return pb.WorkerStats(
        worker_id=worker_id, role="mixed", grpc_address=address, kv_backend="tcp", block_size=16,
        kv_blocks_total=1_000_000, kv_blocks_free=1_000_000, prefill_tokens_per_s=1e9,
        decode_tokens_per_s=1e9, model="tiny-llama", max_model_len=40960,
        updated_at_unix_s=time.time())


def forge(client: redis.Redis, worker_id: str, value: bytes) -> None:
    client.set(f"{NS}worker:{worker_id}", value, px=120_000)
    client.sadd(f"{NS}workers", worker_id)


@pytest.fixture(scope="module")
def world(redis_url, tiny_model_dir, tmp_path_factory):
    launcher = Launcher()
    try:
        fleet = Fleet(launcher, redis_url)
        fleet.start_router("colocated")
        engine_yaml, keys_yaml = write_configs(tmp_path_factory.mktemp("forged-config"))
        fleet.worker("mixed-0", "mixed", str(tiny_model_dir), extra_args=("--config", engine_yaml))
        assert fleet.serving(10)
        gateway = start_gateway(fleet, str(tiny_model_dir), "gateway", "--config", engine_yaml,
                                "--api-keys", keys_yaml)
        yield fleet, gateway
    finally:
        launcher.stop_all()


def router_metrics_url(fleet: Fleet) -> str:
    line = next(x for x in fleet.launcher.children["router"].lines if x.startswith("METRICS "))
    return line.split()[-1]


def rejected(fleet: Fleet, reason: str) -> float:
    samples = scrape(router_metrics_url(fleet).removesuffix("/metrics").removeprefix("http://"))
    return samples.get(("kvfleet_redis_records_rejected_total",
                        frozenset({"kind": "worker", "reason": reason}.items())), 0.0)


def router_log(fleet: Fleet) -> str:
    with open(fleet.launcher.log_path("router"), errors="replace") as f:
        return f.read()


def complete(gateway: Gateway, i: int) -> httpx.Response:
    with gateway.client("acme") as c:
        return c.post("/v1/completions", json={"model": gateway.model, "prompt": f"secret {i}",
                                               "max_tokens": 2})


@pytest.mark.parametrize("forgery", ["unsigned", "bad_signature"])
def test_a_forged_worker_record_gets_no_call_and_is_logged(world, redis_url, forgery):
    fleet, gateway = world
    worker_id = f"mixed-forged-{forgery}"
    with ForeignServer() as foreign:
        payload = forged_stats(worker_id, foreign.address).SerializeToString()
        if forgery == "unsigned":
            value = payload
        else:   # sealed as the fleet seals, but with a key from a token the fleet does not use
            value = RecordSeal(record_key("not-the-fleet-token-0123456789")).seal(
                "worker", worker_id, payload)
        client = redis.Redis.from_url(redis_url)
        try:
            forge(client, worker_id, value)
            # the router reads the worker list at least once a second: a few rounds of requests
            for i in range(12):
                assert complete(gateway, i).status_code == 200
            assert wait_until(lambda: rejected(fleet, forgery) > 0, 10), router_log(fleet)
            assert foreign.calls == []
            assert f"ignoring the worker record '{worker_id}'" in router_log(fleet)
        finally:
            client.delete(f"{NS}worker:{worker_id}")
            client.srem(f"{NS}workers", worker_id)
            client.close()
