"""`kvfleet up --engine sim`: the whole real fleet (gateway, router, Redis, workers, the tcp KV
transport) over simulated engine cores, served to the openai client with the shapes a real
fleet's responses have. No worker loads weights; the KV blocks still move over tcp."""
from __future__ import annotations

import re

import httpx
import openai
import pytest

from tests.harness import up_fleet

SIM = ["--engine", "sim", "--sim-step-ms", "2", "--sim-kv-tokens", "65536",
       "--sim-output-len", "fixed:6", "--sim-network-gbps", "100"]


def kv_sent_bytes(lines: list[str]) -> float:
    """The tcp KV bytes the fleet's workers counted as sent, from their /metrics."""
    total = 0.0
    for line in lines:
        parts = line.split()
        if len(parts) == 4 and parts[0] == "listen" and parts[2] == "metrics":
            text = httpx.get(f"http://{parts[3]}/metrics", timeout=10).text
            total += sum(float(m) for m in re.findall(
                r'^kvfleet_kv_transfer_bytes_total\{[^}]*backend="tcp"[^}]*direction="sent"[^}]*\} (\S+)',
                text, re.M))
    return total


@pytest.mark.parametrize("mode", ["disagg", "colocated"])
def test_a_sim_fleet_serves_the_openai_client_as_a_real_one(tiny_model_dir, mode):
    with up_fleet(tiny_model_dir, *SIM, mode=mode) as up:
        lines = up.lines
        client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        done = client.completions.create(model=model, prompt="The fleet says", max_tokens=40,
                                         seed=3)
        [choice] = done.choices
        assert choice.finish_reason == "stop" and choice.index == 0   # EOS at the drawn length
        assert done.usage.completion_tokens == 6 and done.usage.prompt_tokens > 0
        assert done.usage.total_tokens == done.usage.prompt_tokens + 6
        again = client.completions.create(model=model, prompt="The fleet says", max_tokens=40,
                                          seed=3)
        assert again.choices[0].text == choice.text                   # deterministic per seed
        capped = client.completions.create(model=model, prompt="Hello", max_tokens=3, seed=1)
        assert capped.choices[0].finish_reason == "length"
        assert capped.usage.completion_tokens == 3

        chunks = list(client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=20,
            stream=True, stream_options={"include_usage": True}))
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert reasons[-1] == "stop" and all(r is None for r in reasons[:-1])
        assert chunks[-1].usage.completion_tokens == 6

        sent = kv_sent_bytes(lines)
        if mode == "disagg":
            assert sent > 0          # the prompts' KV (the sim's small blocks) went over tcp
        else:
            assert sent == 0
