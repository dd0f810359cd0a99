"""`kvfleet up` on a real model (SmolLM2-135M-Instruct, as `kvfleet make-model` writes it): a
chat completion through the openai client answers a factual question, and stops on <|im_end|>."""
from __future__ import annotations

import openai
import pytest

from tests.harness import up_fleet


@pytest.mark.real_model("SmolLM2 answers a chat")
def test_kvfleet_up_on_smollm2_answers_a_chat_through_the_openai_client(smollm2_dir):
    with up_fleet(smollm2_dir, kv_cache_mib=64, engine="real") as up:
        client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused",
                               timeout=120, max_retries=0)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, temperature=0, max_tokens=32,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        answer = reply.choices[0].message.content
        assert "Paris" in answer, (answer, up.lines)
        assert reply.choices[0].finish_reason == "stop", answer     # <|im_end|> ended it
        assert "<|im_end|>" not in answer and "<|im_start|>" not in answer
