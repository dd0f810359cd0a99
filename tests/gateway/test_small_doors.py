"""The gateway's small doors, against the package's real fleet and gateway (4096-token context):
/tokenize and truncate_prompt_tokens refuse text too long to be a prompt before tokenizing it, and
/tokenize never returns more ids than the context; /metrics can ask for a key of its own."""
from __future__ import annotations

import httpx
import pytest

from services.gateway.__main__ import METRICS_KEY_ENV, metrics_key
from services.gateway.validation import TEXT_CHARS_PER_CONTEXT_TOKEN
from tests.gateway.gateway_helpers import CONTEXT, openai_error
from tests.harness import start_gateway

TOO_LONG = "a" * (TEXT_CHARS_PER_CONTEXT_TOKEN * CONTEXT + 1)
LIMIT = str(TEXT_CHARS_PER_CONTEXT_TOKEN * CONTEXT)
# short in characters, long in tokens: each of these characters is several byte-level tokens
MANY_TOKENS = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(CONTEXT + 8))


@pytest.mark.parametrize("body", [{"prompt": TOO_LONG},
                                  {"messages": [{"role": "user", "content": TOO_LONG}]}])
def test_tokenize_refuses_text_far_past_the_context_naming_the_limit(gateway, body):
    with gateway.client() as c:
        error = openai_error(c.post("/tokenize", json=body), 413)
    assert error["code"] == "text_too_long" and LIMIT in error["message"]


def test_tokenize_never_returns_more_ids_than_the_context(gateway):
    with gateway.client() as c:
        r = c.post("/tokenize", json={"prompt": MANY_TOKENS})
    error = openai_error(r, 400)
    assert error["code"] == "context_length_exceeded" and str(CONTEXT) in error["message"]


def test_truncation_refuses_text_far_past_the_context_before_tokenizing_it(gateway):
    with gateway.client() as c:
        long = c.post("/v1/completions", json={"prompt": TOO_LONG, "max_tokens": 2,
                                                "truncate_prompt_tokens": 16})
        fits = c.post("/v1/completions", json={"prompt": "hello " * 3000, "max_tokens": 2,
                                                "truncate_prompt_tokens": 16})
    assert openai_error(long, 413)["param"] == "prompt"
    assert fits.status_code == 200 and fits.json()["usage"]["prompt_tokens"] == 16


def test_metrics_with_a_key_file_ask_for_that_key(fleet, tiny_model_dir, configs, tmp_path):
    key_file = tmp_path / "metrics.key"
    key_file.write_text("scrape-secret-1\n")
    engine_yaml, keys_yaml = configs
    gw = start_gateway(fleet, str(tiny_model_dir), "gateway-metrics-key", "--config", engine_yaml,
                       "--api-keys", keys_yaml, "--metrics-key-file", str(key_file))
    url = f"http://{gw.http}/metrics"
    try:
        none = httpx.get(url, timeout=10)
        api_key = httpx.get(url, timeout=10, headers={"Authorization": "Bearer sk-acme-0001"})
        right = httpx.get(url, timeout=10, headers={"Authorization": "Bearer scrape-secret-1"})
    finally:
        fleet.launcher.stop("gateway-metrics-key")
    assert openai_error(none, 401) and openai_error(api_key, 401)   # a tenant's key is not it
    assert right.status_code == 200 and "kvfleet_" in right.text


def test_the_metrics_key_comes_from_the_file_else_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(METRICS_KEY_ENV, raising=False)
    assert metrics_key(None) is None                       # open, as before
    monkeypatch.setenv(METRICS_KEY_ENV, "from-env")
    assert metrics_key(None) == "from-env"
    (tmp_path / "k").write_text("from-file\n")
    assert metrics_key(str(tmp_path / "k")) == "from-file"
