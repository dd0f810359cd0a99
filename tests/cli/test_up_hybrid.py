"""`kvfleet up --mode hybrid` as a user runs it: a mixed worker beside a prefill and a decode worker,
the routers told where to split (here 16 tokens). A short completion is placed on the mixed worker,
a long one on the prefill and decode workers (the router's placement counter says where), and both
answer 200 through the REST API."""
from __future__ import annotations

import re

import httpx

from tests.harness import up_fleet

LONG_PROMPT = " ".join(["the fleet splits long prompts from short ones"] * 8)


def placements(metrics_url: str) -> dict[tuple[str, str], float]:
    """The router's kvfleet_placements_total by (role, worker)."""
    text = httpx.get(metrics_url, timeout=10).text
    rows = re.findall(r'^kvfleet_placements_total\{role="(\w+)",worker="([\w-]+)"\} (\S+)$', text, re.M)
    return {(role, worker): float(n) for role, worker, n in rows}


def complete(fleet, prompt: str) -> httpx.Response:
    return httpx.post(f"{fleet.url}/v1/completions", timeout=60, json={
        "model": fleet.model, "prompt": prompt, "max_tokens": 4, "ignore_eos": True})


def test_kvfleet_up_hybrid_places_by_prompt_length(tiny_model_dir):
    with up_fleet(tiny_model_dir, "--mixed", "1", "--hybrid-threshold-tokens", "16",
                    mode="hybrid") as fleet:
        assert {w.role for w in fleet.workers.values()} == {"mixed", "prefill", "decode"}
        router = next(iter(fleet.routers.values())).metrics_url

        assert complete(fleet, "hi").status_code == 200
        assert placements(router).get(("mixed", "mixed-0")) == 1.0

        long = complete(fleet, LONG_PROMPT)
        assert long.status_code == 200 and long.json()["usage"]["prompt_tokens"] > 16
        after = placements(router)
        assert after.get(("prefill", "prefill-0")) == 1.0
        assert after.get(("decode", "decode-0")) == 1.0
        assert after.get(("mixed", "mixed-0")) == 1.0
