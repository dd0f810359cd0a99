"""Traffic classes without configuration, and asynchronous jobs for long documents.

The gateways here ask a RouterProxy (tests/gateway/router_proxy.py: a real gRPC server recording
what the router receives, refusing documents on demand, forwarding the rest to the fleet's
router), with a document threshold of 64 tokens so a long prompt is cheap for the tiny model.
"""
from __future__ import annotations

import grpc
import httpx
import pytest
import redis
import yaml

from tests.waiting import wait_until
from services.engine.config import SchedulerConfig, Tenant
from services.gateway.auth import key_id
from services.gateway.classes import ClassChoice, auto, choose
from services.gateway.config import ApiKey, GatewayConfig
from services.gateway.errors import GatewayError
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from tests.gateway.gateway_helpers import KEYS, key, openai_error
from tests.harness import Gateway
from tests.gateway.router_proxy import RouterProxy

THRESHOLD = 64
SHORT = "Say hello."
LONG = "The quick brown fox jumps over the lazy dog. " * 30     # well over 64 tokens
ASYNC = {"Prefer": "respond-async"}
MY_KEYS = {
    **KEYS,
    "auto": key("sk-auto-0010", "acme", "auto"),
    "picker": {**key("sk-picker-0011", "acme"), "allowed_classes": ["document"]},
    "jobber": key("sk-jobber-0012", "solo", "document"),
}


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {MY_KEYS[name]['key']}"}


@pytest.fixture(scope="module")
def proxy(fleet):
    with RouterProxy(fleet) as p:
        yield p


@pytest.fixture(scope="module")
def keys_yaml(tmp_path_factory):
    path = tmp_path_factory.mktemp("class-keys") / "keys.yaml"
    path.write_text(yaml.safe_dump(list(MY_KEYS.values())))
    return str(path)


def start(fleet, model_dir, configs, proxy, name: str, *extra: str) -> Gateway:
    http = fleet.launcher.start(name, [
        "services.gateway", "--model", str(model_dir), "--router", proxy.address,
        "--redis-url", fleet.redis_url, "--config", configs[0],
        "--document-threshold-tokens", str(THRESHOLD), "--job-lease-s", "1", *extra])
    grpc_line = next(line for line in fleet.launcher.children[name].lines
                     if line.startswith("GRPC "))
    return Gateway(http=http, grpc=grpc_line.split()[-1], model=str(model_dir).rsplit("/", 1)[-1])


@pytest.fixture(scope="module")
def anonymous(fleet, tiny_model_dir, configs, proxy):
    yield start(fleet, tiny_model_dir, configs, proxy, "gw-anonymous")
    fleet.launcher.stop("gw-anonymous")


@pytest.fixture(scope="module")
def keyed(fleet, tiny_model_dir, configs, proxy, keys_yaml):
    yield start(fleet, tiny_model_dir, configs, proxy, "gw-keyed", "--api-keys", keys_yaml)
    fleet.launcher.stop("gw-keyed")


def complete(gateway: Gateway, prompt: str, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"http://{gateway.http}/v1/completions", headers=headers or {}, timeout=60,
                      json={"model": gateway.model, "prompt": prompt, "max_tokens": 4})


def routed_class(proxy: RouterProxy, response: httpx.Response) -> str:
    """The class of the WorkRequest the router received for this response's request."""
    rid = response.headers["x-request-id"]
    return next(r.traffic_class for r in reversed(proxy.received) if r.request_id == rid)


# ----------------------------------------------------------------- choosing a class
def test_without_a_key_a_long_prompt_is_a_document_and_a_short_one_interactive(anonymous, proxy):
    short, long = complete(anonymous, SHORT), complete(anonymous, LONG)
    assert short.status_code == 200 and long.status_code == 200, (short.text, long.text)
    assert long.json()["usage"]["prompt_tokens"] > THRESHOLD >= short.json()["usage"]["prompt_tokens"]
    assert short.headers["x-kvfleet-traffic-class"] == routed_class(proxy, short) == "interactive"
    assert long.headers["x-kvfleet-traffic-class"] == routed_class(proxy, long) == "document"


def test_a_key_of_class_auto_chooses_by_length_and_a_fixed_key_keeps_its_class(keyed, proxy):
    assert routed_class(proxy, complete(keyed, LONG, bearer("auto"))) == "document"
    assert routed_class(proxy, complete(keyed, SHORT, bearer("auto"))) == "interactive"
    fixed = complete(keyed, SHORT, bearer("doc"))
    assert fixed.headers["x-kvfleet-traffic-class"] == routed_class(proxy, fixed) == "document"


def test_a_request_may_ask_for_a_class_its_key_allows_and_no_other(keyed, proxy):
    asked = complete(keyed, SHORT, {**bearer("picker"), "x-kvfleet-traffic-class": "document"})
    assert asked.status_code == 200 and routed_class(proxy, asked) == "document"
    refused = complete(keyed, SHORT, {**bearer("picker"), "x-kvfleet-traffic-class": "batch"})
    error = openai_error(refused, 403)
    assert error["code"] == "traffic_class_not_allowed" and "['interactive', 'document']" in error["message"]
    openai_error(complete(keyed, SHORT, {**bearer("acme"), "x-kvfleet-traffic-class": "document"}), 403)


def test_over_grpc_the_request_field_asks_for_a_class(keyed, proxy):
    with grpc.insecure_channel(keyed.grpc) as channel:
        stub = pb_grpc.GatewayStub(channel)
        metadata = (("authorization", bearer("picker")["Authorization"]),)
        request = pb.GenerateRequest(text=SHORT, params=pb.SamplingParams(max_tokens=3),
                                     traffic_class="document")
        call = stub.Generate(request, metadata=metadata)
        assert list(call)[-1].finished
        assert dict(call.initial_metadata())["x-kvfleet-traffic-class"] == "document"
        request.traffic_class = "batch"
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request, metadata=metadata))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "may use ['interactive', 'document']" in refused.value.details()


