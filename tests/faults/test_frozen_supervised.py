"""`kvfleet up` leaves nothing behind when it is killed, and restarts a child that froze.

Real supervised fleets (`kvfleet up` as an operator runs it, real processes, real redis-server):

  - kill -9 of `kvfleet up` itself: every process it started (workers, their engine cores,
    routers, the gateway) is gone and every port its banner listed is free again, within a
    deadline (each child has a parent-death signal);
  - a prefill worker frozen (SIGSTOP) with streams arriving: every stream completes on the other
    prefill worker, and the supervisor, its health probe unanswered for unresponsive_s,
    SIGKILLs and restarts it;
  - a decode worker's engine core frozen: the gateway's /health turns 503 within engine_stall_s
    and a beat (the fleet's only decode worker left it), requests meanwhile are refused fast with
    503, and the supervisor restarts the worker (the frozen core goes with its process group).
Assertions are on outcomes, each waited for with a deadline.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket

import httpx
import pytest

from services.cli.launcher import descendants, running
from services.cli.up import Banner
from tests.faults.fault_fleet import engine_config, exit_said, stream_chat, supervised_fleet
from tests.harness import engine_core_pid, holds_nothing, serves
from tests.waiting import wait_until

STALL_S = 2.0
FAST = ("--prefill", "2", "--decode", "1", "--timeout-engine-stall-s", str(STALL_S),
        "--timeout-prefill-start-s", "2", "--timeout-unresponsive-s", "6")


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return engine_config(tmp_path_factory.mktemp("frozen"))


def listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, int(port))) == 0


def described(pid: int) -> str:
    """A live process as a failure message names it: pid, state and command line."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        with open(f"/proc/{pid}/status") as f:
            state = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("State:")), "?")
    except OSError:
        return f"{pid} (gone)"
    return f"{pid} [{state}] {command}"


def test_kill_9_of_kvfleet_up_leaves_no_process_and_no_port(redis_url, tiny_model_dir, config):
    with supervised_fleet(redis_url, str(tiny_model_dir), config) as fleet:
        tree = descendants(fleet.proc.pid)
        addresses = [address for _, _, address in Banner(fleet.lines).listeners]
        assert len(tree) >= 5 and len(addresses) >= 6, (tree, addresses)  # cores and workers ...
        assert all(listening(a) for a in addresses)
        fleet.proc.send_signal(signal.SIGKILL)
        fleet.proc.wait()
        assert wait_until(lambda: not any(running(pid) for pid in tree), 15), \
            [described(pid) for pid in tree if running(pid)]
        assert wait_until(lambda: not any(listening(a) for a in addresses), 15), \
            [a for a in addresses if listening(a)]


def gateway_health(fleet) -> int:
    try:
        return httpx.get(f"{fleet.url}/health", timeout=10).status_code
    except httpx.HTTPError:
        return 0


def restarted(fleet, name: str, old_pid: int) -> bool:
    return wait_until(lambda: fleet.pid(name) not in (None, old_pid), 40)


def thaw(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass                                 # killed meanwhile (what the supervisor does)


@pytest.fixture(scope="module")
def fleet(redis_url, tiny_model_dir, config):
    with supervised_fleet(redis_url, str(tiny_model_dir), config, args=FAST) as f:
        yield f


def test_a_frozen_prefill_worker_is_routed_around_then_restarted(fleet):
    assert serves(fleet, 60)
    victim = fleet.pid("prefill-0")
    os.kill(victim, signal.SIGSTOP)
    try:
        async def streams():
            async with httpx.AsyncClient(base_url=fleet.url, timeout=60) as client:
                return await asyncio.gather(*(stream_chat(client, fleet.model, max_tokens=8)
                                              for _ in range(4)))
        results = asyncio.run(streams())
        assert all(r.finish_reason == "length" and r.completion_tokens == 8 for r in results), \
            results
        assert restarted(fleet, "prefill-0", victim), "\n".join(fleet.lines[-20:])
    finally:
        thaw(victim)
    assert any("prefill-0 has not answered its health check" in line for line in fleet.lines)
    assert "prefill-0 exited with status -9 " in exit_said(fleet, "prefill-0"), \
        "\n".join(fleet.lines[-20:])
    assert serves(fleet, 60) and wait_until(lambda: holds_nothing(fleet), 30)


def test_a_frozen_decode_engine_core_is_seen_refused_fast_and_restarted(fleet):
    assert serves(fleet, 60) and gateway_health(fleet) == 200
    worker = fleet.pid("decode-0")
    core = engine_core_pid(worker)
    os.kill(core, signal.SIGSTOP)
    try:
        assert wait_until(lambda: gateway_health(fleet) == 503, STALL_S + 10)
        r = httpx.post(f"{fleet.url}/v1/completions", timeout=30, json={
            "model": fleet.model, "prompt": "anyone?", "max_tokens": 2})
        assert r.status_code == 503 and "Retry-After" in r.headers, r.text
        assert restarted(fleet, "decode-0", worker), "\n".join(fleet.lines[-20:])
    finally:
        thaw(core)
    assert not running(core)                 # went with its worker's process group
    assert any("decode-0 has not answered its health check" in line for line in fleet.lines)
    assert serves(fleet, 60) and wait_until(lambda: holds_nothing(fleet), 30)
