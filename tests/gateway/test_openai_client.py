"""The official `openai` Python client talks to the gateway as it would to OpenAI or vLLM."""
from __future__ import annotations

import openai
import pytest

from services.engine.sampling_params import SamplingParams
from tests.gateway.gateway_helpers import KEYS

MESSAGES = [{"role": "user", "content": "Write one word."}]


@pytest.fixture
def client(gateway):
    with openai.OpenAI(base_url=f"http://{gateway.http}/v1", api_key=KEYS["acme"]["key"],
                       max_retries=0) as c:
        yield c


def test_completions_and_chat_through_the_openai_client(client, gateway, engine):
    tok = engine.tokenizer
    chat_prompt = tok.encode(tok.apply_chat_template(MESSAGES), add_special_tokens=False)
    (ref,) = engine.generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=0.0,
                                                                  ignore_eos=True))
    (chat_ref,) = engine.generate([chat_prompt], SamplingParams(max_tokens=8, temperature=0.0,
                                                                ignore_eos=True))
    completion = client.completions.create(model=gateway.model, prompt="Once upon a time",
                                           max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(model=gateway.model, messages=MESSAGES, max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert completion.choices[0].text == ref.text and completion.usage.completion_tokens == 8
    assert chat.choices[0].message.content == chat_ref.text
    assert chat.system_fingerprint and chat.model == gateway.model


def test_streaming_chat_with_usage_through_the_openai_client(client, gateway):
    stream = client.chat.completions.create(model=gateway.model, messages=MESSAGES, max_tokens=6,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []
    assert chunks[-2].choices[0].finish_reason == "length"
    models = client.models.list()
    assert [m.id for m in models.data] == [gateway.model]


def test_errors_surface_as_the_openai_client_exceptions(gateway):
    with openai.OpenAI(base_url=f"http://{gateway.http}/v1", api_key="sk-wrong",
                       max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    with openai.OpenAI(base_url=f"http://{gateway.http}/v1", api_key=KEYS["acme"]["key"],
                       max_retries=0) as good:
        with pytest.raises(openai.NotFoundError):
            good.completions.create(model="gpt-4", prompt="x")
        with pytest.raises(openai.BadRequestError, match="allows at most 2048 prompt tokens"):
            good.completions.create(model=gateway.model, prompt=[7] * 2100, max_tokens=4)
