"""`kvfleet up` as a user runs it: the whole fleet on loopback, real requests through the REST API,
then SIGTERM stops every process it started and closes every port it listened on within
SHUTDOWN_BUDGET_S (3 s), even with streams in flight (R2, item 9). Time is measured against
deadlines; nothing sleeps a fixed time."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from services.cli.launcher import children, descendants, running
from tests.waiting import wait_until
from services.protocol.timeouts import SHUTDOWN_BUDGET_S
from tests.harness import up_fleet


def listening_ports(pids: list[int]) -> set[int]:
    """TCP ports in LISTEN that any of `pids` holds a socket of (from /proc)."""
    inodes = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A":                                   # TCP_LISTEN
                inodes[cols[9]] = int(cols[1].rsplit(":", 1)[1], 16)
    ports = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                ports.add(inodes[target[8:-1]])
    return ports


def port_open(port: int) -> bool:
    import socket
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def sigterm_and_time_the_end(proc: subprocess.Popen, pids: list[int], ports: set[int]) -> float:
    """SIGTERM `kvfleet up`; seconds until no process of its tree is alive and no port is open
    (SHUTDOWN_BUDGET_S + 2 at most: past the budget it only says by how much)."""
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    wait_until(lambda: proc.poll() is not None and not any(map(running, pids))
               and not any(map(port_open, ports)), SHUTDOWN_BUDGET_S + 2, interval_s=0.01)
    return time.monotonic() - t0


class InFlight:
    """`n` streaming completions that would run for a long time: each thread reads its stream until
    it ends or breaks; `started` is set once every one has had its first token."""

    def __init__(self, url: str, model: str, n: int, max_tokens: int = 4000) -> None:
        self.firsts = [threading.Event() for _ in range(n)]
        self.refused: list[str] = []              # what a stream that did not start answered
        body = {"model": model, "prompt": "tell me a long story", "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        for first in self.firsts:
            threading.Thread(target=self._read, args=(url, body, first), daemon=True).start()

    def _read(self, url: str, body: dict, first: threading.Event) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                if r.status_code != 200:
                    self.refused.append(f"{r.status_code} {r.read()[:300]!r}")
                    return
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        first.set()
        except httpx.HTTPError:
            pass                                  # the fleet went away under it: expected

    def started(self, timeout_s: float) -> bool:
        """Every stream had its first token within timeout_s (False at once if one was refused)."""
        deadline = time.monotonic() + timeout_s
        for first in self.firsts:
            while not first.wait(0.05):
                if self.refused or time.monotonic() > deadline:
                    return False
        return True


@pytest.mark.serial                     # a claim about time: run alone after the parallel run
@pytest.mark.parametrize("mode, routers", [("disagg", 2), ("colocated", 1)])
def test_up_serves_then_stops_everything_it_started(tiny_model_dir, mode, routers):
    with up_fleet(tiny_model_dir, mode=mode, routers=routers) as up:
        proc, lines, http = up.proc, up.lines, int(up.http.rsplit(":", 1)[1])
        assert len(up.routers) == routers and len(up.workers) == (1 if mode == "colocated" else 2)
        assert any(f"http://127.0.0.1:{http}/v1" in line for line in lines), lines
        assert sum(line.split()[0].startswith("router-") for line in lines if line.split()) \
            == routers
        kids = [pid for pid in descendants(proc.pid) if running(pid)]
        workers = 1 if mode == "colocated" else 2
        assert len(set(kids) & set(children(proc.pid))) == workers + routers + 1   # + gateway
        url = f"http://127.0.0.1:{http}"
        name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"model": name, "prompt": "Hello fleet", "max_tokens": 5,
                             "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        ports = listening_ports([proc.pid, *kids])
        assert http in ports
        took = sigterm_and_time_the_end(proc, kids, ports)
        assert took <= SHUTDOWN_BUDGET_S, f"{took:.2f} s\n" + "\n".join(lines[-20:])
        assert proc.wait() == 0


@pytest.mark.serial                     # a claim about time: run alone after the parallel run
def test_sigterm_with_streams_in_flight_stops_every_process_and_port_within_3_s(tiny_model_dir):
    with up_fleet(tiny_model_dir, mode="colocated", routers=2) as up:
        proc, lines, http = up.proc, up.lines, int(up.http.rsplit(":", 1)[1])
        url = f"http://127.0.0.1:{http}"
        name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        streams = InFlight(url, name, n=4)
        assert streams.started(60), ("not every stream had its first token", streams.refused,
                                     lines[-20:])
        tree = [pid for pid in descendants(proc.pid) if running(pid)]
        ports = listening_ports([proc.pid, *tree])
        # at least: the gateway (REST, gRPC), the worker, two routers, the embedded Redis
        assert len(ports) >= 6, ports
        took = sigterm_and_time_the_end(proc, tree, ports)
        left = [pid for pid in tree if running(pid)] + ([proc.pid] if proc.poll() is None else [])
        assert not left and not any(map(port_open, ports)), (left, ports, lines[-20:])
        assert took <= SHUTDOWN_BUDGET_S, f"{took:.2f} s\n" + "\n".join(lines[-20:])


def test_up_refuses_contradictory_timeouts_before_starting_anything():
    out = subprocess.run(
        [sys.executable, "-m", "services.cli.cli", "up", "--timeout-reserve-s", "9",
         "--timeout-admit-s", "5", "--timeout-heartbeat-ttl-s", "0.5"],
        capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "reserve_s (9) must be < admit_s (5)" in out.stderr, out.stderr
    assert "heartbeat_ttl_s (0.5) must be >= 2 * heartbeat_s" in out.stderr, out.stderr
    assert "READY" not in out.stdout


