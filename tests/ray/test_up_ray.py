"""`kvfleet up --ray`: the fleet's services as Ray actors on a local Ray cluster bound to 127.0.0.1,
the tiny model in its workers (the greedy-text claim is about tokens). Through that fleet:
the official client gets the in-process engine's greedy text; a client that hangs up mid-decode
leaves both workers and the tenant's stream slots at zero; a decode worker killed mid-stream is
heard by every client and comes back through Ray's actor restart, on its port, and a frozen one is
killed by kvfleet up's health watch and comes back the same way; `kvfleet
rebalance --apply --target ray` adds a decode actor on its table port, which Ray's restart of it
comes back on, and drains it again; nothing listens beyond
127.0.0.1 (`ss -ltnp`); SIGTERM leaves no process and no port. One fleet for the module: a Ray
cluster and two model loads are its cost."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from services.protocol.fleet_token import ENV_TOKEN
from services.state import redis_auth
from services.state.fleet_state import FleetState
from tests.faults.fault_fleet import LEASE_3S, exit_said, stream_chat
from tests.harness import holds_nothing, open_streams, serves, up_fleet
from tests.ray.greedy import assert_engines_greedy_text
from tests.waiting import wait_until

pytest.importorskip("ray")
pytestmark = pytest.mark.real_model("the client's text equals the in-process engine's greedy text")

TOKEN = "ray-fleet-token-0123456789abcdef"
PROMPT = "A fleet of Ray actors serves the prompt"
LONG = 2000                  # tokens a stream asks for: it outlasts what the test does meanwhile
DEADLINE_S = 120
UNRESPONSIVE_15S = ("--timeout-unresponsive-s", "15")   # a frozen service is killed this late


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("ray-home")        # Ray's token and caches, not the user's
    with up_fleet(tiny_model_dir, "--ray", *LEASE_3S, *UNRESPONSIVE_15S, mode="disagg",
                  engine="real", token=TOKEN, env={"HOME": str(home)}) as up:
        yield up


@pytest.fixture
def healthy(fleet):
    assert serves(fleet, 60), "\n".join(fleet.lines[-30:])
    assert wait_until(lambda: holds_nothing(fleet), 30)
    return fleet


def listening(pids: set[int]) -> list[tuple[str, int]]:
    """(local address, pid) of every TCP listener `ss -ltnp` shows for one of `pids`."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for row in out.splitlines():
        cols = row.split()
        for pid in map(int, re.findall(r"pid=(\d+)", row)):
            if pid in pids:
                found.append((cols[3], pid))
    return found


def test_the_banner_names_the_ray_cluster_and_every_listener_is_on_its_table_port(fleet):
    [ray_line] = [line for line in fleet.lines if line.strip().startswith("ray ")]
    assert "127.0.0.1:" in ray_line and "local cluster" in ray_line
    assert {"prefill-0", "decode-0"} == set(fleet.workers)
    assert all(w.pid is not None for w in fleet.workers.values())   # found under the actors
    base = int(fleet.http.rsplit(":", 1)[1])
    assert fleet.grpc == f"127.0.0.1:{base + 1}"                    # --port-base's table
    assert fleet.workers["decode-0"].address == f"127.0.0.1:{base + 60}"


def test_nothing_of_the_fleet_or_its_ray_cluster_listens_beyond_loopback(fleet):
    tree = set(fleet.tree())
    found = listening(tree)
    assert len(found) >= len(fleet.listeners)          # ours, and Ray's own (GCS, raylet, ...)
    off = [(address, pid) for address, pid in found
           if not address.startswith(("127.0.0.1:", "[::1]:", "[::ffff:127.0.0.1]:"))]
    assert not off, off


def test_openai_client_gets_the_engines_greedy_text(healthy, tiny_model_dir):
    assert_engines_greedy_text(healthy.url, healthy.model, str(tiny_model_dir), PROMPT)


def test_hanging_up_during_decode_frees_both_workers_and_the_stream_slot(healthy):
    client = openai.OpenAI(base_url=f"{healthy.url}/v1", api_key="unused")
    stream = client.completions.create(model=healthy.model, prompt=PROMPT, max_tokens=LONG,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    assert wait_until(lambda: holds_nothing(healthy), 30)

    async def streams() -> int:
        async with FleetState(healthy.redis_url) as state:
            return await state.streams("default")
    assert wait_until(lambda: asyncio.run(streams()) == 0, 30)


async def _streams_then(fleet, n: int, action) -> list:
    """n long streams; once every one has its first token, `action`; how each ended."""
    async with httpx.AsyncClient(base_url=fleet.url, timeout=httpx.Timeout(60.0)) as client:
        firsts = [asyncio.Event() for _ in range(n)]
        tasks = [asyncio.ensure_future(stream_chat(client, fleet.model, e, max_tokens=LONG))
                 for e in firsts]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 60)
        action()
        return await asyncio.wait_for(asyncio.gather(*tasks), 90)


