"""`kvfleet up --mode disagg --cuda-graphs on` on the CPU: the decode worker's engine core runs its
decode steps padded to fixed batch sizes (eagerly here; on CUDA they are replayed graphs), reading
the KV the prefill worker shipped into its cache. Four requests at once decode as one padded
batch; each answer is the in-process engine's (`--cuda-graphs off`) greedy text."""
from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from services.engine.engine import LLMEngine, engine_config
from services.engine.sampling_params import SamplingParams
from tests.harness import up_fleet

PROMPTS = ["the decode worker pads", "a batch of three rows to four", "and never writes", "padding"]
MAX_TOKENS = 8


@pytest.mark.real_model("the claim is that the fleet's greedy tokens equal the unpadded engine's")
def test_a_disaggregated_fleet_decodes_padded_steps_to_the_engines_greedy_text(tiny_model_dir):
    engine = LLMEngine(engine_config(str(tiny_model_dir), device="cpu", cuda_graphs="off"))
    want = [o.text for o in engine.generate(PROMPTS, SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))]

    with up_fleet(tiny_model_dir, "--cuda-graphs", "on", mode="disagg", engine="real") as up:
        async def ask(client: httpx.AsyncClient, prompt: str) -> str:
            r = await client.post(f"{up.url}/v1/completions", json={
                "model": up.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        async def all_at_once() -> list[str]:
            async with httpx.AsyncClient(timeout=120) as client:
                return list(await asyncio.gather(*(ask(client, p) for p in PROMPTS)))
        got = asyncio.run(all_at_once())
        log_dir = Path(up.log_dir)

    assert got == want
    decode_log = (log_dir / "decode-0.log").read_text()
    assert "cuda graphs on cpu: decode steps padded to batch sizes 1,2,4," in decode_log
