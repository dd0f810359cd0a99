"""`kvfleet up` as an operator runs it, for fault tests: the whole supervised fleet as one process
tree on 127.0.0.1, a real redis-server (its own db), and what a test needs to break it and to
check that it healed: each child's pid (found by its command line, so it follows restarts), the
workers' Stats over gRPC with the fleet token, the tenants' Redis counters, and SSE streams."""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import httpx
import redis
import yaml

from services.protocol.fleet_token import METADATA_KEY
from services.cli.launcher import children, wait_until
from services.cli.up import read_banner
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.state.redis_server import free_port

TOKEN = "fault-suite-fleet-token-0123456789"
OUTPUT_CAP = 48           # the interactive class's output cap in these fleets
_db = itertools.count(8)


def engine_config(tmp_path) -> str:
    """The workers' and the gateway's engine YAML: default classes, but a small interactive
    output cap so that max_tokens past it is cheap to reach."""
    path = tmp_path / "engine.yaml"
    path.write_text(yaml.safe_dump({"scheduler": {"classes": [
        {"name": "interactive", "priority": 2, "ttft_target_s": 1.0, "itl_target_s": 0.1,
         "max_prompt_tokens": 8192, "output_cap": OUTPUT_CAP, "predicted_output_tokens": 32,
         "aging_s": 10.0},
        {"name": "document", "priority": 1, "ttft_target_s": 10.0, "itl_target_s": 0.1,
         "max_prompt_tokens": 32768, "output_cap": 1024, "predicted_output_tokens": 256,
         "aging_s": 10.0, "share_while_interactive_waits": 0.5}]}}))
    return str(path)


@dataclass
class UpFleet:
    proc: subprocess.Popen
    http: str
    redis_url: str
    workers: dict[str, str]
    lines: list[str] = field(default_factory=list)
    model: str = ""               # the served model name

    @property
    def url(self) -> str:
        return f"http://{self.http}"

    def children(self) -> dict[int, str]:
        """pid -> command line of each live child of `kvfleet up` (read from /proc)."""
        found = {}
        for pid in children(self.proc.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    found[pid] = f.read().replace(b"\0", b" ").decode()
            except OSError:
                continue                       # gone meanwhile
        return found

    def pid(self, name: str) -> int | None:
        """The live process serving `name` (prefill-0, decode-0, mixed-0, router-0, gateway)."""
        marks = {"gateway": "services.gateway"}
        if name.startswith("router-"):
            marks[name] = f"--router-id {name} "
        mark = marks.get(name, f"--worker-id {name} ")
        return next((pid for pid, args in self.children().items() if mark in args + " "), None)

    def signal(self, name: str, sig: int) -> int:
        pid = self.pid(name)
        assert pid is not None, f"{name} is not running"
        os.kill(pid, sig)
        return pid

    def stats(self, name: str) -> pb.WorkerStats:
        with grpc.insecure_channel(self.workers[name]) as ch:
            return pb_grpc.WorkerStub(ch).Stats(pb.StatsRequest(), timeout=5,
                                                metadata=((METADATA_KEY, TOKEN),))

    def holds_nothing(self) -> bool:
        """Every worker: no KV block in use or reserved, nothing running or queued."""
        try:
            stats = [self.stats(name) for name in self.workers]
        except grpc.RpcError:
            return False
        return all(s.kv_blocks_used == 0 and s.kv_blocks_reserved == 0 and s.num_running == 0
                   and s.num_queued == 0 and s.kv_writes_in_flight == 0 for s in stats)

    def open_streams(self, tenant: str = "default") -> int:
        """Stream slots the tenant holds in Redis: its live leases (services/state/fleet_state.py)."""
        client = redis.Redis.from_url(self.redis_url)
        try:
            return client.zcount(f"kvfleet:tenant:{tenant}:leases", f"({int(time.time() * 1000)}",
                                 "+inf")
        finally:
            client.close()

    def serves(self, timeout_s: float = 60.0) -> bool:
        """A small completion succeeds within `timeout_s` (retrying while the fleet heals)."""
        def ok() -> bool:
            try:
                r = httpx.post(f"{self.url}/v1/completions", timeout=10, json={
                    "model": self.model, "prompt": "are you back?", "max_tokens": 2})
            except httpx.HTTPError:
                return False
            return r.status_code == 200
        return wait_until(ok, timeout_s, interval_s=0.2)


@contextmanager
def kvfleet_up(redis_url: str, model_dir: str, config: str, mode: str = "disagg",
               env: dict[str, str] | None = None, args: tuple[str, ...] = ()):
    """Start `kvfleet up` (with `args` added), yield an UpFleet once READY; always SIGTERM it (and
    SIGKILL its process group if it does not end), so no child outlives the test."""
    http = free_port()
    db_url = f"{redis_url.rsplit('/', 1)[0]}/{next(_db) % 16}"
    redis.Redis.from_url(db_url).flushdb()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli.cli", "up", "--model", model_dir, "--mode", mode,
         "--http-port", str(http), "--grpc-port", str(free_port()), "--redis-url", db_url,
         "--kv-cache-mib", "32", "--config", config, *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "KVFLEET_FLEET_TOKEN": TOKEN, "KVFLEET_STREAM_LEASE_TTL_S": "3",
             **(env or {})})
    try:
        banner = read_banner(proc.stdout)
        fleet = UpFleet(proc, f"127.0.0.1:{http}", db_url, banner.workers, banner.lines)
        _drain_output(fleet)
        fleet.model = httpx.get(f"{fleet.url}/v1/models", timeout=10).json()["data"][0]["id"]
        yield fleet
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _drain_output(fleet: UpFleet) -> None:
    """Keep reading `kvfleet up`'s output (its supervisor's lines) so its pipe never fills."""
    import threading

    def pump():
        for line in fleet.proc.stdout:
            fleet.lines.append(line.rstrip())
    threading.Thread(target=pump, daemon=True).start()


# ------------------------------------------------------------------------------- streams
@dataclass
class StreamResult:
    """How one SSE stream ended: its finish reason, or the error event, or that the connection
    broke; tokens received; seconds it took."""
    tokens: int = 0               # content deltas received
    completion_tokens: int = 0    # the final usage event's count
    finish_reason: str | None = None
    error: dict | None = None
    broken: str | None = None
    done: bool = False            # [DONE] arrived
    status: int = 0
    seconds: float = 0.0


async def stream_chat(client: httpx.AsyncClient, model: str,
                      first_token: asyncio.Event | None = None, max_tokens: int = OUTPUT_CAP,
                      prompt: str = "tell me a long story") -> StreamResult:
    result, started = StreamResult(), time.monotonic()
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            result.status = r.status_code
            if r.status_code != 200:
                result.error = json.loads(await r.aread())["error"]
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    result.done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = event["error"]
                    continue
                if event.get("usage"):
                    result.completion_tokens = event["usage"]["completion_tokens"]
                if not event["choices"]:
                    continue
                choice = event["choices"][0]
                if choice["delta"].get("content"):
                    result.tokens += 1
                    if first_token is not None:
                        first_token.set()
                result.finish_reason = choice["finish_reason"] or result.finish_reason
    except httpx.HTTPError as e:
        result.broken = f"{type(e).__name__}: {e}"
    finally:
        result.seconds = time.monotonic() - started
    return result
