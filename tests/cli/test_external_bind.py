"""A router or a worker listens on loopback only, unless the operator opts in with
--allow-external-bind (the chart does, for its pods' IPs): started without it on another address,
each exits at once with one line naming the flag, before it binds or loads anything."""
from __future__ import annotations

import subprocess
import sys

import pytest

from services.protocol import bind

NOT_LOOPBACK = "10.1.2.3"       # never bound: the check refuses it first


@pytest.mark.parametrize("command", [
    ["services.router", "--redis-url", "redis://127.0.0.1:1/0"],
    ["services.cli.cli", "serve", "decode", "--model", "tiny", "--redis-url",
     "redis://127.0.0.1:1/0"],
], ids=["router", "worker"])
def test_a_service_refuses_a_non_loopback_host_by_default(command):
    out = subprocess.run([sys.executable, "-m", *command, "--host", NOT_LOOPBACK],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"loopback only unless --allow-external-bind is given; got --host {NOT_LOOPBACK}" \
        in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_loopback_needs_no_opt_in(host):
    bind.check(host, False, "a worker")
    assert bind.metrics_host(host, False) == "127.0.0.1"


def test_with_the_opt_in_metrics_listen_beside_the_grpc_port():
    bind.check(NOT_LOOPBACK, True, "a worker")
    assert bind.metrics_host(NOT_LOOPBACK, True) == NOT_LOOPBACK
