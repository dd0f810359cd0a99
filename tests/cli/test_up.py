"""`kvfleet up` as a user runs it: the whole fleet on loopback, a real request through the REST
API, then SIGTERM stops every child and closes every port."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from services.cli.launcher import wait_until
from services.state.redis_server import free_port


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


@pytest.mark.parametrize("mode", ["disagg", "colocated"])
def test_up_serves_then_stops_everything_it_started(tiny_model_dir, mode):
    http, grpc_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli.cli", "up", "--model", str(tiny_model_dir),
         "--mode", mode, "--http-port", str(http), "--grpc-port", str(grpc_port),
         "--kv-cache-mib", "32"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("READY up"):
                break
        assert any(f"http://127.0.0.1:{http}/v1" in l for l in lines), lines
        kids = children_of(proc.pid)
        assert len(kids) == (3 if mode == "colocated" else 4)   # workers + router + gateway
        name = httpx.get(f"http://127.0.0.1:{http}/v1/models").json()["data"][0]["id"]
        r = httpx.post(f"http://127.0.0.1:{http}/v1/completions", timeout=60,
                       json={"model": name, "prompt": "Hello fleet", "max_tokens": 5,
                             "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert wait_until(lambda: not any(_alive(k) for k in kids), 5)
        assert not port_open(http) and not port_open(grpc_port)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
