"""`kvfleet up --mode disagg --kv-cache-dtype fp8`: both workers keep an fp8 cache (twice a bf16
cache's blocks, four times the tiny model's fp32 blocks, in the same --kv-cache-mib) and a request's
KV moves from the prefill worker to the decode worker as fp8 bytes."""
from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.waiting import wait_until
from tests.harness import up_fleet

MIB = 32                                  # --kv-cache-mib of this test's fleet
FP8_BLOCKS = (MIB << 20) // (16 * 512)    # tiny model: 4 layers x 2 x 2 kv heads x 32 dims x 1 byte


def blocks_total(metrics_address: str) -> float:
    text = httpx.get(f"http://{metrics_address}/metrics", timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "kvfleet_kv_blocks" and s.labels["state"] == "total")


@pytest.mark.real_model("fp8 block counts: the simulated core sizes its pool by --sim-kv-tokens")
def test_a_disaggregated_fleet_serves_from_fp8_kv(tiny_model_dir):
    with up_fleet(tiny_model_dir, "--kv-cache-dtype", "fp8", mode="disagg",
                    kv_cache_mib=MIB, engine="real") as up:
        workers = {name: w.metrics_url.removeprefix("http://").removesuffix("/metrics")
                   for name, w in up.workers.items() if w.metrics_url}
        assert sorted(w.role for w in up.workers.values()) == ["decode", "prefill"], up.lines
        assert len(workers) == 2, up.lines
        url, name = up.url, up.model
        prompt = "a prompt long enough to fill several KV blocks of sixteen tokens " * 3
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"model": name, "prompt": prompt, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 6
        assert body["timing"]["transfer_s"] > 0          # the KV moved, prefill -> decode
        for address in workers.values():               # the gauges follow the heartbeat's period
            assert wait_until(lambda: blocks_total(address) == FP8_BLOCKS, timeout_s=30), blocks_total(address)
