"""What gateway tests share: the engine config and API keys of their fleet (started by
tests/gateway/conftest.py through tests/harness.py), and readers of OpenAI answers, SSE bodies
and /metrics.

The worker and the gateway read the same engine config (`ENGINE_CONFIG`): the tenants the API keys
name, a 4096-token context and an interactive class capped at 2048 prompt tokens, so the length
limits are cheap to reach.
"""
from __future__ import annotations

import json
import time

import httpx
import yaml

from tests.harness import TEST_TTFT_TARGET_S
from tests.waiting import wait_until


CONTEXT = 4096
INTERACTIVE_MAX_PROMPT = 2048
# the test fleets' TTFT target (tests/harness.py): these tests' claims are not about admission
_CLASS_DEFAULTS = dict(ttft_target_s=TEST_TTFT_TARGET_S, itl_target_s=1.0, output_cap=2048,
                       predicted_output_tokens=256, aging_s=10.0)
ENGINE_CONFIG = {
    "max_model_len": CONTEXT,
    "scheduler": {
        "classes": [
            {"name": "interactive", "priority": 2, "max_prompt_tokens": INTERACTIVE_MAX_PROMPT,
             **_CLASS_DEFAULTS},
            {"name": "document", "priority": 1, "max_prompt_tokens": 131072, **_CLASS_DEFAULTS},
            {"name": "batch", "priority": 0, "max_prompt_tokens": 131072, **_CLASS_DEFAULTS},
        ],
        "tenants": [{"name": t} for t in ("default", "acme", "solo", "metered", "frugal", "leaver")],
    },
}


def key(secret: str, tenant: str, traffic_class: str = "interactive", streams: int = 64,
        rpm: int = 100_000, tpm: int = 10_000_000) -> dict:
    return {"key": secret, "tenant": tenant, "traffic_class": traffic_class,
            "max_concurrent_streams": streams, "requests_per_minute": rpm, "tokens_per_minute": tpm}


KEYS = {
    "acme": key("sk-acme-0001", "acme"),
    "doc": key("sk-acme-doc-0002", "acme", "document"),
    "solo": key("sk-solo-0003", "solo", streams=1),
    "metered": key("sk-metered-0004", "metered", rpm=2),
    "frugal": key("sk-frugal-0007", "frugal", tpm=40),
    "leaver": key("sk-leaver-0005", "leaver"),
}


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]['key']}"}


def write_configs(tmp) -> tuple[str, str]:
    engine, keys = tmp / "engine.yaml", tmp / "keys.yaml"
    engine.write_text(yaml.safe_dump(ENGINE_CONFIG))
    keys.write_text(yaml.safe_dump(list(KEYS.values())))
    return str(engine), str(keys)


def sse_data(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE body, in order (the last one should be [DONE])."""
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def events(payloads: list[str]) -> list[dict]:
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def openai_error(response: httpx.Response, status: int) -> dict:
    """Asserts the status and OpenAI's error shape; returns the error object."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def stream_counter(redis_client, tenant: str) -> int:
    """The tenant's open streams, as services/state/fleet_state.py keeps them: live leases."""
    return redis_client.zcount(f"kvfleet:tenant:{tenant}:leases", f"({int(time.time() * 1000)}",
                               "+inf")


def stream_holders(redis_client, tenant: str) -> list[str]:
    """The tenant's live leases by id (`holder/seq`: the gateway that holds each one)."""
    return [m.decode() for m in redis_client.zrangebyscore(
        f"kvfleet:tenant:{tenant}:leases", f"({int(time.time() * 1000)}", "+inf")]


def slots_free(redis_url: str, tenant: str, timeout_s: float = 15.0) -> None:
    """A quota story's start: the tenant holds no stream slot in Redis (a slot an earlier story's
    gateway left lapses within the lease's 10 s), else say who holds one."""
    import redis  # noqa: PLC0415
    client = redis.Redis.from_url(redis_url)
    try:
        assert wait_until(lambda: stream_counter(client, tenant) == 0, timeout_s), \
            f"tenant {tenant!r} still holds stream slots: {stream_holders(client, tenant)}"
    finally:
        client.close()


# ------------------------------------------------------------------------------ telemetry
def scrape(http: str) -> dict[tuple[str, frozenset], float]:
    """A gateway's /metrics (no key needed), parsed: (sample name, its labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415
    text = httpx.get(f"http://{http}/metrics", timeout=10).raise_for_status().text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples: dict, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)
