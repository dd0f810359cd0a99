"""`kvfleet rebalance --target local` on a real `kvfleet up` (simulated engine cores: no weights,
real processes, Redis, gRPC and KV over tcp): the policy adds a decode worker when ITL breaks its
target, a dry run changes nothing, a drain lets the stream in flight on the drained worker finish,
and every decision is a line of the audit log."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from services.protocol.fleet_token import ENV_TOKEN
from services.state import redis_auth
from services.state.fleet_state import FleetState
from tests.harness import up_fleet
from tests.waiting import wait_until

TOKEN = "rebalance-story-token-0123456789"
SIM = ["--engine", "sim", "--sim-step-ms", "20", "--sim-kv-tokens", "65536",
       "--sim-output-len", "fixed:100000", "--sim-network-gbps", "100"]
DEADLINE_S = 120


def rebalance(up, audit: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, ENV_TOKEN: TOKEN, redis_auth.ENV_PASSWORD: up.redis_password}
    return subprocess.run([sys.executable, "-m", "services.cli.cli", "rebalance", "--target",
                           "local", "--redis-url", up.redis_url, "--audit-log", audit, "--json",
                           "--budget", "3", "--cooldown-s", "0", *args],
                          capture_output=True, text=True, env=env, timeout=300)


def live(up) -> dict[str, object]:
    async def read():
        state = FleetState(up.redis_url)
        try:
            return {w.worker_id: w for w in await state.live_workers()}
        finally:
            await state.close()
    return asyncio.run(read())


def wait_for(what, deadline_s: float = DEADLINE_S) -> None:
    """Until `what()` holds (its docstring says what is awaited), at most `deadline_s`."""
    assert wait_until(what, deadline_s, interval_s=0.1), f"not within {deadline_s} s: {what.__doc__}"


def decision(out: subprocess.CompletedProcess, pool: str) -> dict:
    assert out.returncode == 0, out.stderr
    line = json.loads(out.stdout.strip().splitlines()[-1])
    return next(d for d in line["decisions"] if d["pool"] == pool) | {"_line": line}


@pytest.fixture
def fleet(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(ENV_TOKEN, TOKEN)       # this process reads the fleet's signed records
    with up_fleet(tiny_model_dir, *SIM, mode="disagg", token=TOKEN) as up:
        yield up


def stream(client, model: str, tokens: int) -> tuple[str | None, int]:
    chunks = list(client.completions.create(model=model, prompt="rebalance me", max_tokens=tokens,
                                            stream=True, stream_options={"include_usage": True}))
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    return reasons[-1], chunks[-1].usage.completion_tokens


def test_rebalance_adds_a_decode_worker_then_drains_one_while_its_stream_finishes(fleet, tmp_path):
    up, audit = fleet, str(tmp_path / "audit.jsonl")
    client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id

    # traffic whose ITL (a 20-ms step) breaks a 1-ms target: the policy wants one decode more
    stop, failures = threading.Event(), []

    def traffic():
        while not stop.is_set():
            reason, _ = stream(client, model, 8)
            if reason != "length":
                failures.append(reason)
    background = threading.Thread(target=traffic, daemon=True)
    background.start()
    try:
        grown = decision(rebalance(up, audit, "--apply", "--window-s", "3", "--itl-p99-s", "0.001"),
                         "decode")
    finally:
        stop.set()
        background.join(timeout=60)
    assert not failures
    assert (grown["current"], grown["recommended"], grown["reason"]) == (1, 2, "itl_p99")
    [order] = grown["_line"]["orders"]
    assert order["accepted"] and order["worker_id"] == "decode-1", order
    assert {"decode-0", "decode-1"} <= set(live(up))

    # idle: the policy would shrink decode again, but a dry run changes nothing
    dry = decision(rebalance(up, audit, "--dry-run", "--window-s", "2"), "decode")
    assert (dry["current"], dry["recommended"], dry["reason"]) == (2, 1, "utilization_low")
    assert {"decode-0", "decode-1"} <= set(live(up))

    # streams in flight on both decode workers; decode-1 is drained under them
    results: list[tuple[str | None, int]] = []
    streams = [threading.Thread(target=lambda: results.append(stream(client, model, 120)))
               for _ in range(4)]
    for t in streams:
        t.start()

    def both_decoding():
        """both decode workers hold a running stream"""
        w = live(up)
        return all(w.get(name) and w[name].num_running for name in ("decode-0", "decode-1"))
    wait_for(both_decoding)
    drained = decision(rebalance(up, audit, "--apply", "--replicas", "decode=1", "--window-s",
                                 "0.5"), "decode")
    assert (drained["recommended"], drained["reason"]) == (1, "manual")
    [order] = drained["_line"]["orders"]
    assert order["action"] == "drain" and order["worker_id"] == "decode-1" and order["accepted"]
    assert "decode-1" not in live(up)               # no new work goes to it
    for t in streams:
        t.join(timeout=DEADLINE_S)
    assert results == [("length", 120)] * 4        # every stream finished, none failed

    def drained_line():
        """kvfleet up says decode-1 drained and exited"""
        return any("decode-1 drained and exited with status 0" in line for line in up.lines)
    wait_for(drained_line)
    assert "decode-1" not in live(up) and "decode-0" in live(up)

    # advisory: decides every window, exports its recommendation, changes nothing
    exported = advisory(up, audit)
    assert 'kvfleet_rebalance_replicas{kind="current",pool="decode"} 1.0' in exported
    assert 'kvfleet_rebalance_decision_info{pool="decode",reason=' in exported

    lines = [json.loads(x) for x in open(audit)]
    assert [x["mode"] for x in lines] == ["apply", "dry-run", "apply", "advisory", "advisory"]
    assert [x["changed"] for x in lines][:3] == [True, True, True]
    assert all({"decisions", "config", "at_unix_s", "window_s"} <= set(x) for x in lines)
    assert "orders" not in lines[1] and "orders" not in lines[3]   # only --apply gives orders
    assert {"decode-0", "prefill-0"} == set(live(up))


def advisory(up, audit: str) -> str:
    """Run `--advisory` for two windows; its /metrics page once it holds a decision."""
    env = {**os.environ, ENV_TOKEN: TOKEN, redis_auth.ENV_PASSWORD: up.redis_password}
    proc = subprocess.Popen([sys.executable, "-m", "services.cli.cli", "rebalance", "--advisory",
                             "--redis-url", up.redis_url, "--audit-log", audit, "--json",
                             "--window-s", "1", "--decisions", "2", "--cooldown-s", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = proc.stdout.readline().split("metrics at ")[1].split(";")[0]
        assert json.loads(proc.stdout.readline())["mode"] == "advisory"   # the first decision
        page = httpx.get(url, timeout=10).text
        assert proc.wait(timeout=DEADLINE_S) == 0
        return page
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_orders_go_only_to_a_fleet_that_runs_its_workers_the_targets_way(redis_url):
    import redis as redis_sync

    from services.cli import fleet_orders as fo
    from services.cli.rebalance_cmd import NAMESPACE, check_launcher
    client = redis_sync.Redis.from_url(redis_url)
    key = NAMESPACE + fo.LAUNCHER_KEY
    try:
        client.delete(key)
        check_launcher(redis_url, "local")            # a fleet from before the key: local
        with pytest.raises(ValueError, match="no kvfleet up --ray"):
            check_launcher(redis_url, "ray")
        client.set(key, "local")
        with pytest.raises(ValueError, match="use --target local"):
            check_launcher(redis_url, "ray")
        client.set(key, "ray")
        check_launcher(redis_url, "ray")
        with pytest.raises(ValueError, match="use --target ray"):
            check_launcher(redis_url, "local")
    finally:
        client.delete(key)
        client.close()
