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
import sys
import uuid

import httpx

from services.cli import ports
from services.cli.launcher import descendants, running, wait_until
from services.cli.up import add_up_args, port_plan, read_banner
from services.protocol.timeouts import SHUTDOWN_BUDGET_S
from tests.cli.test_up import listening_ports, port_open
from tests.up_helpers import kill


def up_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_up_args(parser)
    return parser.parse_args(list(argv))


def free_base(*argv: str) -> tuple[int, list[ports.Listener]]:
    """A --port-base whose every planned port is free now (the fleet may still lose a race)."""
    for _ in range(50):
        base = random.randrange(20000, 60000, 100)
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


def start_up(model: str, base: int, marker: str, *argv: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli.cli", "up", "--model", model, "--port-base",
         str(base), "--kv-cache-mib", "32", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "KVFLEET_TEST_MARKER": marker})


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
    proc = start_up(str(tiny_model_dir), base, marker, "--served-model-name", "fleet-a", "fleet-b")
    tree: list[int] = []
    try:
        banner = read_banner(proc.stdout)
        tree = [pid for pid in descendants(proc.pid) if running(pid)]
        printed = {(service, kind): address for service, kind, address in banner.listeners}
        planned = {(x.service, x.kind): x.address for x in plan}
        assert printed == planned, "\n".join(banner.lines)
        assert all(port_open(x.port) for x in plan), "\n".join(banner.lines)
        # nothing of the fleet listens anywhere else
        assert listening_ports([proc.pid, *tree]) == {x.port for x in plan}
        assert f"http://127.0.0.1:{base}/v1" in "\n".join(banner.lines)
        models = httpx.get(f"http://127.0.0.1:{base}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models][:2] == ["fleet-a", "fleet-b"]
        r = httpx.post(f"http://127.0.0.1:{base}/v1/completions", timeout=60, json={
            "model": "fleet-b", "prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text        # prefill -> KV on its table port -> decode
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=SHUTDOWN_BUDGET_S + 10) == 0
        assert wait_until(lambda: not any(map(port_open, (x.port for x in plan))), 5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in tree:
            kill(pid)


def test_a_taken_port_is_named_and_nothing_is_left_running(tiny_model_dir):
    base, plan = free_base()
    busy = next(x for x in plan if (x.service, x.kind) == ("decode-0", "kv"))
    marker = uuid.uuid4().hex
    with socket.create_server(("127.0.0.1", busy.port)):
        proc = start_up(str(tiny_model_dir), base, marker)
        try:
            out, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert proc.returncode != 0
    assert f"port {busy.port} (decode-0 kv" in out and "already in use" in out, out
    assert "READY" not in out
    assert not processes_with(marker)
    assert not any(port_open(x.port) for x in plan if x != busy)