def test_a_decode_worker_killed_mid_stream_is_heard_and_ray_restarts_it_on_its_port(healthy):
    fleet, victim = healthy, "decode-0"
    old_pid = fleet.pid(victim)
    results = asyncio.run(_streams_then(fleet, 4, lambda: fleet.signal(victim, signal.SIGKILL)))
    for r in results:                       # every client heard an ending: an error event
        assert r.finish_reason != "abort", r
        assert r.error is not None and r.done and r.error["type"] == "service_unavailable", r
    assert wait_until(lambda: fleet.pid(victim) not in (None, old_pid), DEADLINE_S), \
        "\n".join(fleet.lines[-20:])
    assert f"{victim} exited with status -9" in exit_said(fleet, victim), \
        "\n".join(fleet.lines[-20:])
    assert wait_until(lambda: any(f"{victim} was restarted by Ray" in line
                                  for line in fleet.lines), 30)
    assert serves(fleet, DEADLINE_S), "\n".join(fleet.lines[-30:])
    # holds_nothing asks every worker at its banner address: the restarted one answers on its port
    assert wait_until(lambda: holds_nothing(fleet), 30)          # blocks and reservations back
    assert wait_until(lambda: open_streams(fleet.redis_url) == 0, 10)   # ... and stream slots


def test_a_frozen_decode_worker_is_killed_by_the_health_watch_and_restarted_by_ray(healthy):
    fleet, victim = healthy, "decode-0"
    old_pid = fleet.pid(victim)
    fleet.signal(victim, signal.SIGSTOP)          # alive, answering nothing
    assert wait_until(lambda: fleet.pid(victim) not in (None, old_pid), DEADLINE_S), \
        "\n".join(fleet.lines[-20:])
    assert any(f"{victim} has not answered its health check" in line for line in fleet.lines)
    assert serves(fleet, DEADLINE_S), "\n".join(fleet.lines[-30:])
    assert wait_until(lambda: holds_nothing(fleet), 30)


def rebalance(fleet, tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, ENV_TOKEN: TOKEN, redis_auth.ENV_PASSWORD: fleet.redis_password}
    return subprocess.run([sys.executable, "-m", "services.cli.cli", "rebalance", "--redis-url",
                           fleet.redis_url, "--audit-log", str(tmp_path / "audit.jsonl"),
                           "--json", "--budget", "3", "--cooldown-s", "0", "--window-s", "0.5",
                           *args], capture_output=True, text=True, env=env, timeout=300)


def live_workers(fleet) -> set[str]:
    async def read():
        async with FleetState(fleet.redis_url) as state:
            return {w.worker_id for w in await state.live_workers()}
    return asyncio.run(read())


def listening_ports(pid: int | None) -> set[int]:
    return {int(address.rsplit(":", 1)[1]) for address, _ in listening({pid})}


def orders(out: subprocess.CompletedProcess) -> list[dict]:
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])["orders"]


def test_rebalance_target_ray_adds_a_decode_actor_then_drains_it(healthy, tmp_path, monkeypatch):
    fleet = healthy
    monkeypatch.setenv(ENV_TOKEN, TOKEN)            # this process reads the signed records
    refused = rebalance(fleet, tmp_path, "--apply", "--target", "local", "--replicas", "decode=2")
    assert refused.returncode == 2 and "use --target ray" in refused.stderr

    [added] = orders(rebalance(fleet, tmp_path, "--apply", "--target", "ray", "--replicas",
                               "decode=2"))
    assert added["accepted"] and added["worker_id"] == "decode-1", added
    assert "serving" in added["detail"] and {"decode-0", "decode-1"} <= live_workers(fleet)
    assert fleet.pid("decode-1") is not None                  # a service under an actor

    # its ports are the table's (gRPC, /metrics, KV): Ray's restart of its actor comes back on them
    base = int(fleet.http.rsplit(":", 1)[1])
    table = {base + 61, base + 71, base + 81}
    old_pid = fleet.pid("decode-1")
    assert listening_ports(old_pid) == table
    fleet.signal("decode-1", signal.SIGKILL)
    assert wait_until(lambda: fleet.pid("decode-1") not in (None, old_pid), DEADLINE_S), \
        "\n".join(fleet.lines[-20:])
    assert wait_until(lambda: listening_ports(fleet.pid("decode-1")) == table, DEADLINE_S), \
        "\n".join(fleet.lines[-20:])
    assert wait_until(lambda: "decode-1" in live_workers(fleet), DEADLINE_S)

    [drained] = orders(rebalance(fleet, tmp_path, "--apply", "--target", "ray", "--replicas",
                                 "decode=1"))
    assert drained["action"] == "drain" and drained["worker_id"] == "decode-1"
    assert wait_until(lambda: any("decode-1 drained and exited with status 0" in line
                                  for line in fleet.lines), DEADLINE_S), "\n".join(fleet.lines[-20:])
    assert wait_until(lambda: fleet.pid("decode-1") is None, 30)    # its actor is not restarted
    assert "decode-1" not in live_workers(fleet) and "decode-0" in live_workers(fleet)
    assert serves(fleet, 60)


def test_sigterm_stops_every_actor_service_and_the_local_cluster(fleet):
    tree, ports = set(fleet.tree()), [a for a, _ in listening(set(fleet.tree()))]
    temp = next(line.split("its files in ")[1].split(";")[0] for line in fleet.lines
                if line.strip().startswith("ray "))
    fleet.proc.send_signal(signal.SIGTERM)
    assert fleet.proc.wait(timeout=60) == 0
    from services.cli.launcher import running
    assert wait_until(lambda: not any(map(running, tree)), 30), \
        [p for p in tree if running(p)]
    assert not listening(tree) and ports
    assert not os.path.exists(temp)                   # the local cluster's folder went with it
