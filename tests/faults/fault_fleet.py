"""The fault suite's fleet: `kvfleet up` as an operator runs it (tests/harness.py), the whole
supervised fleet as one process tree on 127.0.0.1 with a real redis-server (a db of its own), its
engine config and fleet token; and the SSE streams a test runs through it while breaking it."""
from __future__ import annotations

import asyncio
import itertools
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import redis
import yaml

from tests.harness import TEST_TTFT_TARGET_S, up_fleet
from tests.waiting import wait_until

TOKEN = "fault-suite-fleet-token-0123456789"
OUTPUT_CAP = 48           # the interactive class's output cap in these fleets
# 3-s stream-slot leases, renewed every 0.6 s: a dead gateway's slots come back within 3 s
LEASE_3S = ("--timeout-lease-ttl-s", "3", "--timeout-lease-renew-s", "0.6")
_db = itertools.count(8)


def engine_config(tmp_path) -> str:
    """The workers' and the gateway's engine YAML: default classes, but a small interactive
    output cap so that max_tokens past it is cheap to reach, and the test fleets' TTFT target
    (tests/harness.py): these tests are about kills and freezes, not admission."""
    path = tmp_path / "engine.yaml"
    path.write_text(yaml.safe_dump({"scheduler": {"classes": [
        {"name": "interactive", "priority": 2, "ttft_target_s": TEST_TTFT_TARGET_S,
         "itl_target_s": 0.1, "max_prompt_tokens": 8192, "output_cap": OUTPUT_CAP,
         "predicted_output_tokens": 32, "aging_s": 10.0},
        {"name": "document", "priority": 1, "ttft_target_s": TEST_TTFT_TARGET_S,
         "itl_target_s": 0.1, "max_prompt_tokens": 32768, "output_cap": 1024,
         "predicted_output_tokens": 256, "aging_s": 10.0, "share_while_interactive_waits": 0.5}]}}))
    return str(path)


def exit_said(fleet, name: str, timeout_s: float = 30.0) -> str:
    """The supervisor's line saying how `name` exited ("" if none came within the deadline).
    Waited for: a test sees a restart in /proc at once, while the line reaches `fleet.lines`
    through the pump thread that reads `kvfleet up`'s output, possibly a moment later."""
    mark = f"{name} exited with status "

    def said() -> str:
        return next((line for line in list(fleet.lines) if mark in line), "")
    wait_until(lambda: bool(said()), timeout_s)
    return said()


@contextmanager
def supervised_fleet(redis_url: str, model_dir: str, config: str, mode: str = "disagg",
                     env: dict[str, str] | None = None, args: tuple[str, ...] = ()):
    """`kvfleet up` (tests/harness.py) on a Redis db of its own (flushed), with this suite's fleet
    token, engine config and 3-s stream leases (`args` added to its command line); yields its
    UpFleet."""
    db_url = f"{redis_url.rsplit('/', 1)[0]}/{next(_db) % 16}"
    redis.Redis.from_url(db_url).flushdb()
    with up_fleet(model_dir, *LEASE_3S, *args, mode=mode, redis_url=db_url, config=config,
                    token=TOKEN, env=env) as fleet:
        yield fleet


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
