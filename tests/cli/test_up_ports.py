"""`kvfleet up --port-base P`: every listener of the fleet on P + its table offset
(services/cli/ports.py), printed in the banner; a taken port refuses the start, naming the port,
with nothing left running. Real processes on 127.0.0.1; deadlines, no fixed sleeps."""
from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import uuid

import httpx

from services.cli import ports
from services.cli.launcher import running
from tests.waiting import wait_until
from services.cli.up import add_up_args, port_plan
from services.protocol.timeouts import SHUTDOWN_BUDGET_S
from tests.cli.test_up import listening_ports, port_open
from loadtests.local_fleet import up_command
from tests.harness import KV_CACHE_MIB, up_fleet


def up_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_up_args(parser)
    return parser.parse_args(list(argv))


def ephemeral_from() -> int:
    """The first port of the kernel's ephemeral range: any process's outgoing connection may take
    one above it at any moment (many, with the suite's workers and fleets running at once)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def free_base(*argv: str) -> tuple[int, list[ports.Listener]]:
    """A --port-base whose every planned port is free now, below the ephemeral range, so only a
    process binding a port of its own choice can still take one before the fleet does."""
    for _ in range(50):
        base = random.randrange(20000, max(ephemeral_from() - ports.SPAN, 20100), 100)
        plan = port_plan(up_args("--port-base", str(base), *argv), embedded_redis=True)
        if ports.taken(plan) is None:
            return base, plan
    raise AssertionError("no free --port-base block found in 50 tries")


def processes_with(marker: str) -> list[int]:
    """Live processes whose environment holds `marker` (every child of `up` inherits it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read() and running(int(pid)):
                    found.append(int(pid))
        except OSError:
            continue
    return found


def up_options(marker: str) -> dict:
    """up_fleet's keywords for a fleet on a --port-base (no --http-port / --grpc-port:
    the table places the gateway too), every process of it marked by `marker`."""
    return dict(http_port=None, grpc_port=None, env={"KVFLEET_TEST_MARKER": marker})


def test_the_table_depends_only_on_the_base_role_index_and_kind():
    small = {(x.service, x.kind): x.port for x in port_plan(up_args("--port-base", "30000"), True)}
    big = {(x.service, x.kind): x.port for x in port_plan(
        up_args("--port-base", "30000", "--prefill", "3", "--decode", "2", "--routers", "4"), True)}
    assert small.items() <= big.items()              # more services move no port of the others
    assert big[("gateway", "http")] == 30000 and big[("redis", "redis")] == 30002
    assert big[("router-3", "metrics")] == 30023
    assert big[("prefill-2", "kv")] == 30052 and big[("decode-1", "grpc")] == 30061
    assert len(set(big.values())) == len(big)         # no port twice
    pinned = {(x.service, x.kind): x.port for x in port_plan(
        up_args("--port-base", "30000", "--http-port", "8123"), False)}
    assert pinned[("gateway", "http")] == 8123 and ("redis", "redis") not in pinned


def test_every_listener_is_on_its_table_port_and_printed(tiny_model_dir):
    base, plan = free_base()
    marker = uuid.uuid4().hex
    with up_fleet(tiny_model_dir, "--port-base", str(base), "--served-model-name", "fleet-a",
                    "fleet-b", **up_options(marker)) as up:
        tree = [pid for pid in up.tree()[1:] if running(pid)]
        printed = {(service, kind): address for service, kind, address in up.listeners}
        planned = {(x.service, x.kind): x.address for x in plan}
        assert printed == planned, "\n".join(up.lines)
        assert all(port_open(x.port) for x in plan), "\n".join(up.lines)
        # nothing of the fleet listens anywhere else
        assert listening_ports([up.proc.pid, *tree]) == {x.port for x in plan}
        assert f"http://127.0.0.1:{base}/v1" in "\n".join(up.lines)
        models = httpx.get(f"http://127.0.0.1:{base}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models][:2] == ["fleet-a", "fleet-b"]
        r = httpx.post(f"http://127.0.0.1:{base}/v1/completions", timeout=60, json={
            "model": "fleet-b", "prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text        # prefill -> KV on its table port -> decode
        os.kill(up.proc.pid, signal.SIGTERM)
        assert up.proc.wait(timeout=SHUTDOWN_BUDGET_S + 10) == 0
        assert wait_until(lambda: not any(map(port_open, (x.port for x in plan))), 5)


def test_a_taken_port_is_named_and_nothing_is_left_running(tiny_model_dir):
    base, plan = free_base()
    busy = next(x for x in plan if (x.service, x.kind) == ("decode-0", "kv"))
    marker = uuid.uuid4().hex
    with socket.create_server(("127.0.0.1", busy.port)):
        options = up_options(marker)
        out = subprocess.run(up_command(str(tiny_model_dir), "--port-base", str(base),
                                        kv_cache_mib=KV_CACHE_MIB, http_port=None,
                                        grpc_port=None), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=60,
                             env={**os.environ, **options["env"]})
    assert out.returncode != 0
    assert f"port {busy.port} (decode-0 kv" in out.stdout and "already in use" in out.stdout, \
        out.stdout
    assert "READY" not in out.stdout
    assert not processes_with(marker)
    assert not any(port_open(x.port) for x in plan if x != busy)
