"""`kvfleet up --fallback-model`: a second pool serving a second checkpoint. At S0 everything is
served by the primary; once the fleet's stage record says S3 (set here in Redis, as the stage
keeper would), a degradable class's request is served by the fallback pool and its response says
so (the quality version in `system_fingerprint` and the header, the pool in `timing`), while a
non-degradable class and a critical tenant stay on the primary. The served model name does not
change: clients match on it.

Simulated engine cores (fast); the two checkpoints are tiny models with different seeds (the same
tokenizer), so their quality versions differ by their weights."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from services.engine.tiny_model import make_tiny_model
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.state.fleet_state import FleetState
from services.state.stage_record import StageRecord, StageStore
from tests.harness import up_fleet
from tests.waiting import wait_until

SIM = ["--engine", "sim", "--sim-step-ms", "2", "--sim-kv-tokens", "65536",
       "--sim-output-len", "fixed:4", "--sim-network-gbps", "100"]
CONFIG = """
scheduler:
  tenants:
    - {name: acme}
    - {name: vip, critical: true}
  default_tenant: acme
"""
KEYS = """
- {key: sk-acme, tenant: acme, traffic_class: interactive, allowed_classes: [document],
   max_concurrent_streams: 16, requests_per_minute: 10000, tokens_per_minute: 10000000}
- {key: sk-vip, tenant: vip, traffic_class: interactive,
   max_concurrent_streams: 16, requests_per_minute: 10000, tokens_per_minute: 10000000}
"""


@pytest.fixture(scope="module")
def fallback_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-fallback"), seed=1)


def complete(up, key: str, traffic_class: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    if traffic_class:
        headers["x-kvfleet-traffic-class"] = traffic_class
    r = httpx.post(f"{up.url}/v1/completions", headers=headers, timeout=60, json={
        "model": up_model(up), "prompt": "The fleet says", "max_tokens": 8, "seed": 1})
    assert r.status_code == 200, r.text
    return r


def up_model(up) -> str:
    return httpx.get(f"{up.url}/v1/models", timeout=10,
                     headers={"Authorization": "Bearer sk-acme"}).json()["data"][0]["id"]


def served(r: httpx.Response) -> tuple[str, str]:
    """(pool, quality version) a response names; the header and the body agree."""
    body = r.json()
    assert body["system_fingerprint"] == r.headers["x-kvfleet-quality-version"]
    return body["timing"]["pool"], body["system_fingerprint"]


def pools(redis_url: str) -> dict[str, set[str]]:
    """Each pool's quality versions, from the workers' heartbeats."""
    async def read():
        async with FleetState(redis_url) as state:
            workers = await state.live_workers()
        out: dict[str, set[str]] = {}
        for w in workers:
            out.setdefault(w.pool or "primary", set()).add(w.quality_version)
        return out
    return asyncio.run(read())


def set_stage(redis_url: str, stage: int) -> None:
    async def write():
        async with FleetState(redis_url) as state:
            store = StageStore(state.redis)
            seen = await store.read()
            assert await store.change(seen, stage, time.time(), "set by the test", "test")
    asyncio.run(write())


@pytest.mark.parametrize("mode", ["colocated", "disagg"])
def test_at_s3_degradable_requests_go_to_the_fallback_pool_and_say_so(
        tiny_model_dir, fallback_dir, tmp_path, mode):
    (tmp_path / "engine.yaml").write_text(CONFIG)
    (tmp_path / "keys.yaml").write_text(KEYS)
    with up_fleet(tiny_model_dir, "--fallback-model", str(fallback_dir), *SIM, mode=mode,
                    config=str(tmp_path / "engine.yaml"),
                    api_keys=str(tmp_path / "keys.yaml")) as up:
        roles = 1 if mode == "colocated" else 2
        assert sum(name.startswith("fallback-") for name in up.workers) == roles
        assert wait_until(lambda: set(pools(up.redis_url)) == {"primary", "fallback"}, 30)
        versions = pools(up.redis_url)
        [primary], [fallback] = versions["primary"], versions["fallback"]   # one per pool
        assert primary != fallback and primary and fallback

        # S0: everything on the primary, the model name as served
        r = complete(up, "sk-acme")
        assert served(r) == ("primary", primary)
        assert r.json()["model"] == r.headers["x-kvfleet-model"] == up_model(up)

        set_stage(up.redis_url, pb.S3_FALLBACK)
        # routers re-read the stage within a fraction of a second
        assert wait_until(lambda: served(complete(up, "sk-acme"))[0] == "fallback", 30)
        r = complete(up, "sk-acme")                              # interactive: degradable
        assert served(r) == ("fallback", fallback)
        assert r.json()["model"] == up_model(up)                 # clients still match on it
        assert served(complete(up, "sk-acme", "document")) == ("primary", primary)  # not degradable
        assert served(complete(up, "sk-vip")) == ("primary", primary)       # a critical tenant

        set_stage(up.redis_url, pb.S0_NORMAL)
        assert wait_until(lambda: served(complete(up, "sk-acme"))[0] == "primary", 30)


def test_a_fallback_with_another_tokenizer_is_refused_by_name(tiny_model_dir, tmp_path):
    other = make_tiny_model(tmp_path / "other", seed=1, vocab=2048)
    with pytest.raises(RuntimeError, match="another tokenizer"):
        with up_fleet(tiny_model_dir, "--fallback-model", str(other), *SIM, mode="colocated"):
            pass