def test_the_choice_follows_the_threshold_and_checks_against_the_widest_class():
    config = GatewayConfig(model_dir="-", served_model_name="m", router="r:1", redis_url="redis://x",
                           document_threshold_tokens=100)
    choice = auto(config, "default")
    assert [choice.pick(n).name for n in (1, 100, 101)] == ["interactive", "interactive", "document"]
    assert choice.widest.name == "document"
    anon = config.anonymous_key
    assert choose(config, anon, "batch") == ClassChoice.fixed(config.traffic_class("batch"))
    no_pick = ApiKey("k", "default", "interactive", 1, 1, 1)
    with pytest.raises(GatewayError) as refused:
        choose(config, no_pick, "document")
    assert refused.value.status == 403
    no_documents = SchedulerConfig(tenants=(Tenant("default", classes=("interactive",)),))
    config = GatewayConfig(model_dir="-", served_model_name="m", router="r:1", redis_url="redis://x",
                           scheduler=no_documents)
    assert auto(config, "default").pick(10**6).name == "interactive"


# ------------------------------------------------------------------------ async jobs
def tokens_charged(redis_url: str, tenant: str) -> int:
    r = redis.Redis.from_url(redis_url)
    try:
        return sum(int(r.get(k) or 0) for k in r.scan_iter(f"kvfleet:tenant:{tenant}:tokens:*"))
    finally:
        r.close()


def job_of(gateway: Gateway, location: str, key_name: str) -> httpx.Response:
    return httpx.get(f"http://{gateway.http}{location}", headers=bearer(key_name), timeout=10)


def finished(gateway: Gateway, location: str, key_name: str = "jobber") -> dict:
    done = {}

    def check() -> bool:
        done.update(job_of(gateway, location, key_name).json())
        return done["status"] in ("completed", "failed")
    assert wait_until(check, 60, 0.1), done
    return done


def test_a_document_refused_for_time_becomes_a_job_that_completes(keyed, proxy, fleet):
    proxy.refusals["document"] = 1
    refused = complete(keyed, LONG, bearer("jobber"))          # no preference: the refusal
    assert openai_error(refused, 429)["code"] == "overloaded"

    before = tokens_charged(fleet.redis_url, "solo")
    proxy.refusals["document"] = 2              # the request, then the job's first attempt
    accepted = complete(keyed, LONG, {**bearer("jobber"), **ASYNC})
    assert accepted.status_code == 202, accepted.text
    assert accepted.headers["preference-applied"] == "respond-async"
    location = accepted.headers["location"]
    assert location == f"/v1/jobs/{accepted.json()['id']}" and accepted.json()["status"] == "queued"

    job = finished(keyed, location)
    assert job["status"] == "completed" and job["attempts"] == 2, job
    result = job["result"]
    assert result["object"] == "text_completion" and result["choices"][0]["text"]
    usage = result["usage"]
    charged = tokens_charged(fleet.redis_url, "solo") - before
    # every admission charges the prompt up front; the generated tokens when the request ends
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= charged
    assert charged <= 3 * usage["prompt_tokens"] + usage["completion_tokens"]

    error = openai_error(job_of(keyed, location, "leaver"), 404)   # another tenant
    assert error["code"] == "not_found"
    assert job_of(keyed, location, "acme").status_code == 404      # nor another tenant's key


def test_only_a_non_streamed_refusal_for_time_outside_interactive_is_offered_a_job(keyed, proxy):
    proxy.refusals.update({"interactive": 1, "document": 1})
    chat = complete(keyed, SHORT, {**bearer("acme"), **ASYNC})        # interactive: no job
    assert openai_error(chat, 429)["code"] == "overloaded"
    streamed = httpx.post(f"http://{keyed.http}/v1/completions", timeout=60,
                          headers={**bearer("jobber"), **ASYNC},
                          json={"model": keyed.model, "prompt": LONG, "max_tokens": 4,
                                "stream": True})
    assert openai_error(streamed, 429)["code"] == "overloaded"
    assert not proxy.refusals["interactive"] and not proxy.refusals["document"]
    served = complete(keyed, LONG, {**bearer("jobber"), **ASYNC})   # not refused: served at once
    assert served.status_code == 200 and served.json()["choices"]


def test_a_job_survives_its_gateway(fleet, tiny_model_dir, configs, proxy, keys_yaml):
    first = start(fleet, tiny_model_dir, configs, proxy, "gw-jobs-a", "--api-keys", keys_yaml)
    proxy.refusals["document"] = 10**6                   # admitted only once the first gateway is gone
    accepted = complete(first, LONG, {**bearer("jobber"), **ASYNC})
    assert accepted.status_code == 202, accepted.text
    location = accepted.headers["location"]
    fleet.launcher.kill("gw-jobs-a")                # SIGKILL: no goodbye, its lease just lapses
    try:
        proxy.refusals.clear()
        second = start(fleet, tiny_model_dir, configs, proxy, "gw-jobs-b", "--api-keys", keys_yaml)
        job = finished(second, location)
        assert job["status"] == "completed" and job["result"]["choices"], job["error"]
        assert job_of(second, location, "leaver").status_code == 404
    finally:
        fleet.launcher.stop("gw-jobs-b")
        proxy.refusals.clear()


def test_a_job_record_names_its_key_by_digest_only():
    ids = {key_id(ApiKey(**k)) for k in MY_KEYS.values()}
    assert len(ids) == len(MY_KEYS)
    assert not any(k["key"] in i for k in MY_KEYS.values() for i in ids)
