"""The claim both Ray fleets' stories make: the openai client gets the in-process engine's
greedy text from a Ray-launched fleet of the tiny model."""

from __future__ import annotations

import openai

from services.engine.engine import LLMEngine, engine_config
from services.engine.sampling_params import SamplingParams


def assert_engines_greedy_text(url: str, model: str, model_dir: str, prompt: str,
                               max_tokens: int = 12) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                    temperature=0)
    engine = LLMEngine(engine_config(model_dir, kv_cache_mib=8))
    (ref,) = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))
    assert out.choices[0].text == ref.text
    assert out.usage.completion_tokens == len(ref.token_ids)
